"""cs336_systems: profiling, FlashAttention-2 kernels, data-parallel training, optimizer-state sharding
and FSDP for the ``cs336_basics`` Transformer LM, plus the tools that turn measurements into the writeup."""

__version__ = "0.1.0"
