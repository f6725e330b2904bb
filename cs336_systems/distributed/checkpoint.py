"""Training checkpoints that cannot be half-written, mixed or silently corrupt, for every strategy.

``save_checkpoint(root, step, model=..., optimizer=..., scheduler=...)`` on every rank writes one
checkpoint; ``load_checkpoint(root, model=..., optimizer=..., scheduler=...)`` on every rank restores the
latest complete one, into the same or another world size where that is defined. What can go wrong with
``torch.save`` per rank, and what this does instead:

- **A kill while writing** leaves a truncated file where the good one was. Every file is written to a
  temporary name in the same folder, flushed and ``fsync``-ed, then renamed over (``os.replace`` is atomic
  on POSIX), and each step goes to a folder of its own (``step_00000120/``); ``latest`` names the newest
  *complete* step and moves only after every rank's files and the manifest are on disk, so an interrupted
  save leaves the previous checkpoint intact. Older steps beyond ``keep`` are removed after that.
- **Mixed files** (one rank's shard from another step, two ranks' files swapped, another world size):
  every file starts with a stamp — format, step, world size, rank, what it holds, byte count and the
  SHA-256 of its contents — and ``manifest.json`` lists every file with its checksum. Loading refuses, in
  one line, a file whose stamp or checksum disagrees with the manifest or with the rank loading it.
- **Corrupted bytes** fail the checksum instead of loading as NaNs.

Layouts (``world size`` = the saving run's):

================================  ==============================================  =========================
state                             files                                            other world sizes
================================  ==============================================  =========================
replicated model (DDP, 1 process) ``model.pt`` (rank 0)                            loads anywhere
FSDP model                        ``model-rank{r}.pt`` (each rank's shards)        resharded from all files
plain optimizer beside DDP        ``optimizer.pt`` (rank 0)                        any replicated model
``ShardedOptimizer`` (ZeRO-1)     ``optimizer-rank{r}.pt`` (each rank's shard)     merged and re-owned (not FSDP)
optimizer over FSDP shards        ``optimizer-rank{r}.pt``                         resharded when every state
                                                                                   tensor is per-element
scheduler, step, ``extra``        ``trainer.pt`` (rank 0)                          loads anywhere
================================  ==============================================  =========================

Resharding an FSDP model or its optimizer concatenates the saved 1-D shards into the full flat tensor and
cuts it again for the new world size: defined for parameters and for optimizer state with one value per
parameter element (AdamW's moments, SGD's momentum); anything else is refused naming it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.serialization import write_atomically
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

FORMAT = "cs336-checkpoint/1"
MAGIC = b"CS336CKPT\n"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (missing, incomplete, mixed, corrupted, another model)."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


# --------------------------------------------------------------------------------------------------
# One stamped file
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stamp:
    """What a file says about itself (its first line after the magic bytes)."""

    step: int
    world_size: int
    rank: int | None  # None: one file for all ranks
    holds: str  # "model", "optimizer" or "trainer"
    sha256: str
    nbytes: int

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}


def write_stamped(path: Path, state: Any, *, step: int, world_size: int, rank: int | None, holds: str) -> Stamp:
    """``torch.save(state)`` behind a stamp, written atomically (temporary file, fsync, rename)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    stamp = Stamp(step, world_size, rank, holds, hashlib.sha256(payload).hexdigest(), len(payload))
    write_atomically(path, [MAGIC, json.dumps(stamp.record()).encode() + b"\n", payload])
    return stamp


def read_stamped(path: Path) -> tuple[Stamp, Any]:
    """The stamp and the state of a file written by :func:`write_stamped`; ``CheckpointError`` if the file
    is not one, is truncated, or fails its checksum."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a checkpoint file of this format (no {MAGIC.strip().decode()} header)")
    header_end = data.find(b"\n", len(MAGIC))
    try:
        record = json.loads(data[len(MAGIC) : header_end])
        written_as = record.pop("format")
        stamp = Stamp(**record)
    except (ValueError, TypeError, KeyError):
        raise CheckpointError(f"{path}: its stamp is unreadable (a damaged file)") from None
    if written_as != FORMAT:
        raise CheckpointError(f"{path}: written by another checkpoint format ({written_as})")
    payload = memoryview(data)[header_end + 1 :]
    if len(payload) != stamp.nbytes:
        raise CheckpointError(f"{path}: {len(payload)} bytes where its stamp says {stamp.nbytes} (a truncated file)")
    if hashlib.sha256(payload).hexdigest() != stamp.sha256:
        raise CheckpointError(f"{path}: its contents fail their SHA-256 checksum (the file is corrupted)")
    return stamp, torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------------
# What each rank saves
# --------------------------------------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` is the model's: through our DDP wrappers and torch DDP."""
    return model.module if not isinstance(model, FSDP) and isinstance(getattr(model, "module", None), nn.Module) \
        else model


