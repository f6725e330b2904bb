"""FSDP against non-parallel training (2 gloo ranks, deterministic algorithms, warnings as errors).

References, built independently of the FSDP machinery:

- *micro-batched*: one process runs each rank's micro-batch through the unsharded model, accumulates
  the gradients and divides by the world size — the same arithmetic FSDP does, so fp32 must agree bit
  for bit;
- *full batch*: ordinary training on the whole batch (the course's check), equal up to reduction order;
- mixed precision: the reference reads its weights through a ``parametrize`` cast to the compute dtype,
  so it computes in fp16 while its master weights, gradients and update stay fp32.

All checks share one spawned process group, since spawning costs seconds.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import spawn
from tests.adapters import fsdp_gather_full_params, fsdp_on_after_backward, get_fsdp


class ToyFSDPModel(nn.Module):
    """The course's FSDP test model: embedding → norm → linear → relu → norm → linear → head."""

    def __init__(self, vocab_size: int = 100, d_model: int = 64, d_ff: int = 128):
        super().__init__()
        self.embedding = Embedding(vocab_size, d_model)
        self.norm1 = RMSNorm(d_model)
        self.linear1 = Linear(d_model, d_ff)
        self.norm2 = RMSNorm(d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.embedding(x))
        x = self.norm2(torch.relu(self.linear1(x)))
        return self.lm_head(self.linear2(x))


class OddShapesModel(nn.Module):
    """Odd element counts (shards need padding), torch.nn layers with a bias, a LayerNorm, and a layer
    called twice per forward."""

    def __init__(self, vocab_size: int = 33):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, 7)
        self.proj = Linear(7, 5)
        self.ln = nn.LayerNorm(5)
        self.mix = nn.Linear(5, 5, bias=True)
        self.head = nn.Linear(5, vocab_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.proj(self.embedding(x)))
        h = self.mix(torch.tanh(self.mix(h)))  # same layer twice
        return self.head(h)


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(self.dtype)


def _mixed_precision_reference(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    if dtype is not None:
        for mod in list(model.modules()):
            if isinstance(mod, (Linear, Embedding, nn.Linear, nn.Embedding)):
                for name, _ in list(mod.named_parameters(recurse=False)):
                    parametrize.register_parametrization(mod, name, _Cast(dtype), unsafe=True)
    return model


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("parametrizations.", "").replace(".original", ""): p for n, p in model.named_parameters()}


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x)[:, -1, :].float(), y)


