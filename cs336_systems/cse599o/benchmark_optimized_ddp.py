"""CSE599-O Problems 4, 6 and 8: flat, overlapping (individual) and bucketed DDP timed on the Table 1
Transformer (``--mode flat|individual|bucketed``, ``--bucket-size-mb``). ``--help`` lists the options."""

import sys

from cs336_systems.cse599o.ddp_commands import optimized_main as main

if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "benchmark_optimized_ddp.py"))
