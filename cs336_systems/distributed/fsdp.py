"""Fully-sharded data parallelism (FSDP; ZeRO stage 3, Rajbhandari et al., 2020; Zhao et al., 2023).

Each rank keeps only a ``1/world_size`` slice of every ``Linear``/``Embedding`` weight — and therefore
only that slice of its gradient and optimizer state. A layer's full weight exists only while it is
needed: it is all-gathered just before the layer's forward, dropped right after, all-gathered again
just before the layer's backward, and dropped once its gradient is known; the gradient is
reduce-scattered so each rank receives the averaged gradient of its own slice. Other parameters (norm
gains) are small and stay replicated; their gradients are all-reduced as in DDP.

Mechanism, per sharded layer (a :class:`ShardedLayer`; the shards and their collectives are in
:mod:`~cs336_systems.distributed.fsdp_shards`):

- **Shards.** Each weight is flattened, zero-padded to a multiple of the world size and cut into equal
  1-D slices; ``param.data`` becomes this rank's slice *in place*, so parameter objects, names,
  ``requires_grad`` and any optimizer built on ``fsdp.parameters()`` keep working unchanged.
- **Forward.** The layer's ``forward`` is wrapped: it takes the gathered weights (prefetched or gathered
  now), exposes them as ``layer.weight`` for the duration of the call (an instance attribute shadows the
  registered parameter), and runs the original forward. The gathered tensor enters autograd through
  :class:`_Unshard`, a function of the shard whose backward receives the full-weight gradient.
- **Free after use, re-gather for backward.** Inside the layer's forward a ``saved_tensors_hooks`` pair
  replaces every tensor autograd would save that aliases a gathered weight (``x @ W.T`` saves ``W.T``)
  by a small token; the gathered weight is thus released when the forward returns. When backward
  unpacks a token, the layer is gathered again (or its prefetch is picked up), and the token becomes a
  view of the fresh copy; the copy is dropped when :class:`_Unshard`'s backward runs for it. Every other
  saved tensor goes to the hooks that enclose the forward, if any: activation checkpointing's (which drop it
  and recompute it) or a user's (``save_on_cpu``), since only the innermost pair of hooks runs.
- **Gradients.** :class:`_Unshard`'s backward casts the full gradient to fp32 and launches an
  asynchronous reduce-scatter into a shard-sized buffer; :meth:`FSDP.finish_gradient_synchronization`
  waits, averages and installs the result as ``param.grad`` (shard shape, fp32).
- **Mixed precision.** With ``compute_dtype`` (fp16/bf16) the shard is cast *before* the all-gather, so
  the traffic and the layer's compute are in low precision while master weights, gradients and the
  optimizer update stay fp32. Floating inputs of sharded layers are cast to ``compute_dtype``.
- **Prefetch.** The first forward records the order in which sharded layers run. Afterwards, when layer
  ``k`` starts, the all-gather of layer ``k+1`` is launched asynchronously so it overlaps layer ``k``'s
  compute; in backward, re-gathering a layer launches the gather of the layer that backward reaches
  next (the previous one in forward order).
- **Gather units.** All of the above works per :class:`GatherUnit`: one layer by default, or with
  ``gather_units=(Block,)`` every sharded layer inside one ``Block``, whose weights then come in one
  collective (packed, gathered, copied out: per weight one launch, allocation and cast fewer on the host)
  and stay until the ``Block``'s forward returns, as FSDP2's per-block sharding holds them.

Checkpoints are explicit: :meth:`FSDP.full_state_dict` (a collective; loads into the plain model) or
:meth:`FSDP.sharded_state_dict` (this rank's shards with their layout); ``state_dict()`` refuses to guess.

Limitations: a sharded weight must only be used inside its own module's ``forward`` (a functional use
elsewhere sees the 1-D shard; the resulting shape error is explained as such); every backward must be
followed by :meth:`~FSDP.finish_gradient_synchronization` before the next forward (no local gradient
accumulation); every rank must run the same sharded layers in the same order, evaluation included (each is an
all-gather: a rank that gathers another layer pairs its collective with the wrong one; when the sizes happen to
agree, the end-of-step check names it).
"""