def _files_of(model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int) -> Iterator[tuple[str, str, Any]]:
    """``(file name, holds, state)`` for what this rank writes."""
    if isinstance(model, FSDP):
        yield f"model-rank{rank}.pt", "model", model.sharded_state_dict()
    elif rank == 0:
        yield "model.pt", "model", _unwrap(model).state_dict()
    if isinstance(optimizer, ShardedOptimizer):
        yield f"optimizer-rank{rank}.pt", "optimizer", optimizer.shard_state_dict()
    elif optimizer is not None and isinstance(model, FSDP):
        yield f"optimizer-rank{rank}.pt", "optimizer", optimizer.state_dict()
    elif optimizer is not None and rank == 0:
        yield "optimizer.pt", "optimizer", optimizer.state_dict()


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra: dict[str, Any] | None = None,
    keep: int | None = 2,
) -> Path:
    """Save step ``step`` under ``root`` (a collective: call it on every rank with the same arguments) and
    return its folder. ``extra``: more state for rank 0 to keep (plain data and tensors). ``keep``: how
    many complete steps to keep up to this one (``None``: all); steps above it (left by a run that resumed
    from an earlier step) are not touched."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    rank, world_size = _world()
    if isinstance(model, FSDP) and world_size > 1 and model.process_group is not None:
        raise ValueError("save_checkpoint: FSDP over a subgroup (hybrid sharding) is not supported: its files would "
                         "be named by global rank but hold the group's shards")
    folder = step_folder(root, step)
    # Written beside the final folder and moved into place when complete: a complete save of the same step
    # (a resume that saves its own step again) is replaced only then.
    staging = folder.with_name(folder.name + ".partial")
    if rank == 0:
        if staging.exists():  # an earlier save of this step that was interrupted
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    _barrier()
    records = {}
    for name, holds, state in _files_of(model, optimizer, rank):
        stamp = write_stamped(staging / name, state, step=step, world_size=world_size, rank=rank, holds=holds)
        records[name] = stamp.record()
    if rank == 0:
        trainer = {"step": step, "scheduler": scheduler.state_dict() if scheduler is not None else None,
                   "extra": extra}
        records["trainer.pt"] = write_stamped(staging / "trainer.pt", trainer, step=step, world_size=world_size,
                                              rank=None, holds="trainer").record()
    every_rank: list[Any] = [records]
    if world_size > 1:
        every_rank = [None] * world_size
        dist.all_gather_object(every_rank, records)
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "strategy": "fsdp" if isinstance(model, FSDP) else "replicated",
                    "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                    "files": {name: record for records in every_rank for name, record in records.items()}}
        write_atomically(staging / MANIFEST, [json.dumps(manifest, indent=1).encode()])
        replaced = folder.with_name(folder.name + ".replaced")
        if folder.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(folder, replaced)
        os.replace(staging, folder)
        write_atomically(Path(root) / LATEST, [folder.name.encode() + b"\n"])
        shutil.rmtree(replaced, ignore_errors=True)
        if keep is not None:  # the newest `keep` steps up to this one; steps above it (a run resumed earlier) stay
            below = [s for s in complete_steps(root) if s < step]
            for old in below[: max(len(below) - (keep - 1), 0)]:
                shutil.rmtree(step_folder(root, old), ignore_errors=True)
    _barrier()  # no rank goes on (or exits) before the checkpoint is complete
    return folder


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps under ``root`` whose save completed (their manifest exists), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step ``root/latest`` names (the newest complete save), or ``None`` when there is none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    match = _STEP_DIR.match(pointer.read_text().strip())
    if not match:
        raise CheckpointError(f"{pointer}: names no step folder")
    return int(match.group(1))


class Checkpoint:
    """One saved step, its manifest read and every file checked against it as it is opened."""

    def __init__(self, root: str | os.PathLike, step: int | None = None):
        if step is None:
            step = latest_step(root)
            if step is None:
                raise CheckpointError(f"{root}: no complete checkpoint (no {LATEST} file)")
        self.folder = step_folder(root, step)
        try:
            self.manifest = json.loads((self.folder / MANIFEST).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.folder}: no {MANIFEST}: that save never completed") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("step") != step:
            raise CheckpointError(f"{self.folder / MANIFEST}: not the manifest of step {step} in this format")
        self.step = step
        self.world_size: int = self.manifest["world_size"]

    def names(self, holds: str) -> list[str]:
        return sorted(n for n, r in self.manifest["files"].items() if r["holds"] == holds)

    def read(self, name: str, rank: int | None = None) -> Any:
        """The state in file ``name``, after checking its stamp against the manifest: same step, world
        size, rank (``rank`` given: the file must belong to it) and checksum."""
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointError(f"{self.folder}: the manifest lists no {name}")
        stamp, state = read_stamped(self.folder / name)
        if stamp.step != self.step:
            raise CheckpointError(f"{self.folder / name}: saved at step {stamp.step}, but this checkpoint is step "
                                  f"{self.step} (a file from another save)")
        if stamp.world_size != self.world_size:
            raise CheckpointError(f"{self.folder / name}: saved by a run of {stamp.world_size} ranks, but this "
                                  f"checkpoint's run had {self.world_size}")
        if stamp.rank != expected["rank"] or (rank is not None and stamp.rank != rank):
            raise CheckpointError(f"{self.folder / name}: written by rank {stamp.rank}, but the manifest lists it "
                                  f"for rank {expected['rank'] if rank is None else rank} (files swapped?)")
        if stamp.sha256 != expected["sha256"]:
            raise CheckpointError(f"{self.folder / name}: its checksum differs from the manifest's (a file from "
                                  "another save of this step)")
        return state

    def read_per_rank(self, holds: str) -> list[Any]:
        """Every rank's file of one kind, in rank order."""
        return [self.read(f"{holds}-rank{r}.pt", rank=r) for r in range(self.world_size)]


