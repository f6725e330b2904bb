"""Checkpoints that cannot be half-written, mixed or silently corrupt (cs336_systems.distributed.checkpoint).

Resumes continue the run they came from (bit for bit at the same world size, to float rounding at another),
and every way of damaging a checkpoint on disk is refused in one line before any state is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Embedding, Linear
from cs336_basics.serialization import write_atomically
from cs336_systems.distributed.checkpoint import (
    Checkpoint,
    CheckpointError,
    _reshard_fsdp_optimizer,
    complete_steps,
    latest_step,
    load_checkpoint,
    save_checkpoint,
)
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import spawn
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

BATCH = 12  # divides by 1, 2 and 3 ranks


class Tied(nn.Module):
    """An embedding whose weight is also the output head's (the tied case FSDP used to lose)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = Embedding(10, 6)
        self.mid = Linear(6, 6)
        self.head = Linear(6, 10)
        self.head.weight = self.emb.weight
        # A non-persistent buffer, as RoPE's tables: in no state_dict, so FSDP's and the plain model's dicts match.
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 6), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x) + self.shift)))


def _setup(kind: str):
    model = Tied()
    if kind == "fsdp":
        wrapped = FSDP(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        wrapped = DDPBucketed(model, 0.0001)
        opt = ShardedOptimizer(wrapped.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    return model, wrapped, opt, sched


def _train(wrapped, opt, sched, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 10, (BATCH, 5), generator=g), torch.randint(0, 10, (BATCH, 5), generator=g)
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        logits = wrapped(x[part])
        nn.functional.cross_entropy(logits.flatten(0, 1), y[part].flatten()).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _final(model, wrapped) -> dict[str, torch.Tensor]:
    if isinstance(wrapped, FSDP):
        return wrapped.full_state_dict()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _continuous(kind: str) -> dict[str, torch.Tensor]:
    model, wrapped, opt, sched = _setup(kind)
    _train(wrapped, opt, sched, range(4))
    return _final(model, wrapped)


def _save(kind: str, root: str) -> None:
    model, wrapped, opt, sched = _setup(kind)
    for step in range(2):
        _train(wrapped, opt, sched, [step])
        save_checkpoint(root, step + 1, model=wrapped, optimizer=opt, scheduler=sched, extra={"tokens": 60 * (step + 1)})


def _resume(kind: str, root: str) -> dict:
    torch.manual_seed(123)  # another initialisation: everything must come from the files
    model, wrapped, opt, sched = _setup(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    step, extra = load_checkpoint(root, model=wrapped, optimizer=opt, scheduler=sched)
    _train(wrapped, opt, sched, range(step, 4))
    return {"step": step, "extra": extra, "params": _final(model, wrapped)}


@pytest.fixture(scope="module", params=["ddp_zero", "fsdp"])
def saved(request, tmp_path_factory):
    kind = request.param
    root = str(tmp_path_factory.mktemp(kind))
    spawn(_save, 2, kind, root, backend="gloo", timeout_s=60)
    return kind, root, spawn(_continuous, 2, kind, backend="gloo", timeout_s=60)[0]


@pytest.mark.slow
def test_a_resume_at_the_same_world_size_continues_bit_for_bit(saved) -> None:
    kind, root, continuous = saved
    assert complete_steps(root) == [1, 2] and latest_step(root) == 2
    for rank in spawn(_resume, 2, kind, root, backend="gloo", timeout_s=60):
        assert rank["step"] == 2 and rank["extra"] == {"tokens": 120}
        for name, value in continuous.items():
            assert torch.equal(rank["params"][name], value), name


@pytest.mark.slow
def test_a_resume_at_another_world_size_reshards_model_and_optimizer(saved) -> None:
    """3 ranks load what 2 saved: ZeRO shards and FSDP model and AdamW moments are cut again."""
    kind, root, continuous = saved
    for rank in spawn(_resume, 3, kind, root, backend="gloo", timeout_s=60):
        for name, value in continuous.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _full_round_trip() -> bool:
    model = Tied()
    wrapped = FSDP(model)
    full = wrapped.full_state_dict()
    plain = Tied()
    plain.load_state_dict(full)  # strict: both names of the tied weight are there
    wrapped.load_full_state_dict(plain.state_dict())
    return set(full) == set(plain.state_dict()) and torch.equal(full["head.weight"], full["emb.weight"])


@pytest.mark.slow
def test_fsdp_full_state_dict_of_a_tied_model_loads_into_the_plain_model() -> None:
    assert spawn(_full_round_trip, 2, backend="gloo", timeout_s=60) == [True, True]


def _load_into(kind: str, root: str) -> str:
    model, wrapped, opt, sched = _setup(kind)
    try:
        load_checkpoint(root, model=wrapped, optimizer=opt, scheduler=sched)
    except CheckpointError as exc:
        assert "\n" not in str(exc)
        return str(exc)
    return "loaded"


def _copy(root, tmp_path, name: str):
    damaged = tmp_path / name
    shutil.copytree(root, damaged)
    return damaged


@pytest.mark.slow
def test_mixed_swapped_and_corrupted_files_are_refused_in_one_line(saved, tmp_path) -> None:
    kind, root, _ = saved
    per_rank = "optimizer-rank1.pt" if kind == "ddp_zero" else "model-rank1.pt"

    stale = _copy(root, tmp_path, "stale")  # rank 1's file from step 1 in step 2's folder
    shutil.copy(stale / "step_00000001" / per_rank, stale / "step_00000002" / per_rank)
    assert "saved at step 1, but this checkpoint is step 2" in spawn(_load_into, 2, kind, str(stale), backend="gloo",
                                                                     timeout_s=60)[1]
    swapped = _copy(root, tmp_path, "swapped")
    step2 = swapped / "step_00000002"
    os.replace(step2 / per_rank, step2 / "tmp")
    os.replace(step2 / per_rank.replace("rank1", "rank0"), step2 / per_rank)
    os.replace(step2 / "tmp", step2 / per_rank.replace("rank1", "rank0"))
    assert "written by rank 1, but the manifest lists it for rank 0" in \
        spawn(_load_into, 2, kind, str(swapped), backend="gloo", timeout_s=60)[0]
    corrupt = _copy(root, tmp_path, "corrupt")
    path = corrupt / "step_00000002" / per_rank
    data = bytearray(path.read_bytes())
    data[-200:-136] = os.urandom(64)
    path.write_bytes(bytes(data))
    assert "fail their SHA-256 checksum" in spawn(_load_into, 2, kind, str(corrupt), backend="gloo", timeout_s=60)[1]
    truncated = _copy(root, tmp_path, "truncated")
    path = truncated / "step_00000002" / "trainer.pt"
    path.write_bytes(path.read_bytes()[:-100])
    assert "a truncated file" in spawn(_load_into, 2, kind, str(truncated), backend="gloo", timeout_s=60)[0]


def _interrupted(root: str) -> int:
    model, wrapped, opt, sched = _setup("ddp_zero")
    _train(wrapped, opt, sched, [0])
    save_checkpoint(root, 1, model=wrapped, optimizer=opt, scheduler=sched)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before writing its shard of step 2
    save_checkpoint(root, 2, model=wrapped, optimizer=opt, scheduler=sched)
    return 0


@pytest.mark.slow
def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    root = tmp_path / "run"
    with pytest.raises(Exception):
        spawn(_interrupted, 2, str(root), backend="gloo", timeout_s=60, collective_timeout_s=10)
    assert latest_step(root) == 1 and complete_steps(root) == [1]
    assert spawn(_load_into, 2, "ddp_zero", str(root), backend="gloo", timeout_s=60) == ["loaded", "loaded"]
    with pytest.raises(CheckpointError, match="no manifest.json: that save never completed"):
        load_checkpoint(root, model=Tied(), step=2)


def _refuse_non_elementwise_state(root: str) -> str:
    model, wrapped, opt, sched = _setup("fsdp")
    per_rank = Checkpoint(root).read_per_rank("optimizer")
    for s in per_rank:  # make one state tensor two-dimensional: no longer one value per element
        s["state"][0]["exp_avg"] = s["state"][0]["exp_avg"].reshape(1, -1).repeat(2, 1) + dist.get_rank()
    try:
        _reshard_fsdp_optimizer(per_rank, opt, wrapped)
    except CheckpointError as exc:
        return str(exc)
    return "resharded"


@pytest.mark.slow
def test_optimizer_state_moves_to_other_layouts_or_is_refused(saved) -> None:
    """ZeRO shards load into one process's plain AdamW (merged); FSDP optimizer state that is not one value
    per element cannot be cut for another world size and is refused, naming the way out."""
    kind, root, _ = saved
    if kind == "ddp_zero":
        model = Tied()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        assert load_checkpoint(root, model=model, optimizer=opt)[0] == 2
        assert all(float(opt.state[p]["step"]) == 2 and opt.state[p]["exp_avg"].shape == p.shape
                   for p in model.parameters())
        return
    out = spawn(_refuse_non_elementwise_state, 3, root, backend="gloo", timeout_s=60)
    assert all("cannot be resharded from 2 ranks to 3; load it with 2 ranks" in o for o in out), out


def test_write_atomically_keeps_the_old_file_when_the_write_fails(tmp_path) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(b"old and good")

    def chunks():
        yield b"new but"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, chunks())
    assert path.read_bytes() == b"old and good" and [p.name for p in tmp_path.iterdir()] == ["state.pt"]


_KILLED_WRITER = """
import sys, torch
from cs336_basics.serialization import save_checkpoint
model = torch.nn.Linear(2048, 2048)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("ready", flush=True)
while True:
    save_checkpoint(model, opt, 2, sys.argv[1])
"""


@pytest.mark.slow
def test_a_sigkill_while_saving_over_a_good_checkpoint_leaves_a_whole_file(tmp_path) -> None:
    """``cs336_basics.serialization.save_checkpoint`` is killed while it rewrites a 16 MB checkpoint again
    and again: the file is whole (the old or a new one), never a part."""
    from cs336_basics.serialization import load_checkpoint as basics_load, save_checkpoint as basics_save

    path = tmp_path / "ckpt.pt"
    model = nn.Linear(2048, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    basics_save(model, opt, 1, path)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert basics_load(path, nn.Linear(2048, 2048), torch.optim.SGD(model.parameters(), lr=0.1)) in (1, 2)


def test_bad_save_arguments_are_one_line_errors(tmp_path) -> None:
    for bad, match in (({"step": -1}, "step must be an int >= 0"), ({"step": 1.5}, "step must be"),
                       ({"step": 1, "keep": 0}, "keep must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            save_checkpoint(tmp_path, model=nn.Linear(2, 2), **bad)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing", model=nn.Linear(2, 2))
    (tmp_path / "latest").write_text("elsewhere\n")
    with pytest.raises(CheckpointError, match="names no step folder"):
        load_checkpoint(tmp_path, model=nn.Linear(2, 2))


def test_a_single_process_checkpoint_round_trips(tmp_path) -> None:
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 7, model=model, optimizer=opt, keep=1)
    save_checkpoint(tmp_path, 8, model=model, optimizer=opt, keep=1)
    assert complete_steps(tmp_path) == [8]
    manifest = json.loads((tmp_path / "step_00000008" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "trainer.pt"}
    fresh, fresh_opt = Tied(), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt) == (8, None)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def _load_across_strategies(kind: str, root: str, with_optimizer: bool) -> str:
    """A checkpoint saved under one strategy loaded under the other: the model moves, optimizer state is refused."""
    torch.manual_seed(7)
    model = Tied()
    wrapped = FSDP(model) if kind == "fsdp" else DDPBucketed(model, 0.0001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2) if with_optimizer else None
    try:
        load_checkpoint(root, model=wrapped, optimizer=opt)
    except CheckpointError as exc:
        return str(exc)
    full = wrapped.full_state_dict() if kind == "fsdp" else model.state_dict()
    return "loaded " + repr(float(sum(v.double().sum() for v in full.values())))


@pytest.mark.slow
def test_a_model_moves_between_fsdp_and_replicated_strategies(saved) -> None:
    """Saved under FSDP, loaded into DDP and into one plain process (a tied weight and a non-persistent buffer
    included); saved under DDP, loaded into FSDP. Optimizer state between the layouts is refused in one line."""
    kind, root, _ = saved
    other = "ddp" if kind == "fsdp" else "fsdp"
    loaded = spawn(_load_across_strategies, 2, other, root, False, backend="gloo", timeout_s=60)
    assert loaded[0].startswith("loaded ") and loaded[0] == loaded[1]
    plain = Tied()
    assert load_checkpoint(root, model=plain)[0] == 2
    assert loaded[0] == "loaded " + repr(float(sum(v.double().sum() for v in plain.state_dict().values())))
    if other == "fsdp":
        refused = spawn(_load_across_strategies, 2, other, root, True, backend="gloo", timeout_s=60)
        assert all("does not load into an optimizer over FSDP shards" in r for r in refused), refused


def test_a_step_saved_again_replaces_the_old_one_only_when_complete_and_later_steps_stay(tmp_path) -> None:
    model = nn.Linear(2, 2)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=model, keep=2)
    assert complete_steps(tmp_path) == [2, 3] and latest_step(tmp_path) == 3
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(tmp_path, 2, model=model, keep=2)  # resumed from step 2: step 3 (the abandoned run) stays
    assert complete_steps(tmp_path) == [2, 3] and latest_step(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    fresh = nn.Linear(2, 2)
    load_checkpoint(tmp_path, model=fresh)
    assert torch.equal(fresh.weight, model.weight)


def test_a_file_of_another_format_says_so(tmp_path) -> None:
    path = tmp_path / "state.pt"
    from cs336_systems.distributed import checkpoint as ck

    ck.write_stamped(path, {"a": 1}, step=1, world_size=1, rank=0, holds="model")
    data = path.read_bytes().replace(ck.FORMAT.encode(), b"cs336-checkpoint/0")
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"written by another checkpoint format \(cs336-checkpoint/0\)"):
        ck.read_stamped(path)