def _train_and_compare(model_cls: type, compute_dtype, optimizer, steps: int = 3, whole: bool = False) -> dict:
    """``whole``: the model is one gather unit, so all its weights come in one collective per direction."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    base = model_cls()
    fsdp = (FSDP(copy.deepcopy(base), compute_dtype=compute_dtype, gather_units=(model_cls,)) if whole
            else get_fsdp(copy.deepcopy(base), compute_dtype=compute_dtype))
    micro = _mixed_precision_reference(copy.deepcopy(base), compute_dtype)
    full = _mixed_precision_reference(copy.deepcopy(base), compute_dtype)
    opts = [optimizer(m.parameters()) for m in (fsdp, micro, full)]
    vocab = base.embedding.weight.shape[0]
    torch.manual_seed(123)
    x = torch.randint(0, vocab, (8, 6))
    y = torch.randint(0, vocab, (8,))
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        before = dict(fsdp.stats)
        _loss(fsdp, x[local], y[local]).backward()
        fsdp_on_after_backward(fsdp, opts[0])
        used = {k: fsdp.stats[k] - before[k] for k in before}

        # Gradients: shard-shaped fp32 for sharded parameters, identical across ranks for replicated ones.
        replicated = {id(p) for p in fsdp.replicated_parameters}
        for name, p in fsdp.module.named_parameters():
            assert p.grad is not None, name
            assert p.grad.shape == p.shape and p.grad.dtype == torch.float32 == p.dtype, name
            if id(p) in replicated:
                gathered = [torch.empty_like(p.grad) for _ in range(world)]
                dist.all_gather(gathered, p.grad)
                assert all(torch.equal(gathered[0], g) for g in gathered), name
        opts[0].step()

        for r in range(world):
            part = slice(r * 8 // world, (r + 1) * 8 // world)
            _loss(micro, x[part], y[part]).backward()
        for p in micro.parameters():
            p.grad.div_(world)
        opts[1].step()
        _loss(full, x, y).backward()
        opts[2].step()

        got = fsdp_gather_full_params(fsdp)
        ref_micro, ref_full = _named(micro), _named(full)
        assert got.keys() == ref_full.keys()
        for name, value in got.items():
            assert value.dtype == torch.float32 and value.shape == ref_full[name].shape, name
            where = f"step {step} {name} ({compute_dtype})"
            assert torch.equal(value, ref_micro[name].detach()), f"{where}: not bitwise equal to micro-batched"
            # Full batch differs by reduction order only. In 16-bit compute that is a relative gradient
            # change of a few eps(dtype) (more for a layer called twice); AdamW turns it into a few lr * eps
            # per step (lr = 0.01 here), still far below one step's update (lr).
            tol = 1e-6 if compute_dtype is None else max(1e-4, 4 * 0.01 * (step + 1) * torch.finfo(compute_dtype).eps)
            assert torch.allclose(value, ref_full[name].detach(), atol=tol, rtol=1e-4), f"{where}: vs full batch"
        # Every linear call re-gathers its weight for backward (an embedding's backward needs no weight);
        # from the second forward on, the recorded layer order drives prefetching.
        embedding_calls = sum(isinstance(layer.module, (Embedding, nn.Embedding)) for layer in fsdp.layers)
        if whole:  # one unit: gathered once for the forward (a layer called twice reuses it), once for backward
            assert used == {"forward_gathers": 1, "backward_gathers": 1, "prefetch_hits": 0}, used
            continue
        assert used["backward_gathers"] == used["forward_gathers"] - embedding_calls, used
        if step > 0:
            assert used["prefetch_hits"] > 0, used
    return dict(fsdp.stats)


def _wrapper_contract() -> dict:
    model = FSDP(ToyFSDPModel())
    sharded = model.sharded_parameters()
    assert all(p.dim() == 1 for p in sharded) and len(sharded) == 4  # embedding + three linears
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        model(torch.zeros(2, 3, dtype=torch.long))
    model.finish_gradient_synchronization()
    with pytest.raises(ValueError, match="compute_dtype"):
        FSDP(ToyFSDPModel(), compute_dtype=torch.int8)
    for bad in ([ToyFSDPModel], (int,)):
        with pytest.raises(ValueError, match=r"^gather_units must be a tuple of nn.Module subclasses"):
            FSDP(ToyFSDPModel(), gather_units=bad)
    with pytest.raises(ValueError, match=r"^gather_units: no module of type LayerNorm in the model$"):
        FSDP(ToyFSDPModel(), gather_units=(nn.LayerNorm,))
    return {}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Linear(8, 8), Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(h)))


class TiedAcrossBlocks(nn.Module):
    """Two gather units that share a weight (the second block's ``b`` is the first's ``a``), a half-precision
    master weight beside fp32 ones in the first unit, and the blocks run through reentrant checkpointing, whose
    recomputation inside backward is a real use that gathers each block again."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.blocks[1].b.weight = self.blocks[0].a.weight
        self.reentrant = reentrant

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True) if self.reentrant else block(h)
        return h


