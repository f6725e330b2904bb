"""CSE599-O Problems 2 and 3: naive DDP checked against one process on the ToyModel (``--model toy``),
then timed on the Table 1 Transformer (``--model transformer``). ``--help`` lists the options."""

import sys

from cs336_systems.cse599o.ddp_commands import naive_main as main

if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "benchmark_naive_ddp.py"))
