"""Distributed training: launcher, all-reduce benchmark, DDP strategies, optimizer sharding, FSDP."""