from __future__ import annotations

import collections
import contextlib
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Embedding as BasicsEmbedding
from cs336_basics.model import Linear as BasicsLinear

from .consistency import (
    CheckEvery,
    DetectNonfinite,
    ReplicaCheck,
    capturing,
    check_flags,
    check_same_parameters,
    resolve_check_every,
    resolve_detect_nonfinite,
)
from .collectives import broadcast_coalesced, broadcast_module_state
from .fsdp_shards import FlatShard, GatherUnit, PendingGroupGather, group_units
from .grad_sync import GradientReducer, per_parameter_buckets

#: Module types whose (trainable) parameters FSDP shards.
SHARDED_MODULE_TYPES: tuple[type[nn.Module], ...] = (BasicsLinear, BasicsEmbedding, nn.Linear, nn.Embedding)
_COMPUTE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class _Unshard(torch.autograd.Function):
    """``shard → gathered full weight`` for autograd: the forward returns the already gathered tensor;
    the backward hands the full-weight gradient to the shard's reduce-scatter and drops the backward
    copy of the weight. It returns no gradient for the shard: the averaged slice is installed by
    ``finish_gradient_synchronization`` once the reduce-scatter is done."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, gathered: torch.Tensor, layer: ShardedLayer, name: str) -> torch.Tensor:
        ctx.layer, ctx.name = layer, name
        return gathered

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.layer.shards[ctx.name].add_grad_contribution(grad_full)
        ctx.layer.awaiting[ctx.name] -= 1
        ctx.layer.release_backward_copy(ctx.name)
        return None, None, None, None


def _in_recomputation(outer: tuple[Any, Any] | None) -> bool:
    """Whether the running forward is ``torch.utils.checkpoint``'s (non-reentrant) recomputation: its hooks are
    the innermost, or a nested checkpoint's forward runs inside backward (within an enclosing recomputation).
    Reentrant checkpointing backpropagates its recomputed graph and installs no hooks: it is a real use."""
    name = getattr(outer[0], "__qualname__", "") if outer is not None else ""
    return name.startswith("_recomputation_hook.") or (
        name.startswith("_checkpoint_hook.") and torch._C._current_graph_task_id() != -1)


@dataclass(frozen=True)
class _Outer:
    """A saved tensor handed to the saved-tensor hooks that enclose the layer's forward (activation
    checkpointing's, which drop it and recompute it, or a user's ``save_on_cpu``): only the innermost pair of
    hooks runs, so the layer's own pair must pass on what it does not replace, or it silently keeps every
    linear input of a checkpointed block."""

    hooks: tuple[Any, Any]
    packed: Any


@dataclass(frozen=True)
class _Regather:
    """What autograd keeps instead of a saved alias of a gathered weight."""

    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own (tracing)
        return False


@dataclass
class ShardedLayer:
    """A module whose trainable direct parameters are sharded, and its gather/regather state."""

    index: int
    name: str
    module: nn.Module
    shards: dict[str, FlatShard]
    fsdp: Any  # weakref.proxy to the owning FSDP
    unit: GatherUnit = None  # type: ignore[assignment]  # the layers whose weights arrive with this one's (set last)
    backward_copy: dict[str, torch.Tensor] = field(default_factory=dict)
    current: dict[str, torch.Tensor] = field(default_factory=dict)  # gathered weights during forward
    awaiting: dict[str, int] = field(default_factory=dict)  # this layer's uses of each weight awaiting their gradient
    outer: tuple[Any, Any] | None = None  # the saved-tensor hooks around the running forward (checkpoint's)
    recomputing: bool = False  # the running forward is activation checkpointing's recomputation

    def release_backward_copy(self, name: str) -> None:
        """After a use's gradient: a lone layer drops its copy at once; a unit's layer keeps it for this layer's
        earlier uses of the weight (a layer called twice), as regathering would bring the whole unit again."""
        if len(self.unit.layers) == 1 or self.awaiting.get(name, 0) <= 0:
            self.backward_copy.pop(name, None)

    def pack(self, t: torch.Tensor) -> Any:
        for name, full in self.current.items():
            if _same_storage(t, full):
                if not self.recomputing:  # (a recomputation's gathered weights are already the backward copy)
                    self.fsdp._needs_backward_gather(self)
                return _Regather(name, t.size(), t.stride(), t.storage_offset())
        return _Outer(self.outer, self.outer[0](t)) if self.outer is not None else t

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Outer):
            return saved.hooks[1](saved.packed)
        if not isinstance(saved, _Regather):
            return saved
        if saved.name not in self.backward_copy:
            self.fsdp._fetch_for_backward(self)
        full = self.backward_copy[saved.name]
        return full.as_strided(saved.size, saved.stride, saved.offset)


class _LayerForward:
    """Replaces a sharded module's ``forward``: gather, substitute, run with regather hooks."""

    def __init__(self, fsdp: FSDP, layer: ShardedLayer, original: Any):
        self.fsdp = weakref.proxy(fsdp)
        self.layer = layer
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fsdp._run_layer(self.layer, self.original, args, kwargs)


