"""Checkpoints of model + optimizer state, written so that a crash never costs the previous one."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, BinaryIO

import torch


def write_atomically(path: str | os.PathLike, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` to ``path`` so that ``path`` holds either its old contents or all of the new ones,
    never a part: a temporary file in the same folder, flushed and ``fsync``-ed, renamed over ``path``
    (atomic on POSIX), then the folder ``fsync``-ed so the rename itself survives a power cut."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
    out: str | os.PathLike | BinaryIO | IO[bytes],
) -> None:
    """Save both states and the iteration; to a path atomically (a kill mid-write leaves the old file)."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration}
    if not isinstance(out, str | os.PathLike):
        torch.save(state, out)
        return
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomically(out, [buffer.getbuffer()])


def load_checkpoint(
    src: str | os.PathLike | BinaryIO | IO[bytes], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Restore both states in place and return the saved iteration."""
    state = torch.load(src, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])
