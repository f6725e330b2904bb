"""ShardedOptimizer against unsharded AdamW (torch's and ours), bit for bit.

Every rank trains on the same batches (as the course test does), so gradients agree without a DDP
wrapper and any difference can only come from the optimizer. All 2-rank checks share one spawned gloo
group (spawning costs seconds); checkpoint round trips across world sizes 1 → 2 and 2 → 1 hand their
state dicts between this process (world size 1, no process group) and the spawned ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_basics.optimizer import AdamW as BasicsAdamW
from cs336_systems.distributed.launch import spawn
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer, greedy_balanced_assignment
from cs336_systems.checks.toy_models import make_toy_batch, make_toy_model
from tests.adapters import get_sharded_optimizer

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"torch_adamw": torch.optim.AdamW, "basics_adamw": BasicsAdamW}
HYPER = dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
LATE_STEP = 4  # add_param_group happens before this step
CHECKPOINT_STEP = 7  # state is saved after this step
TOTAL_STEPS = 12


def _groups(model: nn.Module, include_late: bool) -> list[dict]:
    """Two groups with different learning rates; the last parameter joins later as a third group."""
    params = list(model.parameters())
    rest = params[:-1]
    groups = [{"params": rest[0::2]}, {"params": rest[1::2], "lr": 0.01}]
    if include_late:
        groups.append(_late_group(model))
    return groups


def _late_group(model: nn.Module) -> dict:
    return {"params": [list(model.parameters())[-1]], "lr": 0.02, "weight_decay": 0.0}


def _make_optimizer(model: nn.Module, cls: type, *, sharded: bool, include_late: bool) -> torch.optim.Optimizer:
    groups = _groups(model, include_late)
    if sharded:
        return get_sharded_optimizer(groups, cls, **HYPER)
    return cls(groups, **HYPER)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        if step == LATE_STEP:
            opt.add_param_group(_late_group(model))
        model.zero_grad(set_to_none=True)
        x, y = make_toy_batch(20, seed=step)
        F.mse_loss(model(x), y).backward()
        opt.step()


def _assert_params_equal(model: nn.Module, expected: dict[str, torch.Tensor], what: str) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected[name]), f"{what}: {name} differs (max {(p - expected[name]).abs().max()})"


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_state_dicts_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual["param_groups"] == expected["param_groups"], f"{what}: hyperparameters differ"
    assert actual["state"].keys() == expected["state"].keys(), f"{what}: states for different parameters"
    for idx, state in expected["state"].items():
        for key, value in state.items():
            got = actual["state"][idx][key]
            same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
            assert same, f"{what}: state[{idx}][{key!r}] differs"


def _two_rank_checks(single_rank_checkpoints: dict) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    handoff = {}
    for kind in ("toy", "tied"):
        for name, cls in OPTIMIZERS.items():
            what = f"{kind}/{name}"
            ref_model = make_toy_model(kind, seed=0)
            model = copy.deepcopy(ref_model)
            ref_opt = _make_optimizer(ref_model, cls, sharded=False, include_late=False)
            opt = _make_optimizer(model, cls, sharded=True, include_late=False)
            assert isinstance(opt, ShardedOptimizer) and isinstance(opt, torch.optim.Optimizer)
            for step in range(TOTAL_STEPS):
                _train(ref_model, ref_opt, range(step, step + 1))
                _train(model, opt, range(step, step + 1))
                _assert_params_equal(model, _params(ref_model), f"{what} step {step}")
                if step == CHECKPOINT_STEP:
                    # Each rank holds state for exactly the parameters it owns, and together they cover all.
                    owned = set(map(id, opt.owned_parameters()))
                    assert set(map(id, opt.state)) == owned and owned
                    covered = [None] * world_size
                    dist.all_gather_object(covered, len(owned))
                    assert sum(covered) == len(list(model.parameters()))
                    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
                        opt.state_dict()
                    consolidated = opt.consolidate_state_dict(to=1)
                    if rank == 1:
                        _assert_state_dicts_equal(consolidated, ref_opt.state_dict(), f"{what} consolidated")
                    box = [consolidated]
                    dist.broadcast_object_list(box, src=1)
                    consolidated = box[0]
                    own_shard = copy.deepcopy(opt.shard_state_dict())
                    all_shards: list = [None] * world_size
                    dist.all_gather_object(all_shards, own_shard)
                    snapshot = copy.deepcopy(model)
            final = _params(ref_model)
            for source_name, source in [("own shard", own_shard), ("all shards", all_shards), ("consolidated", consolidated)]:
                resumed = copy.deepcopy(snapshot)
                resumed_opt = _make_optimizer(resumed, cls, sharded=True, include_late=True)
                resumed_opt.load_state_dict(copy.deepcopy(source))
                _train(resumed, resumed_opt, range(CHECKPOINT_STEP + 1, TOTAL_STEPS))
                _assert_params_equal(resumed, final, f"{what} resumed from {source_name}")
            if kind == "toy":
                handoff[name] = {"checkpoint": consolidated, "model": snapshot.state_dict(), "final": final}
                if name in single_rank_checkpoints:  # world size 1 → 2
                    saved = single_rank_checkpoints[name]
                    resumed = make_toy_model(kind, seed=0)
                    resumed.load_state_dict(saved["model"])
                    resumed_opt = _make_optimizer(resumed, cls, sharded=True, include_late=True)
                    resumed_opt.load_state_dict(saved["checkpoint"])
                    _train(resumed, resumed_opt, range(CHECKPOINT_STEP + 1, TOTAL_STEPS))
                    _assert_params_equal(resumed, final, f"{what} resumed from a world-size-1 checkpoint")
    return handoff if rank == 0 else {}


@pytest.fixture
def one_thread():
    """Spawned gloo ranks compute with one intra-op thread each; the parts of a comparison that run in
    this process must too, or a differently blocked reduction changes the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sharded_optimizer_matches_adamw_across_ranks_and_checkpoints(one_thread):
    # World size 1 (no process group): train to the checkpoint and save, for the 1 → 2 resume.
    single = {}
    for name, cls in OPTIMIZERS.items():
        model = make_toy_model("toy", seed=0)
        opt = _make_optimizer(model, cls, sharded=True, include_late=False)
        _train(model, opt, range(CHECKPOINT_STEP + 1))
        single[name] = {"checkpoint": copy.deepcopy(opt.state_dict()), "model": copy.deepcopy(model.state_dict())}

    handoff = spawn(_two_rank_checks, 2, single, backend="gloo")[0]

    # World size 2 → 1: resume the 2-rank checkpoint in one process, sharded and with the plain class.
    assert set(handoff) == set(OPTIMIZERS)
    for name, cls in OPTIMIZERS.items():
        for sharded in (True, False):
            model = make_toy_model("toy", seed=0)
            model.load_state_dict(handoff[name]["model"])
            opt = _make_optimizer(model, cls, sharded=sharded, include_late=True)
            opt.load_state_dict(copy.deepcopy(handoff[name]["checkpoint"]))
            _train(model, opt, range(CHECKPOINT_STEP + 1, TOTAL_STEPS))
            _assert_params_equal(model, handoff[name]["final"], f"{name} 2→1 resume (sharded={sharded})")


