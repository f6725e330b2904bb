"""The gradient-synchronisation mechanism every data-parallel strategy in this package shares.

Data parallelism keeps a full replica of the model on each rank, gives each rank a different slice of
the batch, and averages gradients before the optimizer step, so every replica takes the same step as
single-process training on the whole batch would. The strategies differ only in *policy*:

==============  =====================================  ============================================
strategy        how parameters are grouped             when a group's all-reduce is launched
==============  =====================================  ============================================
naive           one group per parameter                after backward, one blocking call at a time
flat            one group holding every parameter      after backward
individual      one group per parameter (reverse)      as soon as the parameter's gradient is ready
bucketed        groups of ≤ ``bucket_size_mb`` MiB     as soon as the group's last gradient is ready
==============  =====================================  ============================================

so the *mechanism* lives here, once:

- :func:`trainable_parameters` — unique parameters that need gradients (a tied weight counts once);
- :mod:`~cs336_systems.distributed.collectives` — the averaging all-reduce each bucket launches and the
  broadcasts of rank 0's parameters and buffers;
- :class:`GradBucket` — a group of parameters with a persistent flat buffer (reused every step), optionally
  also the storage of their ``.grad`` (``gradient_as_bucket_view``), so no gradient is copied;
- :class:`GradientReducer` — launches buckets (from ``register_post_accumulate_grad_hook`` hooks or
  after backward), always **in bucket order**, so every rank issues collectives in the same sequence
  even if its autograd engine finishes gradients in a slightly different order;
- :class:`DataParallel` — the ``nn.Module`` wrapper the strategies subclass.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.collectives import (
    MeanAllReduce,
    PendingReduce,
    broadcast_coalesced,
    broadcast_module_state,
    check_comm_dtype,
)
from cs336_systems.distributed.consistency import (
    CheckEvery,
    DetectNonfinite,
    ReplicaCheck,
    capturing,
    check_flags,
    check_same_parameters,
    resolve_check_every,
    resolve_detect_nonfinite,
)

MIB = 2**20


# --------------------------------------------------------------------------------------------------
# Parameters and replicas
# --------------------------------------------------------------------------------------------------


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients, each exactly once, in ``module.parameters()`` order.

    ``parameters()`` already skips repeated *objects* (a weight tied by ``b.weight = a.weight`` or used
    twice functionally appears once); deduplicating by identity here makes that guarantee explicit, since
    reducing a shared gradient twice would double-count it. Frozen parameters (``requires_grad=False``)
    have no gradient to synchronise.
    """
    seen: set[int] = set()
    params = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``batch`` along dim 0.

    Raises ``ValueError`` if the batch does not divide evenly: uneven shards would weight some examples
    more than others in the averaged gradient, silently breaking equivalence with full-batch training.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")
    if batch.shape[0] % world_size:
        raise ValueError(
            f"batch size {batch.shape[0]} does not divide by the world size {world_size}; "
            "use a global batch that is a multiple of the number of ranks"
        )
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


# --------------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------------


def per_parameter_buckets(params: Sequence[nn.Parameter], *, reverse: bool) -> list[list[nn.Parameter]]:
    """One bucket per parameter; ``reverse=True`` puts the last-registered (first-ready) parameter first."""
    order = list(reversed(params)) if reverse else list(params)
    return [[p] for p in order]


