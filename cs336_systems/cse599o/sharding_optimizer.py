"""CSE599-O Problem 10: peak memory (after initialization, directly before and after the optimizer step, with
its breakdown) and time per iteration, with and without optimizer-state sharding, on the Table 1
Transformer. ``--help`` lists the options."""

import sys

from cs336_systems.cse599o.ddp_commands import sharding_main as main

if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "sharding_optimizer.py"))