def _full_from_fsdp_shards(shards: list[dict[str, Any]], model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain state dict from every rank's ``FSDP.sharded_state_dict()``: 1-D shards concatenated and cut
    to the full shape; replicated tensors taken from rank 0; a tied weight under each of ``model``'s names
    for it (the shards list it once)."""
    shapes = shards[0]["fsdp_sharded"]["full_shapes"]
    full = {}
    for name, value in shards[0]["tensors"].items():
        if name in shapes:
            flat = torch.cat([s["tensors"][name] for s in shards])
            numel = int(torch.Size(shapes[name]).numel())
            full[name] = flat[:numel].reshape(shapes[name]).clone()
        else:
            full[name] = value
    module = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    first_name: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(p), name)
        if name not in full and first in full:
            full[name] = full[first]
    return full


def _load_model(ckpt: Checkpoint, model: nn.Module, rank: int, world_size: int) -> None:
    if ckpt.manifest["strategy"] == "replicated":
        state = ckpt.read("model.pt")
        if isinstance(model, FSDP):
            model.load_full_state_dict(state)
        else:
            _unwrap(model).load_state_dict(state)
        return
    if isinstance(model, FSDP) and world_size == ckpt.world_size:
        model.load_sharded_state_dict(ckpt.read(f"model-rank{rank}.pt", rank=rank))
        return
    full = _full_from_fsdp_shards(ckpt.read_per_rank("model"), model)
    if isinstance(model, FSDP):
        model.load_full_state_dict(full)
    else:
        _unwrap(model).load_state_dict(full)


def _reshard_fsdp_optimizer(saved: list[dict[str, Any]], optimizer: torch.optim.Optimizer, model: FSDP) -> dict:
    """The optimizer state dict this rank of ``model`` would hold, from every rank's saved one: per-element
    state tensors of sharded parameters are concatenated and cut again; everything else must agree."""
    shard_of = {id(sh.param): sh for sh in model._shards}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, p in enumerate(params):
        entries = [s["state"].get(index) for s in saved]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries):
            raise CheckpointError(f"optimizer state of parameter {index} exists on some saved ranks only")
        shard = shard_of.get(id(p))
        merged = {}
        for key, value in entries[0].items():
            values = [e[key] for e in entries]
            if shard is not None and isinstance(value, torch.Tensor) and value.dim() == 1 \
                    and all(v.shape == value.shape for v in values) and value.numel() * len(values) >= shard.numel:
                flat = torch.cat(values)[: shard.numel]
                start = model.rank * shard.shard_numel
                mine = torch.zeros(shard.shard_numel, dtype=value.dtype)
                valid = max(0, min(shard.numel - start, shard.shard_numel))
                mine[:valid] = flat[start : start + valid]
                merged[key] = mine
            elif all(torch.equal(torch.as_tensor(v), torch.as_tensor(value)) for v in values):
                merged[key] = value
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {index} differs between the saved ranks and is not one "
                    f"value per element: it cannot be resharded from {len(saved)} ranks to {model.world_size}; load "
                    f"it with {len(saved)} ranks")
        state[index] = merged
    return {"state": state, "param_groups": saved[0]["param_groups"]}


def _load_optimizer(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, model: nn.Module, rank: int,
                    world_size: int) -> None:
    saved_kind = ckpt.manifest["optimizer"]
    if saved_kind is None:
        raise CheckpointError(f"{ckpt.folder}: this checkpoint has no optimizer state")
    per_rank = ckpt.names("optimizer") != ["optimizer.pt"]
    if isinstance(optimizer, ShardedOptimizer):
        if saved_kind != "ShardedOptimizer":
            optimizer.load_state_dict(ckpt.read("optimizer.pt"))  # a consolidated plain layout loads too
        else:
            optimizer.load_state_dict(ckpt.read_per_rank("optimizer"))
        return
    if saved_kind == "ShardedOptimizer":
        if isinstance(model, FSDP):
            raise CheckpointError(f"{ckpt.folder}: the optimizer state was saved by ShardedOptimizer over a replicated "
                                  "model; it does not load into an optimizer over FSDP shards")
        optimizer.load_state_dict(ShardedOptimizer.merge_shard_state_dicts(ckpt.read_per_rank("optimizer")))
        return
    if not per_rank:
        if isinstance(model, FSDP):
            raise CheckpointError(f"{ckpt.folder}: the optimizer state was saved for a replicated model; it does not "
                                  "load into an optimizer over FSDP shards (load the model into FSDP and start the "
                                  "optimizer afresh, or resume with the strategy it was saved with)")
        optimizer.load_state_dict(ckpt.read("optimizer.pt"))
        return
    if not isinstance(model, FSDP):
        raise CheckpointError(f"{ckpt.folder}: the optimizer was saved over FSDP shards; load it into an optimizer "
                              "over an FSDP model")
    if world_size == ckpt.world_size:
        optimizer.load_state_dict(ckpt.read(f"optimizer-rank{rank}.pt", rank=rank))
    else:
        optimizer.load_state_dict(_reshard_fsdp_optimizer(ckpt.read_per_rank("optimizer"), optimizer, model))


def load_checkpoint(
    root: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Restore step ``step`` (default: the latest complete one) into ``model`` (and ``optimizer``,
    ``scheduler``) on every rank; returns ``(step, extra)``. Every file is checked before its state is used;
    a problem raises :class:`CheckpointError` (a ``ValueError``) in one line. Not a collective (each rank
    reads files), so ranks may load at their own pace."""
    rank, world_size = _world()
    ckpt = Checkpoint(root, step)
    _load_model(ckpt, model, rank, world_size)
    if optimizer is not None:
        _load_optimizer(ckpt, optimizer, model, rank, world_size)
    trainer = ckpt.read("trainer.pt")
    if scheduler is not None:
        if trainer["scheduler"] is None:
            raise CheckpointError(f"{ckpt.folder}: this checkpoint has no scheduler state")
        scheduler.load_state_dict(trainer["scheduler"])
    return ckpt.step, trainer["extra"]


__all__ = ["Checkpoint", "CheckpointError", "complete_steps", "latest_step", "load_checkpoint", "read_stamped",
           "save_checkpoint", "write_stamped"]