def bucket_size_mb_value(value: Any, what: str = "bucket_size_mb", *, allow_none: bool = True) -> float | None:
    """``value`` as a bucket cap in MiB: a finite number > 0 (``None``, where allowed: one bucket). The one check
    of a bucket size, wherever one enters (a strategy, the DDP benchmark's config, a section's parameters);
    anything else is a one-line ``ValueError`` naming ``what``. A boolean is no size (``True`` is not 1 MiB)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        one = " or None (one bucket)" if allow_none else ""
        raise ValueError(f"{what} must be a finite number of MiB > 0{one}, got {value!r}")
    return float(value)


def size_capped_buckets(params: Sequence[nn.Parameter], bucket_size_mb: float | None) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of at most ``bucket_size_mb`` MiB, filled in *reverse*
    ``parameters()`` order.

    Reverse order approximates the order in which backward produces gradients (the output layer first),
    so a bucket's gradients become ready together and its all-reduce can start while backward continues
    through earlier layers. A parameter larger than the cap gets a bucket of its own. ``None`` means a
    single bucket. Buckets never mix dtypes or devices, since each is reduced as one flat tensor.
    """
    bucket_size_mb = bucket_size_mb_value(bucket_size_mb)
    cap = float("inf") if bucket_size_mb is None else bucket_size_mb * MIB
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        compatible = not current or (current[0].dtype == p.dtype and current[0].device == p.device)
        if current and (current_bytes + nbytes > cap or not compatible):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradBucket:
    """A group of parameters reduced by one collective.

    A bucket of several parameters owns a flat buffer (its slice of the reducer's gradient storage),
    allocated once and reused every step. Two ways to get gradients into it:

    - ``grad_views=True`` (as ``torch`` DDP's ``gradient_as_bucket_view``): each parameter's ``.grad``
      *is* a view of its slice. Autograd accumulates straight into the bucket (``AccumulateGrad`` adds
      in place into a defined ``.grad``), so the ready-hook copies nothing, the average needs no copy back,
      and no second gradient-sized allocation exists. When ``zero_grad(set_to_none=True)`` dropped the
      views, :meth:`GradientReducer.attach_grad_views` (called before forward) zeroes and re-attaches
      them; a gradient that is not the view when it becomes ready (set elsewhere) is copied in and
      replaced by the view.
    - ``grad_views=False``: each gradient is copied into its slice when ready, and the average is copied
      back into ``.grad`` after the collective.

    Why it matters: in a host-bound backward (bf16 autocast of a large model at a small batch, see
    ``docs/ddp/NOTES.md``) the GPU waits for every host operation, so the per-parameter slicing and copy in
    the hook and the per-parameter copy back after it lengthen the step one for one.

    A bucket of one parameter reduces that parameter's ``.grad`` in place (no buffer, no copy).
    """

    def __init__(self, index: int, params: Sequence[nn.Parameter], comm_dtype: torch.dtype | None, *,
                 flat: torch.Tensor | None = None, grad_views: bool = False):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        first = params[0]
        for p in params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError("all parameters of a bucket must share dtype and device")
        self.index = index
        self.params = list(params)
        self.numel = sum(p.numel() for p in params)
        self.nbytes = self.numel * first.element_size()
        self.comm_dtype = None if comm_dtype in (None, first.dtype) else comm_dtype
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        if len(params) == 1:
            self.flat = None
        elif flat is None:
            self.flat = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        elif flat.shape != (self.numel,) or flat.dtype != first.dtype or flat.device != first.device:
            raise ValueError(f"flat buffer must be a 1-D {first.dtype} tensor of {self.numel} elements on {first.device}")
        else:
            self.flat = flat
        self.grad_views = grad_views and self.flat is not None
        self._views = [self._view(i) for i in range(len(params))] if self.flat is not None else []
        self._comm_buffer: torch.Tensor | None = None
        self.staged: set[int] = set()
        self.pending: PendingReduce | None = None
        self.supplied: set[int] = set()  # parameters whose .grad this step is ours (zeros or an attached view)
        self.finite: torch.Tensor | None = None  # per parameter: was its local gradient finite (if checked)

    def local_grads(self) -> list[torch.Tensor]:
        """Each parameter's local gradient as it will be reduced (the flat buffer's slices once staged)."""
        if self.flat is not None:
            return list(self._views)
        return [self.params[0].grad] if self.params[0].grad is not None else []

    @property
    def is_ready(self) -> bool:
        return len(self.staged) == len(self.params)

    def _view(self, i: int) -> torch.Tensor:
        assert self.flat is not None
        p = self.params[i]
        return self.flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def grads_are_views(self) -> bool:
        """Whether every parameter's ``.grad`` is currently its slice of the flat buffer."""
        return self.flat is not None and all(p.grad is v for p, v in zip(self.params, self._views))

    def stage(self, i: int) -> None:
        """Mark parameter ``i``'s gradient ready, copying it into the flat buffer unless it already lives
        there. A parameter without a gradient (unused in this forward) contributes zeros."""
        p = self.params[i]
        if self.flat is not None:
            view, grad = self._views[i], p.grad
            if grad is not view:
                with torch.no_grad():
                    if grad is None:
                        view.zero_()
                    else:
                        view.copy_(grad)
                        if self.grad_views:
                            p.grad = view  # from now on autograd accumulates into the bucket
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
            self.supplied.add(i)
        self.staged.add(i)

    def launch(self, collective: MeanAllReduce, async_op: bool, check_finite: bool = False) -> None:
        if len(self.staged) != len(self.params):
            for i in range(len(self.params)):
                if i not in self.staged:
                    self.stage(i)
        tensor = self.flat if self.flat is not None else self.params[0].grad
        assert tensor is not None
        if check_finite:  # this rank's own gradients, before the average mixes every rank's in
            self.finite = torch.stack([torch.isfinite(g).all() for g in self.local_grads()])
        if self.comm_dtype is not None and (self._comm_buffer is None or self._comm_buffer.shape != tensor.shape):
            self._comm_buffer = torch.empty_like(tensor, dtype=self.comm_dtype)
        self.pending = collective(tensor, comm_dtype=self.comm_dtype, comm_buffer=self._comm_buffer, async_op=async_op)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the average and make it the parameters' ``.grad``. With views there is nothing to
        do: :meth:`stage` made every ``.grad`` its view, and the average was computed in place."""
        assert self.pending is not None, "finish() before launch()"
        self.pending.wait()
        if self.flat is not None and not self.grad_views:
            for i, (p, view) in enumerate(zip(self.params, self._views)):
                if p.grad is None:
                    p.grad = view.clone()
                    self.supplied.add(i)
                else:
                    p.grad.copy_(view)
        self.pending = None
        self.staged.clear()


def allocate_flat_buffers(
    buckets: Sequence[Sequence[nn.Parameter]],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """One zeroed gradient storage per (dtype, device) shared by all multi-parameter buckets; returns
    the storages and each bucket's contiguous slice of them (``None`` for single-parameter buckets,
    which need no buffer).

    Sharing one storage keeps bucket buffers adjacent and lets a whole step's gradients be zeroed with
    one kernel per dtype instead of one per bucket."""
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    for b in buckets:
        if len(b) > 1:
            key = (b[0].dtype, b[0].device)
            totals[key] = totals.get(key, 0) + sum(p.numel() for p in b)
    storage = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in totals.items()}
    cursor = dict.fromkeys(totals, 0)
    out: list[torch.Tensor | None] = []
    for b in buckets:
        if len(b) > 1:
            key, n = (b[0].dtype, b[0].device), sum(p.numel() for p in b)
            out.append(storage[key][cursor[key] : cursor[key] + n])
            cursor[key] += n
        else:
            out.append(None)
    return list(storage.values()), out


class GradientReducer:
    """Drives a list of :class:`GradBucket` through one synchronisation per optimizer step.

    Every parameter gets a ``register_post_accumulate_grad_hook``: it runs once per backward after the
    gradient (summed over all uses of a tied weight) has been accumulated into ``.grad``, and records that
    the parameter was used. With ``overlap=True`` it also stages the gradient, and a complete bucket is
    launched asynchronously. Buckets are launched strictly in index order — a complete bucket waits for
    its predecessors — so all ranks issue identical collective sequences. :meth:`finish` launches whatever
    is left (everything, for ``overlap=False``), waits, and writes the averaged gradients back.

    A parameter that got no gradient on this rank contributes zeros to the average (its rank's share of
    a parameter used elsewhere is zero). :meth:`local_report` says which parameters were used and whose
    local gradient was not finite; once the ranks have compared notes, :meth:`end_step` gives a parameter
    that no rank used its ``grad=None`` back, as one process would leave it (the zeros were ours), so an
    optimizer skips it rather than decaying it.

    ``grad_views=True`` makes multi-parameter buckets' gradients views of their flat buffers (see
    :class:`GradBucket`); :meth:`attach_grad_views` must then run before each forward (``DataParallel``
    does it), or the first ready-hook of a step copies and re-attaches instead.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[nn.Parameter]],
        *,
        overlap: bool,
        comm_dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
        blocking: bool = False,
        grad_views: bool = False,
        check_finite: bool = False,
        order: Sequence[nn.Parameter] | None = None,
    ):
        check_comm_dtype(comm_dtype)
        if overlap and blocking:
            raise ValueError("blocking all-reduces cannot overlap with backward")
        storages, flats = allocate_flat_buffers(buckets)
        self.buckets = [GradBucket(i, b, comm_dtype, flat=f, grad_views=grad_views)
                        for i, (b, f) in enumerate(zip(buckets, flats))]
        self.grad_views = grad_views
        # With views every multi-parameter bucket is a view bucket, so the storages are exactly theirs.
        self._view_storages = storages if grad_views else []
        self._view_slots = [(b, i) for b in self.buckets if b.grad_views for i in range(len(b.params))]
        self.group = group
        self.collective = MeanAllReduce(group)
        self.overlap = overlap
        self.blocking = blocking
        self.check_finite = check_finite
        self.sync_enabled = True
        self._next_to_launch = 0
        #: (bucket, index in bucket) of every parameter, in bucket order; ``used`` is indexed the same way.
        self.slots = [(bucket, i) for bucket in self.buckets for i in range(len(bucket.params))]
        self.used = [False] * len(self.slots)
        # Reports list parameters in ``order`` (the module's, so "first" means nearest the loss consistently).
        order = list(order) if order is not None else [b.params[i] for b, i in self.slots]
        position = {id(p): k for k, p in enumerate(order)}
        self.order_size = len(order)
        self.order_of_slot = [position[id(b.params[i])] for b, i in self.slots]
        seen: set[int] = set()
        for bucket in self.buckets:
            for p in bucket.params:
                if id(p) in seen:
                    raise ValueError("a parameter appears in two buckets; it would be reduced twice")
                seen.add(id(p))
        self._hooks = []
        for slot, (bucket, i) in enumerate(self.slots):
            # Bound with partial (called from C): no lookup of the parameter's bucket per call.
            hook = functools.partial(self._on_grad_ready, bucket, i, slot)
            self._hooks.append(bucket.params[i].register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @torch.no_grad()
    def attach_grad_views(self) -> None:
        """Point every view-bucket parameter whose ``.grad`` is ``None`` at its zeroed slice, so backward
        accumulates into the buckets (a no-op without ``grad_views``). After ``zero_grad(set_to_none=True)``
        every gradient is missing and the shared storage is zeroed with one kernel per dtype; gradients
        already present (views, or tensors set elsewhere) are left alone."""
        if not self._view_slots:
            return
        missing = [(b, i) for b, i in self._view_slots if b.params[i].grad is None]
        if not missing:
            return
        if len(missing) == len(self._view_slots):
            for storage in self._view_storages:
                storage.zero_()
        else:
            for b, i in missing:
                b._views[i].zero_()
        for b, i in missing:
            b.params[i].grad = b._views[i]
            b.supplied.add(i)

    def _on_grad_ready(self, bucket: GradBucket, i: int, slot: int, param: torch.Tensor) -> None:
        self.used[slot] = True
        if not (self.overlap and self.sync_enabled):
            return  # launched by finish(); inside no_sync(), gradients keep accumulating locally
        if i in bucket.staged or bucket.pending is not None:
            raise RuntimeError(
                "a gradient became ready twice before finish_gradient_synchronization(); call it after every "
                "backward, or accumulate gradients inside no_sync()"
            )
        bucket.stage(i)
        self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].is_ready:
            self.buckets[self._next_to_launch].launch(self.collective, async_op=True, check_finite=self.check_finite)
            self._next_to_launch += 1

    def finish(self) -> None:
        """Complete this step's synchronisation (a no-op while ``sync_enabled`` is False)."""
        if not self.sync_enabled:
            return
        for bucket in self.buckets[self._next_to_launch :]:
            bucket.launch(self.collective, async_op=not self.blocking, check_finite=self.check_finite)
            if self.blocking:
                bucket.finish()
        if not self.blocking:
            for bucket in self.buckets:
                bucket.finish()
        self._next_to_launch = 0

    def local_report(self) -> tuple[list[bool], list[int]]:
        """After :meth:`finish`, in ``order``: whether this rank used each parameter since the last step, and
        the positions whose local gradient was not finite (empty unless ``check_finite``). Reading the flags
        waits for the gradients on a GPU."""
        used = [False] * self.order_size  # parameters in ``order`` that this reducer does not handle: False
        for slot, k in enumerate(self.order_of_slot):
            used[k] = self.used[slot]
        flags = [b.finite for b in self.buckets if b.finite is not None] if not capturing() else []
        finite = torch.cat(flags).cpu().tolist() if flags else []  # waits for the gradients (GPU: opt-in)
        return used, [self.order_of_slot[slot] for slot, ok in enumerate(finite) if not ok]

    @torch.no_grad()
    def end_step(self, used_anywhere: Sequence[bool] | None) -> None:
        """Close a step: parameters no rank used lose the gradient this reducer gave them (zeros, or a
        view attached before the forward), so they end with ``grad=None`` as in one process; a gradient
        the caller set (``zero_grad(set_to_none=False)``) is left alone. ``None``: keep everything (under
        CUDA-graph capture, where Python runs once)."""
        if used_anywhere is not None:
            for slot, (bucket, i) in enumerate(self.slots):
                if not used_anywhere[self.order_of_slot[slot]] and i in bucket.supplied:
                    bucket.params[i].grad = None
        self.used = [False] * len(self.slots)
        for bucket in self.buckets:
            bucket.supplied.clear()
            bucket.finite = None

    def reset(self) -> None:
        """Drop a partially launched step (e.g. after an exception in backward)."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = None
            bucket.staged.clear()
            bucket.supplied.clear()
            bucket.finite = None
        self.used = [False] * len(self.slots)
        self._next_to_launch = 0


# --------------------------------------------------------------------------------------------------
# The module wrapper
# --------------------------------------------------------------------------------------------------


class DataParallel(nn.Module, abc.ABC):
    """Base wrapper: checks that every rank holds the same model, broadcasts rank 0's state, forwards
    calls, synchronises gradients via a :class:`GradientReducer`. A strategy is a subclass that sets the
    *policy* — how parameters are grouped (:meth:`plan_buckets`) and when groups are launched
    (``overlap``, ``blocking``) — and nothing else; the constructor below is shared by all of them.

    Training loop, for every strategy::

        model = DDPBucketed(module, bucket_size_mb=25)
        loss_fn(model(x_shard), y_shard).backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    With ``gradient_as_bucket_view=True`` (off by default, as in torch DDP; the committed GPU measurements
    used the copying path) the gradients of parameters that share a bucket
    are views of the bucket's buffer, re-attached at the start of every forward after
    ``zero_grad(set_to_none=True)``: do not ``detach_()`` or resize them. Single-parameter buckets are
    unaffected (their ``.grad`` is reduced in place anyway).

    Buffers are broadcast at wrap time and, with ``broadcast_buffers=True`` (the default, as in torch
    DDP), rank 0's before every training forward, in one collective per dtype: modules that update buffers
    in forward (BatchNorm's running statistics) then agree on every rank. With ``False`` each rank keeps
    its own, and the replica check compares them, so drift is an error rather than silent.

    A parameter that no rank used in a step ends it with ``grad=None``, as in one process (and as torch DDP
    with ``find_unused_parameters=True``), so AdamW neither decays nor moves it; one used on some ranks
    only gets the average with zeros from the others. The ranks compare which parameters they used in
    one small message per step on the control channel (:mod:`~cs336_systems.distributed.consistency`).

    ``check_every`` (forwards; ``"auto"``: every step on gloo, every 50 on GPUs; ``None``: off) verifies
    across ranks that each holds bit-identical parameters; every training forward checks that the ranks
    are at the same step (:class:`~cs336_systems.distributed.consistency.ReplicaCheck`). Run rank-local
    forwards (evaluation on rank 0) under ``torch.no_grad()``: only forwards in grad mode take part.
    ``detect_nonfinite`` (``"auto"``: on with gloo, off on GPUs, where reading the flags stalls the host
    once per step) checks each rank's own gradients before averaging and raises ``FloatingPointError``
    naming the rank and parameter where NaN/inf appeared first; turn it off under a gradient scaler,
    which expects inf.
    """

    #: Launch a bucket from gradient hooks as soon as it is complete (else after backward).
    overlap: bool = False
    #: Wait for each bucket's all-reduce before launching the next (the naive strategy).
    blocking: bool = False
    #: Whether ``gradient_as_bucket_view`` applies (strategies with multi-parameter buckets).
    supports_grad_views: bool = False

    @abc.abstractmethod
    def plan_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """The strategy's grouping of ``params`` (trainable, unique) into buckets, in launch order."""

    def __init__(
        self,
        module: nn.Module,
        *,
        comm_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        check_every: CheckEvery = "auto",
        detect_nonfinite: DetectNonfinite = "auto",
    ):
        super().__init__()
        name = type(self).__name__
        if gradient_as_bucket_view and not self.supports_grad_views:
            raise ValueError(f"gradient_as_bucket_view applies to 'flat' and 'bucketed', not {name}")
        check_flags(name, broadcast_buffers=broadcast_buffers, gradient_as_bucket_view=gradient_as_bucket_view)
        check_comm_dtype(comm_dtype)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; start workers with cs336_systems.distributed.launch")
        every = resolve_check_every(check_every, process_group)
        check_finite = resolve_detect_nonfinite(detect_nonfinite, process_group)
        # Before anything is communicated: a size mismatch in a broadcast would abort or hang the job.
        check_same_parameters(module, process_group, wrapper=name)
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        broadcast_module_state(module, group=process_group)
        params = trainable_parameters(module)
        self.reducer = GradientReducer(
            self.plan_buckets(params), overlap=self.overlap, blocking=self.blocking, comm_dtype=comm_dtype,
            group=process_group, grad_views=gradient_as_bucket_view, check_finite=check_finite, order=params,
        )
        names = {id(p): n for n, p in module.named_parameters()}
        self.replica_check = ReplicaCheck(
            list(module.named_parameters()), process_group, every, wrapper=name,
            named_buffers=[] if broadcast_buffers else list(module.named_buffers()),
            grad_names=[names[id(p)] for p in params],
            sync_start=not self.overlap,  # only there can a lagging rank's forward meet this step's all-reduces
        )

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def buckets(self) -> list[GradBucket]:
        return self.reducer.buckets

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.replica_check.before_forward()
        if self.broadcast_buffers and torch.is_grad_enabled():  # a rank-local no_grad forward sends nothing
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        self.reducer.attach_grad_views()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient holds the mean over ranks. Call after backward, before ``step()``."""
        if not self.reducer.sync_enabled:
            return
        self.replica_check.before_sync()
        self.reducer.finish()
        used_anywhere = None
        try:
            used_anywhere = self.replica_check.end_sync(*self.reducer.local_report())
        finally:
            self.reducer.end_step(used_anywhere)

    def on_train_batch_start(self) -> None:
        """Start a step from a clean state (drops a step abandoned half-way, e.g. by an exception)."""
        self.reducer.reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside the context launch no communication, and
        the first synchronisation after it averages the accumulated sum (as ``torch`` DDP's ``no_sync``)."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    def bucket_summary(self) -> list[dict[str, Any]]:
        """Per bucket: index, number of parameters, size in MiB (for tables and tests)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [
            {
                "bucket": b.index,
                "num_params": len(b.params),
                "size_mib": b.nbytes / MIB,
                "params": [names.get(id(p), "?") for p in b.params],
            }
            for b in self.buckets
        ]
