"""Distributed training: the launcher, gradient synchronisation and the DDP strategies over it, optimizer-state
sharding and FSDP. Benchmarks of them live in :mod:`cs336_systems.benchmarking` and :mod:`cs336_systems.experiments`."""