def _units_with_tied_weights_and_reentrant_checkpointing() -> dict:
    """Per-block gathers train bit for bit as per-layer ones with a weight tied across units, with and without
    reentrant checkpointing; after the backward no unit's forward weights are held, nor any backward copy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h = torch.randn(4, 3, 8, requires_grad=True)
    local = slice(rank * 4 // world, (rank + 1) * 4 // world)
    trained = {}
    for reentrant in (False, True):
        for units in ((), (_Block,)):
            torch.manual_seed(1)
            fsdp = FSDP(TiedAcrossBlocks(reentrant), gather_units=units)
            opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
            for _ in range(2):
                fsdp(h[local]).square().mean().backward()
                assert fsdp._live is None and not any(layer.backward_copy for layer in fsdp.layers)
                fsdp.finish_gradient_synchronization()
                opt.step()
                opt.zero_grad()
            trained[(reentrant, units)] = fsdp.gather_full_params()
    for reentrant in (False, True):  # (reentrant checkpointing reduces the tied weight's two uses apart: not
        per_layer, per_block = trained[(reentrant, ())], trained[(reentrant, (_Block,))]  # bitwise the plain sum)
        assert all(torch.equal(per_layer[n], t) for n, t in per_block.items()), reentrant
    # a unit holding an fp16 master weight beside fp32 ones gathers each dtype in its own collective
    torch.manual_seed(1)
    mixed = TiedAcrossBlocks()
    mixed.blocks[0].b.half()
    expected = {n: p.detach().clone() for n, p in mixed.named_parameters()}
    fsdp = FSDP(mixed, gather_units=(_Block,))
    pending = fsdp.units[0].start_gather()
    assert len(pending.parts) == 2  # fp32 and fp16: two collectives
    full = pending.wait()
    for layer in fsdp.units[0].layers:
        for name, t in full[layer.index].items():
            assert torch.equal(t, expected[f"{layer.name}.{name}"]) and t.dtype == expected[f"{layer.name}.{name}"].dtype
    return {}


def _one_collective_per_block() -> dict:
    """With ``gather_units=(TransformerBlock,)`` a block's seven weights arrive in one all-gather, forward and
    backward, where the default issues one per weight; the weights of the block that ran last are let go when
    the forward returns; both train bit for bit alike."""
    from cs336_basics.model import BasicsTransformerLM, TransformerBlock

    torch.manual_seed(7)
    base = BasicsTransformerLM(vocab_size=32, context_length=8, d_model=16, num_layers=3, num_heads=2, d_ff=32,
                               rope_theta=10000.0)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    gather, calls, trained = dist.all_gather_into_tensor, [], {}

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_into_tensor = counted
    try:
        for units in ((), (TransformerBlock,)):
            fsdp = FSDP(copy.deepcopy(base), gather_units=units)
            opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
            for _ in range(2):
                calls.clear()
                loss = fsdp(x).float().square().mean()
                forward, live = len(calls), fsdp._live
                loss.backward()
                fsdp.finish_gradient_synchronization()
                opt.step()
                opt.zero_grad()
            trained[units] = (forward, len(calls) - forward, len(fsdp.units), live, fsdp.gather_full_params())
    finally:
        dist.all_gather_into_tensor = gather
    # embedding, 3 blocks of 7 weights, head; backward regathers all but the embedding
    assert trained[()][:4] == (23, 22, 23, None), trained[()][:4]
    assert trained[(TransformerBlock,)][:4] == (5, 4, 5, None), trained[(TransformerBlock,)][:4]
    per_layer, per_block = trained[()][4], trained[(TransformerBlock,)][4]
    assert all(torch.equal(per_layer[n], t) for n, t in per_block.items())
    return {}


def _checkpointed_blocks_with_fused_head(pointwise_compiled: bool = False, per_block: bool = False) -> dict:
    """The 2026 leaderboard's combination on a tiny LM: every block checkpointed (recomputed, so gathered
    again, in backward) and the fused LM-head loss, whose head stays replicated (``pointwise_compiled``: with
    the blocks' norms, rotation and gate compiled, as §1.5 runs it; aot_eager, which traces and differentiates
    as Inductor does without generating kernels; ``per_block``: each block's weights in one gather); against
    micro-batched training of the plain model."""
    from cs336_basics.model import BasicsTransformerLM, TransformerBlock
    from cs336_systems.checkpointing import checkpoint_layers
    from cs336_systems.lm_head_loss import FusedLMLoss
    from cs336_systems.pointwise_compile import compile_pointwise

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    base = BasicsTransformerLM(vocab_size=32, context_length=8, d_model=16, num_layers=3, num_heads=2, d_ff=32,
                               rope_theta=10000.0)
    lm = checkpoint_layers(copy.deepcopy(base), [1])
    if pointwise_compiled:
        compile_pointwise(lm, backend="aot_eager")
    fsdp = FSDP(FusedLMLoss(lm, chunk_size=5), replicated_modules=("lm.lm_head",),
                gather_units=(TransformerBlock,) if per_block else ())
    micro = FusedLMLoss(copy.deepcopy(base), chunk_size=5)
    head = fsdp.module.lm.lm_head.weight
    assert any(p is head for p in fsdp.replicated_parameters) and head.dim() == 2
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fsdp, micro)]
    x, y = torch.randint(0, 32, (2, 4, 8), generator=torch.Generator().manual_seed(3))
    local = slice(rank * 4 // world, (rank + 1) * 4 // world)
    for step in range(2):
        fsdp(x[local], y[local]).backward()
        fsdp.finish_gradient_synchronization()
        opts[0].step()
        for r in range(world):
            part = slice(r * 4 // world, (r + 1) * 4 // world)
            micro(x[part], y[part]).backward()
        for p in micro.parameters():
            p.grad.div_(world)
        opts[1].step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        got, ref = fsdp.gather_full_params(), dict(micro.named_parameters())
        assert got.keys() == ref.keys()
        for name, value in got.items():
            assert torch.allclose(value, ref[name].detach(), atol=1e-6, rtol=0), f"step {step} {name}"
    with pytest.raises(ValueError, match=r"replicated_modules names no submodule: \['head'\]"):
        FSDP(FusedLMLoss(copy.deepcopy(base)), replicated_modules=("head",))
    return dict(fsdp.stats)


def _pointwise_compiled_blocks_with_fused_head() -> dict:
    """The same with the pointwise parts compiled. Dynamo reads ``.grad`` of every tensor it wraps, and our
    FSDP's parameters are views of the gathered buffer (not leaves), so tracing warns once per graph: expected,
    so not an error here as the other checks' warnings are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        return _checkpointed_blocks_with_fused_head(pointwise_compiled=True)


def _checkpointed_blocks_save_only_their_inputs() -> dict:
    """Activation checkpointing keeps its promise under FSDP: a checkpointed block's linear inputs are not
    held for backward (FSDP's own saved-tensor hooks pass them to the checkpoint's), and an outer hook of the
    user's (``save_on_cpu`` and the like) sees every tensor autograd saves inside a sharded layer."""
    import gc
    import weakref

    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.checkpointing import checkpoint_layers

    torch.manual_seed(7)
    base = BasicsTransformerLM(vocab_size=32, context_length=8, d_model=16, num_layers=3, num_heads=2, d_ff=32,
                               rope_theta=10000.0)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    held = {}
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        if checkpointed:
            checkpoint_layers(model, [1])
        fsdp = FSDP(model)
        inputs: list[weakref.ref] = []
        hook = model.layers[1].ffn.w2.register_forward_hook(lambda m, args, out: inputs.append(weakref.ref(args[0])))
        loss = fsdp(x).float().square().mean()
        gc.collect()
        held[checkpointed] = inputs[0]() is not None
        loss.backward()
        fsdp.finish_gradient_synchronization()
        hook.remove()
    assert held == {False: True, True: False}, held  # saved for backward only where the block is not recomputed
    packed: list[torch.Size] = []
    fsdp = FSDP(copy.deepcopy(base))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        loss = fsdp(x).float().square().mean()
    loss.backward()
    fsdp.finish_gradient_synchronization()
    assert torch.Size([2, 8, 32]) in packed  # the input of ffn.w2 (d_ff 32), saved inside a sharded layer
    return {}


def _recomputation_is_no_new_use() -> dict:
    """Checkpointing re-runs each block's forward inside backward only to regenerate saved tensors; under FSDP
    that is no new use of the weights. A checkpointed model is gathered as often as the plain one (the
    recomputation's gather is the backward copy its regathers find), and every gradient is reduce-scattered
    during backward, none left waiting for finish_gradient_synchronization."""
    from cs336_basics.model import BasicsTransformerLM, TransformerBlock
    from cs336_systems.checkpointing import checkpoint_layers

    torch.manual_seed(7)
    base = BasicsTransformerLM(vocab_size=32, context_length=8, d_model=16, num_layers=3, num_heads=2, d_ff=32,
                               rope_theta=10000.0)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    seen = {}
    for levels, units in (([], ()), ([1], ()), ([2, 1], ()), ([], (TransformerBlock,)), ([1], (TransformerBlock,))):
        fsdp = FSDP(checkpoint_layers(copy.deepcopy(base), levels), gather_units=units)
        for _ in range(2):  # the second step prefetches in the recorded order
            before = dict(fsdp.stats)
            fsdp(x).float().square().mean().backward()
            waiting = [s for s in fsdp._shards if s.grad_sum is not None or s.uses_awaiting_grad]
            fsdp.finish_gradient_synchronization()
        seen[str(levels) + ("/block" if units else "")] = (
            {k: fsdp.stats[k] - before[k] for k in ("forward_gathers", "backward_gathers")}, len(waiting))
    assert seen["[1]"] == seen["[2, 1]"] == seen["[]"], seen
    assert seen["[1]/block"] == seen["[]/block"] == ({"forward_gathers": 5, "backward_gathers": 4}, 0), seen
    assert seen["[]"][1] == 0
    # Reentrant checkpointing does backpropagate its recomputed graph: there the recomputation is the use.
    from torch.utils.checkpoint import checkpoint

    class Reentrant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Linear(8, 8), Linear(8, 8)
            self.reentrant: bool | None = None

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            run = lambda h: self.b(torch.relu(self.a(h)))  # noqa: E731
            return run(h) if self.reentrant is None else checkpoint(run, h, use_reentrant=self.reentrant)

    torch.manual_seed(0)
    small, h = Reentrant(), torch.randn(4, 8, requires_grad=True)
    grads = []
    for mode in (None, True, False):
        model = copy.deepcopy(small)
        model.reentrant = mode
        wrapped = FSDP(model)
        wrapped(h).square().sum().backward()
        wrapped.finish_gradient_synchronization()
        grads.append([p.grad for p in wrapped.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
    return {}


_sgd = lambda ps: torch.optim.SGD(ps, lr=0.01)  # noqa: E731
_adamw = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731

#: Each check runs in the same two spawned processes (spawning costs seconds); a failure is recorded, not
#: raised, so that every named test below reports on its own check.
CHECKS = {
    "toy_fp32_sgd": lambda: _train_and_compare(ToyFSDPModel, None, _sgd),
    "toy_fp16_sgd": lambda: _train_and_compare(ToyFSDPModel, torch.float16, _sgd),
    "odd_shapes_fp32_adamw": lambda: _train_and_compare(OddShapesModel, None, _adamw),
    "odd_shapes_bf16_adamw": lambda: _train_and_compare(OddShapesModel, torch.bfloat16, _adamw, steps=2),
    "toy_fp32_sgd_one_gather": lambda: _train_and_compare(ToyFSDPModel, None, _sgd, whole=True),
    "odd_shapes_bf16_adamw_one_gather": lambda: _train_and_compare(OddShapesModel, torch.bfloat16, _adamw, steps=2,
                                                                    whole=True),
    "one_collective_per_block": _one_collective_per_block,
    "units_with_tied_weights_and_reentrant_checkpointing": _units_with_tied_weights_and_reentrant_checkpointing,
    "wrapper_contract": _wrapper_contract,
    "checkpointed_blocks_fused_head": _checkpointed_blocks_with_fused_head,
    "checkpointed_blocks_fused_head_per_block": lambda: _checkpointed_blocks_with_fused_head(per_block=True),
    "checkpointed_blocks_fused_head_pointwise_compiled": _pointwise_compiled_blocks_with_fused_head,
    "checkpointed_blocks_save_only_their_inputs": _checkpointed_blocks_save_only_their_inputs,
    "recomputation_is_no_new_use": _recomputation_is_no_new_use,
}


def _run_checks() -> dict[str, tuple[str, dict]]:
    import traceback

    torch.use_deterministic_algorithms(True)
    warnings.simplefilter("error")
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = ("ok", check())
        except Exception:  # noqa: BLE001 - reported by the test of this check
            out[name] = (traceback.format_exc(), {})
            dist.barrier()  # the ranks stay in step for the next check
    return out


@pytest.fixture(scope="module")
def checks() -> list[dict[str, tuple[str, dict]]]:
    return spawn(_run_checks, 2, backend="gloo")


@pytest.mark.parametrize("name", list(CHECKS))
def test_fsdp_matches_non_parallel_training(checks, name: str) -> None:
    for rank, results in enumerate(checks):
        status, _ = results[name]
        assert status == "ok", f"rank {rank}:\n{status}"
    assert checks[0][name][1] == checks[1][name][1]  # both ranks issued the same gathers


def test_fsdp_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        FSDP(ToyFSDPModel())


def _checkpoint_checks(tmpdir: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    fsdp = FSDP(OddShapesModel())
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(torch.randint(0, 33, (2, 3))).sum().backward()
    fsdp.finish_gradient_synchronization()
    opt.step()

    with pytest.raises(RuntimeError, match=r"state_dict\(\) is ambiguous.*full_state_dict\(\)"):
        fsdp.state_dict()
    full = fsdp.full_state_dict()
    plain = OddShapesModel()
    plain.load_state_dict(full)  # loads into the plain model: full shapes, plain names
    assert all(torch.equal(plain.state_dict()[n], t) for n, t in full.items())

    sharded = fsdp.sharded_state_dict()
    torch.save(sharded, f"{tmpdir}/shard{rank}.pt")
    torch.manual_seed(1)
    other = FSDP(OddShapesModel())
    other.load_sharded_state_dict(torch.load(f"{tmpdir}/shard{rank}.pt", weights_only=True))
    assert all(torch.equal(other.full_state_dict()[n], t) for n, t in full.items())
    with pytest.raises(ValueError, match=f"saved by rank {1 - rank} of 2; this is rank {rank} of 2"):
        other.load_sharded_state_dict(torch.load(f"{tmpdir}/shard{1 - rank}.pt", weights_only=True))

    torch.manual_seed(2)
    third = FSDP(OddShapesModel())
    third.load_full_state_dict(full)
    assert all(torch.equal(third.full_state_dict()[n], t) for n, t in full.items())
    bad = {**full, "proj.weight": full["proj.weight"].T.contiguous()}
    with pytest.raises(ValueError, match=r"'proj.weight' is \(7, 5\) torch.float32 in the dict but \(5, 7\)"):
        third.load_full_state_dict(bad)
    with pytest.raises(ValueError, match="not an FSDP sharded state dict"):
        third.load_sharded_state_dict(full)


def test_fsdp_checkpoints_are_explicit_and_validated(tmp_path):
    spawn(_checkpoint_checks, 2, str(tmp_path), backend="gloo", timeout_s=30)


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = Embedding(16, 8)

    def forward(self, x):
        h = self.emb(x)
        return h @ self.emb.weight.T  # the tied head uses the weight outside the embedding's forward


def _tied_head() -> None:
    FSDP(_TiedHead())(torch.zeros(2, 3, dtype=torch.long))


def test_a_sharded_weight_used_outside_its_module_is_named():
    with pytest.raises(Exception, match=r"sharded weight used outside its own module's forward"):
        spawn(_tied_head, 2, backend="gloo", timeout_s=30)