def test_greedy_assignment_balances_bytes():
    sizes = [100, 10, 60, 50, 40, 30, 5]
    owners = greedy_balanced_assignment(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    # Largest first to the lighter rank: 100→0, 60→1, 50→1, 40→0, 30→1 (tie 140/140), 10→0 (tie: lower rank), 5→1.
    assert owners == [0, 0, 1, 1, 0, 1, 1]
    assert loads == [150, 145]
    running = [0, 0, 0]
    greedy_balanced_assignment([8, 8], 3, running)
    assert greedy_balanced_assignment([4], 3, running) == [2] and running == [8, 8, 4]


def test_single_process_state_dict_loads_into_plain_adamw():
    model = make_toy_model("toy", seed=0)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # the wrapped class's defaults are visible
    for step in range(3):
        _train(model, opt, range(step, step + 1))
        _train(ref, ref_opt, range(step, step + 1))
    _assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict(), "world size 1")
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.1)
    plain.load_state_dict(opt.state_dict())


def test_sharded_optimizer_rejects_bad_arguments():
    params = list(make_toy_model("toy", seed=0).parameters())
    with pytest.raises(ValueError, match="Optimizer subclass"):
        ShardedOptimizer(params, object, lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast_bucket_mb"):
        ShardedOptimizer(params, torch.optim.SGD, lr=0.1, broadcast_bucket_mb=0)
    opt = ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="not a parameter"):
        opt.owner(torch.zeros(1))


def test_loading_a_checkpoint_of_another_model_fails_before_touching_state():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)  # two parameters each, other shapes
    opt = ShardedOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.1)
    other = torch.optim.AdamW(theirs.parameters(), lr=0.5)
    for o, m, n in ((opt, ours, 4), (other, theirs, 8)):
        m(torch.randn(2, n)).sum().backward()
        o.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"group 0, parameter 0: saved 'exp_avg' has shape \(4, 8\) but the "
                                         r"parameter has shape \(8, 4\)"):
        opt.load_state_dict(other.state_dict())
    _assert_state_dicts_equal(opt.state_dict(), before, "after a refused load")  # lr and state untouched
    with pytest.raises(ValueError, match=r"looks like a model's state_dict \(keys such as 'weight', 'bias'\)"):
        opt.load_state_dict(ours.state_dict())
    bad = copy.deepcopy(before)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].double()
    with pytest.raises(ValueError, match="saved 'exp_avg' is torch.float64 but the parameter is torch.float32"):
        opt.load_state_dict(bad)
    opt.load_state_dict(before)  # the genuine one still loads


def _shards_of_two_steps() -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    shards = []
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        shards.append(opt.shard_state_dict())
    gathered = [None, None]
    dist.all_gather_object(gathered, shards[dist.get_rank()])  # rank 0's shard of step 1, rank 1's of step 2
    try:
        opt.load_state_dict(gathered)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_shards_saved_after_different_steps_are_refused() -> None:
    """AdamW's own ``step`` entries cannot tell (a parameter without a gradient skips a step); the optimizer's
    count of its steps can."""
    out = spawn(_shards_of_two_steps, 2, backend="gloo", timeout_s=30)
    assert all("saved after different numbers of steps (rank 0: 1, rank 1: 2)" in o for o in out), out
