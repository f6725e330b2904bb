"""CSE599-O's DDP scripts, under the names and flags the course staff type.

The handout (Problems 2, 3, 4, 6, 8 and 10) has the staff run its scripts from the assignment's folder on one
node with two GPUs; here they live in this folder, and ``uv run`` finds the project's environment upward::

    cd cs336_systems/cse599o
    srun --gpus-per-node=2 uv run benchmark_naive_ddp.py --model toy          # "Naive DDP matches baseline!"
    srun --gpus-per-node=2 uv run benchmark_naive_ddp.py --model transformer  # time per iteration, communication
    srun --gpus-per-node=2 uv run benchmark_optimized_ddp.py --mode bucketed --bucket-size-mb 10
    srun --gpus-per-node=2 uv run sharding_optimizer.py                       # Problem 10: memory and time

One Slurm task spawns a rank per visible GPU; ``srun -n 2`` (a task per rank) and ``torchrun
--nproc-per-node 2`` work as well. Both scripts are thin: :mod:`cs336_systems.cse599o.ddp_commands` reads
the flags and hands the work to the library (naive DDP's toy check and the DDP step benchmark).
"""