# --------------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------------


class FSDP(nn.Module):
    """Fully-sharded data parallel wrapper (see module docstring). Training loop::

        model = FSDP(module, compute_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters())      # optimizer state is sharded too
        loss_fn(model(x_shard), y_shard).backward()
        model.finish_gradient_synchronization()
        opt.step(); opt.zero_grad()

    All ranks must hold the same initial module; rank 0's values are broadcast before sharding.
    ``replicated_modules`` (names as in ``named_modules()``) stay whole on every rank, their gradients
    all-reduced as for norms: for a weight used outside its module's forward, such as an LM head whose
    weight a fused cross-entropy reads directly. ``gather_units`` (module types, such as the Transformer
    block) gathers the sharded layers inside each such module together, in one collective per step and
    direction, instead of one per layer (the handout's schedule: at most the next layer's weights in flight).
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        prefetch: bool = True,
        gather_units: tuple[type[nn.Module], ...] = (),
        max_reductions_in_flight: int = 2,
        sharded_module_types: tuple[type[nn.Module], ...] = SHARDED_MODULE_TYPES,
        replicated_modules: tuple[str, ...] = (),
        check_every: CheckEvery = "auto",
        broadcast_buffers: bool = True,
        detect_nonfinite: DetectNonfinite = "auto",
    ):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDP needs an initialised process group (init_process_group() or spawn())")
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be None, float32, float16 or bfloat16, got {compute_dtype}")
        self.module = module
        self.compute_dtype = compute_dtype if compute_dtype != torch.float32 else None
        self.process_group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.prefetch = prefetch
        if isinstance(max_reductions_in_flight, bool) or not isinstance(max_reductions_in_flight, int) \
                or max_reductions_in_flight < 1:
            raise ValueError(f"max_reductions_in_flight must be an int >= 1, got {max_reductions_in_flight!r}")
        check_flags("FSDP", prefetch=prefetch, broadcast_buffers=broadcast_buffers)
        self.broadcast_buffers = broadcast_buffers
        self._reductions_in_flight: collections.deque = collections.deque()
        for p in module.parameters():
            if p.requires_grad and not p.is_floating_point():
                raise ValueError("FSDP shards floating-point parameters only")
        unknown = [n for n in replicated_modules if n not in dict(module.named_modules())]
        if unknown:
            raise ValueError(f"replicated_modules names no submodule: {unknown} (names as in named_modules())")
        every = resolve_check_every(check_every, group)
        check_finite = resolve_detect_nonfinite(detect_nonfinite, group)
        check_same_parameters(module, group, wrapper="FSDP")  # before any collective over the parameters
        broadcast_module_state(module, group=group)

        self.layers: list[ShardedLayer] = []
        shards: dict[nn.Parameter, FlatShard] = {}  # a weight shared by two layers is sharded once
        me = weakref.proxy(self)
        for name, sub in module.named_modules():
            if not isinstance(sub, sharded_module_types) or name in replicated_modules:
                continue
            layer_shards = {}
            for pname, p in sub.named_parameters(recurse=False):
                if p.requires_grad:
                    if p not in shards:
                        shards[p] = FlatShard(
                            p, self.rank, self.world_size, group, self._reductions_in_flight, max_reductions_in_flight
                        )
                    layer_shards[pname] = shards[p]
            if layer_shards:
                layer = ShardedLayer(len(self.layers), name, sub, layer_shards, me)
                sub.forward = _LayerForward(self, layer, sub.forward)
                self.layers.append(layer)
        self._shards = list(shards.values())
        self.units = group_units(module, self.layers, gather_units, weakref.proxy(self))
        sharded_ids = {id(p) for p in shards}
        seen: set[int] = set()
        replicated = []
        for p in module.parameters():
            if p.requires_grad and id(p) not in sharded_ids and id(p) not in seen:
                seen.add(id(p))
                replicated.append(p)
        self.replicated_parameters = replicated
        for shard in self._shards:
            shard.check_finite = check_finite
        trainable = [p for p in module.parameters() if p.requires_grad]  # module order, each once
        # Replicated parameters (norm gains, small) are all-reduced at finish, after every shard's reduce-scatter:
        # launched from their hooks they would interleave with the reduce-scatters on the same group in an order
        # that depends on which parameters each rank used.
        self._reducer = GradientReducer(per_parameter_buckets(replicated, reverse=True), overlap=False, group=group,
                                        check_finite=check_finite, order=trainable)
        # Shards differ by design; replicated parameters, buffers and the synchronisation count must not.
        names = {id(p): n for n, p in module.named_parameters()}
        self._shard_position = {id(p): k for k, p in enumerate(trainable)}
        self.replica_check = ReplicaCheck(
            [(names[id(p)], p) for p in replicated], group, every, wrapper="FSDP",
            named_buffers=[] if broadcast_buffers else list(module.named_buffers()),
            grad_names=[names[id(p)] for p in trainable],
        )
        self._gathers_this_step = [0, 0]  # (count, order hash) of the sharded layers gathered this step

        self._forward_order: list[int] | None = None  # unit indices in the first forward's order
        self._recording: list[int] = []
        self._forward_pos: int | None = None
        self._prefetched: dict[int, PendingGroupGather] = {}  # by unit index, as the orders and the stack below
        self._live: tuple[GatherUnit, dict[int, dict[str, torch.Tensor]]] | None = None  # a unit's forward weights
        self._backward_stack: list[int] = []
        self._bwd_prefetched: dict[int, PendingGroupGather] = {}
        self.stats = {"forward_gathers": 0, "backward_gathers": 0, "prefetch_hits": 0}

    def _unit_done(self, unit: GatherUnit) -> None:
        """The unit's module returned from its forward (a recomputation's too): its weights go."""
        if self._live is not None and self._live[0] is unit:
            self._live = None

    # ---------------------------------------------------------------------------------------------
    # Forward
    # ---------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.replica_check.before_forward()  # first: a rank that skipped finish_...() fails on every rank
        self._live = None
        if any(s.pending_grads for s in self._shards):
            raise RuntimeError("call finish_gradient_synchronization() after backward, before the next forward")
        if self.broadcast_buffers and torch.is_grad_enabled():
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        self._recording = []
        self._forward_pos = 0 if (self.prefetch and self._forward_order) else None
        self._backward_stack = []
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as exc:
            raise self._explain_outside_use(exc) from exc
        finally:
            self._live = None
            self._drop(self._prefetched)
            if self._forward_order is None or self._forward_pos is None:
                self._forward_order = self._recording

    def _explain_outside_use(self, exc: RuntimeError) -> RuntimeError:
        """A shape error that mentions a shard's length most likely comes from a sharded weight used
        outside its own module's forward (``h @ emb.weight.T`` for a tied head), where only the 1-D shard
        exists: say so instead of leaving a bare size mismatch."""
        text = str(exc)
        lengths = {str(sh.shard_numel) for sh in self._shards}
        if not any(re.search(rf"\b{n}\b", text) for n in lengths) or not re.search(r"size|shape", text):
            return exc
        return RuntimeError(
            f"{text}\nFSDP: this looks like a sharded weight used outside its own module's forward (a tied "
            "output head computing h @ embedding.weight.T, say): there the parameter is this rank's 1-D shard, "
            "its full value exists only inside the owning module's forward. Call the module itself, or keep "
            "that module replicated by leaving its type out of sharded_module_types."
        )

    def _cast_inputs(self, value: Any) -> Any:
        if self.compute_dtype is None:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.compute_dtype) if value.is_floating_point() else value
        if isinstance(value, tuple | list):
            return type(value)(self._cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self._cast_inputs(v) for k, v in value.items()}
        return value

    def _claim_gather(self, prefetched: dict[int, PendingGroupGather], unit: GatherUnit,
                      counter: str) -> PendingGroupGather:
        """The unit's gather launched ahead into ``prefetched`` (a prefetch hit), else one launched now."""
        pending = prefetched.pop(unit.index, None)
        if pending is not None:
            self.stats["prefetch_hits"] += 1
        else:
            pending = unit.start_gather()
        self.stats[counter] += 1
        return pending

    def _take_forward_gather(self, layer: ShardedLayer) -> dict[str, torch.Tensor]:
        unit = layer.unit
        if self._live is not None and self._live[0] is unit:  # a later layer of the unit: its weights are here
            return self._live[1][layer.index]
        self._live = None  # the previous unit's weights go before the next unit's arrive
        self._recording.append(unit.index)
        pending = self._claim_gather(self._prefetched, unit, "forward_gathers")
        # Launch the next unit's gather before waiting on this one, so it overlaps this unit's compute.
        order, pos = self._forward_order, self._forward_pos
        if order is not None and pos is not None:
            if pos < len(order) and order[pos] == unit.index:
                self._forward_pos = pos + 1
                if pos + 1 < len(order) and order[pos + 1] not in self._prefetched:
                    self._prefetched[order[pos + 1]] = self.units[order[pos + 1]].start_gather()
            else:  # control flow changed: stop prefetching, re-record the order
                self._forward_pos = None
                self._drop(self._prefetched)
        full = pending.wait()
        if len(unit.layers) > 1:  # kept until the unit's module returns; a lone layer's go when its forward returns
            self._live = (unit, full)
        return full[layer.index]

    def _run_layer(self, layer: ShardedLayer, original: Any, args: tuple, kwargs: dict) -> Any:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        recomputing = _in_recomputation(outer)
        if recomputing:
            # Checkpointing re-runs the forward inside backward only to regenerate saved tensors: its graph is
            # never backpropagated (the original forward's is), so it is no new use of the weights. Its gather
            # becomes the layer's backward copy, which the original graph's regathers then find.
            # The copies require grad as the original forward's did, so autograd saves the same tensors.
            gathered = {name: full.detach().requires_grad_() for name, full in
                        self._fetch_for_recomputation(layer).items()}
        else:
            gathered = self._take_forward_gather(layer)
            if torch.is_grad_enabled():
                for name, shard in layer.shards.items():
                    shard.note_use()
                    layer.awaiting[name] = layer.awaiting.get(name, 0) + 1
                gathered = {
                    name: _Unshard.apply(layer.shards[name].param, full, layer, name) for name, full in gathered.items()
                }
        args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        layer.current, layer.outer, layer.recomputing = gathered, outer, recomputing
        try:
            with self._substituted(layer.module, gathered), torch.autograd.graph.saved_tensors_hooks(
                layer.pack, layer.unpack
            ):
                return original(*args, **kwargs)
        finally:
            layer.current, layer.outer, layer.recomputing = {}, None, False

    @staticmethod
    @contextlib.contextmanager
    def _substituted(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        """Make ``module.<name>`` resolve to the gathered tensor: an instance attribute is found before
        ``nn.Module.__getattr__`` looks in ``_parameters``, which keeps the shard registered."""
        for name, t in tensors.items():
            module.__dict__[name] = t
        try:
            yield
        finally:
            for name in tensors:
                module.__dict__.pop(name, None)

    # ---------------------------------------------------------------------------------------------
    # Backward
    # ---------------------------------------------------------------------------------------------

    def _needs_backward_gather(self, layer: ShardedLayer) -> None:
        if not self._backward_stack or self._backward_stack[-1] != layer.unit.index:
            self._backward_stack.append(layer.unit.index)

    def _fetch_for_backward(self, layer: ShardedLayer) -> None:
        unit = layer.unit
        pending = self._claim_gather(self._bwd_prefetched, unit, "backward_gathers")
        stack = self._backward_stack
        if unit.index in stack:  # backward visits units in reverse forward order
            while stack and stack.pop() != unit.index:
                pass
        if self.prefetch and stack and stack[-1] not in self._bwd_prefetched:
            self._bwd_prefetched[stack[-1]] = self.units[stack[-1]].start_gather()
        self._keep_for_backward(layer, pending.wait())

    @staticmethod
    def _keep_for_backward(layer: ShardedLayer, full: dict[int, dict[str, torch.Tensor]]) -> None:
        """Backward copies for the asking layer and for the unit's layers whose gradients are still to come (a
        layer already done would hold its copy to the end of the step)."""
        for member in layer.unit.layers:
            if member is layer or any(n > 0 for n in member.awaiting.values()):
                for name, t in full[member.index].items():
                    member.backward_copy.setdefault(name, t)

    def _fetch_for_recomputation(self, layer: ShardedLayer) -> dict[str, torch.Tensor]:
        """The layer's weights for checkpointing's recomputation (a backward prefetch of its unit if one was
        launched), kept as its backward copy until its gradient is known."""
        if not layer.backward_copy:
            pending = self._claim_gather(self._bwd_prefetched, layer.unit, "backward_gathers")
            self._keep_for_backward(layer, pending.wait())
        return dict(layer.backward_copy)

    def _count_gather(self, unit: GatherUnit) -> None:
        count, digest = self._gathers_this_step
        self._gathers_this_step = [count + 1, (digest * 1_000_003 + unit.index + 1) % 2_147_483_647]

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient reduction of the last backward and install the results: sharded
        parameters get their averaged fp32 slice, replicated ones the averaged full gradient. The ranks then
        compare notes (control channel): replicated parameters no rank used get ``grad=None`` back, a
        non-finite local gradient is named with its rank, and so is a rank that gathered other sharded
        layers than its peers (which pairs one layer's all-gather with another's)."""
        for shard in self._shards:
            shard.flush_grad()  # reduce-scatters of uses whose gradient never arrived, before the all-reduces
        self._reducer.finish()
        for shard in self._shards:
            shard.finish_grad()
        self._reductions_in_flight.clear()
        self._drop(self._bwd_prefetched)
        self._backward_stack = []
        for layer in self.layers:
            layer.backward_copy.clear()
            layer.awaiting.clear()
        used, nonfinite = self._reducer.local_report()
        graph = capturing()
        for shard in self._shards:
            if shard.finite is not None and not graph and not bool(shard.finite):
                nonfinite.append(self._shard_position[id(shard.param)])
            shard.finite = None
        same = ("the ranks gathered different sharded layers: every rank must run the same sharded layers in the "
                "same order, or one layer's all-gather pairs with another's (gathers, order hash)",
                self._gathers_this_step)
        self._gathers_this_step = [0, 0]
        used_anywhere = None
        try:
            used_anywhere = self.replica_check.end_sync(used, nonfinite, same)
        finally:
            self._reducer.end_step(used_anywhere)

    @staticmethod
    def _drop(pending: dict[int, PendingGroupGather]) -> None:
        """Complete and discard gathers that were prefetched but not used (collectives must finish)."""
        for gathers in pending.values():
            gathers.complete()
        pending.clear()

    # ---------------------------------------------------------------------------------------------
    # Inspection and checkpoints
    # ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` for every parameter of the wrapped module (names without the
        ``module.`` prefix), sharded ones all-gathered in their master dtype. A collective. A tied weight
        appears under each of its names (as in a plain module's ``state_dict()``), gathered once."""
        by_param = {id(s.param): s for s in self._shards}
        gathered: dict[int, torch.Tensor] = {}
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in gathered:
                shard = by_param.get(id(p))
                gathered[id(p)] = shard.full_tensor() if shard is not None else p.detach().clone()
            out[name] = gathered[id(p)]
        return out

    def _persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a plain module's ``state_dict()`` holds: not the non-persistent ones (RoPE's tables, a
        function of the hyperparameters), so FSDP's dicts and a plain model's load into each other."""
        keys = set(self.module.state_dict(keep_vars=True))
        return [(n, b) for n, b in self.module.named_buffers() if n in keys]

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [s.param for s in self._shards]

    # Checkpoints are explicit: a plain state_dict() of this wrapper would hold 1-D shards under the
    # full parameters' names, which loads into nothing, so it is refused with the two alternatives.

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(
            "FSDP.state_dict() is ambiguous (its parameters are 1-D shards): use full_state_dict() for a "
            "consolidated dict that loads into the plain model (a collective), or sharded_state_dict() for "
            "this rank's shards (no communication; load with load_sharded_state_dict on the same world size)"
        )

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise RuntimeError("use FSDP.load_full_state_dict() or FSDP.load_sharded_state_dict()")

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state (parameters in their full shape and master dtype, and buffers) under
        the plain module's names: ``plain_model.load_state_dict(fsdp.full_state_dict())`` works. A
        collective: every rank must call it; every rank receives the whole dict."""
        full = self.gather_full_params()
        return {**{n: b.detach().clone() for n, b in self._persistent_buffers()}, **full}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a consolidated dict (from :meth:`full_state_dict` or a plain model's ``state_dict()``):
        each rank keeps its own slice. Names, shapes and dtypes are checked first; the first mismatch
        raises ``ValueError`` before anything is written. No communication."""
        params = dict(self.module.named_parameters(remove_duplicate=False))  # a tied weight under each name
        buffers = dict(self._persistent_buffers())
        shard_of = {id(sh.param): sh for sh in self._shards}
        names_of: dict[int, list[str]] = {}
        for name, p in params.items():
            names_of.setdefault(id(p), []).append(name)
        missing = [names[0] for names in names_of.values() if not any(n in state for n in names)]
        missing += [n for n in buffers if n not in state]
        unexpected = [n for n in state if n not in params and n not in buffers]
        if missing or unexpected:
            raise ValueError(f"FSDP.load_full_state_dict: missing {missing[:3]}, unexpected {unexpected[:3]} "
                             "(names are the plain module's, without a 'module.' prefix)")
        first_name: dict[int, str] = {}
        for name, p in params.items():
            if name not in state:
                continue  # a tied weight's other name, absent from a dict that lists it once
            shard = shard_of.get(id(p))
            shape = tuple(shard.shape) if shard is not None else tuple(p.shape)
            value = state[name]
            other = first_name.setdefault(id(p), name)
            if other != name and not torch.equal(state[other], value):
                raise ValueError(f"FSDP.load_full_state_dict: {name!r} and {other!r} are one tied weight here but "
                                 "differ in the dict")
            if tuple(value.shape) != shape or value.dtype != p.dtype:
                raise ValueError(f"FSDP.load_full_state_dict: {name!r} is {tuple(value.shape)} {value.dtype} in "
                                 f"the dict but {shape} {p.dtype} in the model")
        for p_id, name in first_name.items():
            p = params[name]
            shard = shard_of.get(p_id)
            if shard is None:
                p.copy_(state[name])
                continue
            flat = state[name].reshape(-1).to(p.device)
            start = self.rank * shard.shard_numel
            valid = max(0, min(shard.numel - start, shard.shard_numel))
            p.zero_()
            p[:valid].copy_(flat[start : start + valid])
        for name, b in buffers.items():
            b.copy_(state[name])

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's state as saved: the 1-D shards and replicated parameters, buffers, and the layout
        they belong to (world size, rank, full shapes), so it can only be loaded where it fits."""
        shard_of = {id(sh.param): sh for sh in self._shards}
        return {
            "fsdp_sharded": {
                "world_size": self.world_size,
                "rank": self.rank,
                "full_shapes": {n: list(shard_of[id(p)].shape) for n, p in self.module.named_parameters()
                                if id(p) in shard_of},
            },
            "tensors": {n: t.detach().clone() for n, t in [*self.module.named_parameters(), *self._persistent_buffers()]},
        }

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` saved on this rank of a run with the same world size and
        model; anything else raises ``ValueError`` naming the difference before anything is written."""
        if not isinstance(state, dict) or "fsdp_sharded" not in state:
            raise ValueError("not an FSDP sharded state dict (no 'fsdp_sharded' layout record); for a "
                             "consolidated dict use load_full_state_dict()")
        layout = state["fsdp_sharded"]
        if (layout["world_size"], layout["rank"]) != (self.world_size, self.rank):
            raise ValueError(f"this shard was saved by rank {layout['rank']} of {layout['world_size']}; this is rank "
                             f"{self.rank} of {self.world_size}: save a full_state_dict() to change the layout")
        mine = self.sharded_state_dict()
        if layout["full_shapes"] != mine["fsdp_sharded"]["full_shapes"]:
            diff = next(n for n in {**layout["full_shapes"], **mine["fsdp_sharded"]["full_shapes"]}
                        if layout["full_shapes"].get(n) != mine["fsdp_sharded"]["full_shapes"].get(n))
            raise ValueError(f"the shard belongs to another model: {diff!r} is {layout['full_shapes'].get(diff)} "
                             f"there and {mine['fsdp_sharded']['full_shapes'].get(diff)} here")
        tensors = dict([*self.module.named_parameters(), *self._persistent_buffers()])
        saved = state["tensors"]
        if set(saved) != set(tensors):
            raise ValueError(f"FSDP.load_sharded_state_dict: tensor names differ: {sorted(set(saved) ^ set(tensors))[:3]}")
        for name, t in tensors.items():
            if saved[name].shape != t.shape or saved[name].dtype != t.dtype:
                raise ValueError(f"FSDP.load_sharded_state_dict: {name!r} is {tuple(saved[name].shape)} "
                                 f"{saved[name].dtype} saved but {tuple(t.shape)} {t.dtype} here")
        for name, t in tensors.items():
            t.copy_(saved[name])

    def extra_repr(self) -> str:
        dtype = self.compute_dtype or "fp32"
        return (
            f"world_size={self.world_size}, sharded_layers={len(self.layers)}, gather_units={len(self.units)}, "
            f"replicated_params={len(self.replicated_parameters)}, compute_dtype={dtype}, prefetch={self.prefetch}"
        )
