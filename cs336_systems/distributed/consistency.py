"""Cross-rank checks that turn silent divergence into an error at the step it starts.

Data-parallel training is correct only while every rank runs the same model through the same sequence of
collectives. The ways that breaks without any error of its own, and what catches each:

- **Different models at wrap time** (a rank built another width, or loaded another checkpoint). The first
  collective then has mismatched sizes, which gloo answers with an abort (``SIGABRT``, cause only in its
  stderr) and NCCL with a hang or garbage. :func:`check_same_parameters` compares names, shapes and
  dtypes with one small ``all_gather_object`` before any parameter is communicated.
- **Ranks out of step**: a rank skipped ``finish_gradient_synchronization()``, ran an extra forward, or ran
  out of batches early (uneven inputs). :class:`ReplicaCheck` sends a header (phase, finished
  synchronisations, forwards) at the end of every synchronisation and, every ``every`` steps (every step on
  gloo, whose collectives block the host), at the start of the training forward; a rank whose training
  function returned sends a last header saying so
  (:func:`announce_finished`, called by our launchers). Headers that differ raise on every rank, naming
  where each rank is ("rank 1 stopped after 2 steps, rank 0 is at a forward after 2 ...").
- **Replica drift** (a rank changed its parameters by itself, buffers that each rank updates from its own
  batch). Every ``every`` forwards the header carries a float64 sum of every parameter (and buffer, where
  the wrapper does not broadcast them), compared exactly.
- **Unused parameters and non-finite gradients**: the end-of-synchronisation message carries which
  parameters received a gradient on this rank (so one unused everywhere keeps ``grad=None``, as in one
  process) and the first parameter whose local gradient was NaN/inf (so the error names the rank and
  parameter where it appeared rather than the averaged NaN every rank then holds).

All of these messages travel on a **control channel**: a gloo group of the same ranks beside the gradient
group, with host tensors only. Control messages therefore never share a process group, and so never an
ordering, with gradient collectives that may still be in flight (a check issued between two asynchronous
all-reduces on the same group pairs with the wrong collective on a rank that launched them in another
order), and they never read a GPU value except where a check needs one (the sums every ``every`` steps,
the non-finite flags where that detection is on).
"""

from __future__ import annotations

import atexit
import datetime
import enum
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

#: Forwards between replica checks when ``check_every="auto"``: every step where a check costs next to
#: nothing (gloo on CPU), every 50 on GPUs, where reading the result stalls the host once.
AUTO_CHECK_EVERY = {"gloo": 1}
AUTO_CHECK_EVERY_GPU = 50

CheckEvery = int | Literal["auto"] | None
DetectNonfinite = bool | Literal["auto"]

ParameterDescription = tuple[str, tuple[int, ...], str]


def describe_parameters(module: nn.Module) -> list[ParameterDescription]:
    """``(name, shape, dtype)`` of every parameter, in ``named_parameters()`` order."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in module.named_parameters()]


def first_parameter_mismatch(per_rank: Sequence[Sequence[ParameterDescription]]) -> str | None:
    """The first way a rank's parameters differ from rank 0's, in words; ``None`` when all agree."""
    reference = list(per_rank[0])
    for rank, described in enumerate(per_rank[1:], start=1):
        described = list(described)
        for i, (mine, theirs) in enumerate(zip(reference, described)):
            if mine == theirs:
                continue
            (name0, shape0, dtype0), (name1, shape1, dtype1) = mine, theirs
            if name0 != name1:
                return f"parameter #{i} is {name0!r} on rank 0 but {name1!r} on rank {rank}"
            if shape0 != shape1:
                return f"parameter {name0!r} has shape {shape0} on rank 0 but {shape1} on rank {rank}"
            return f"parameter {name0!r} is {dtype0} on rank 0 but {dtype1} on rank {rank}"
        if len(described) != len(reference):
            longer, which = (reference, 0) if len(reference) > len(described) else (described, rank)
            extra = longer[min(len(reference), len(described))][0]
            return (f"rank 0 has {len(reference)} parameters and rank {rank} has {len(described)} "
                    f"(first unmatched: {extra!r} on rank {which})")
    return None


def check_same_parameters(module: nn.Module, group: dist.ProcessGroup | None = None, *, wrapper: str) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold parameters with the same
    names, shapes and dtypes (a collective: every rank must call it)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, describe_parameters(module), group=group)
    problem = first_parameter_mismatch(gathered)
    if problem is not None:
        raise ValueError(f"{wrapper}: the ranks hold different models: {problem}")


def resolve_check_every(check_every: CheckEvery, group: dist.ProcessGroup | None = None) -> int | None:
    """Forwards between replica checks (``None``: never)."""
    if check_every is None:
        return None
    if check_every == "auto":
        return AUTO_CHECK_EVERY.get(dist.get_backend(group), AUTO_CHECK_EVERY_GPU)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive int, 'auto' or None, got {check_every!r}")
    return check_every


def capturing() -> bool:
    """Whether a CUDA graph is being captured: Python then runs once, so nothing is sent or read on the host.
    A process that has not initialized CUDA captures nothing, and asking would initialize it: in a CPU rank
    forked from a parent that counted the GPUs, that fails with CUDA's "initialization error"."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_flags(wrapper: str, **flags: Any) -> None:
    """A wrapper's on/off options, each exactly ``True`` or ``False`` (``1`` or ``"yes"`` is one line's error)."""
    for option, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{wrapper}: {option} must be True or False, got {value!r}")


def resolve_detect_nonfinite(detect: DetectNonfinite, group: dist.ProcessGroup | None = None) -> bool:
    """Whether to look for NaN/inf in each rank's local gradients. ``"auto"``: on where it costs next to
    nothing (gloo on CPU); on GPUs it is opt-in, since reading the flags stalls the host once per step."""
    if detect == "auto":
        return dist.get_backend(group) == "gloo"
    if not isinstance(detect, bool):
        raise ValueError(f"detect_nonfinite must be True, False or 'auto', got {detect!r}")
    return detect


# --------------------------------------------------------------------------------------------------
# The control channel
# --------------------------------------------------------------------------------------------------


class Phase(enum.IntEnum):
    """Where a rank is when it sends a control header."""

    FORWARD = 0  # start of a training forward
    SYNC_START = 1  # start of finish_gradient_synchronization() (strategies that communicate only there)
    SYNC_END = 2  # end of finish_gradient_synchronization()
    FINISHED = 3  # the rank's training function returned


def _where(phase: int, syncs: int, forwards: int) -> str:
    if phase == Phase.FORWARD:
        return f"is at a forward after {syncs} finished gradient synchronizations"
    if phase == Phase.FINISHED:
        return f"stopped after {syncs} steps (its function returned after {syncs} gradient synchronizations)"
    return f"in finish_gradient_synchronization() after {syncs} finished"


def out_of_step_message(headers: Sequence[Sequence[int]], wrapper: str) -> str | None:
    """The first way a rank's header differs from rank 0's, in words (``None`` when all agree). A header
    is ``(phase, finished synchronisations, forwards, payload length)``."""
    reference = tuple(headers[0])
    for rank, header in enumerate(headers[1:], start=1):
        header = tuple(header)
        if header == reference:
            continue
        ranks = {0: reference, rank: header}
        finished = [r for r, h in ranks.items() if h[0] == Phase.FINISHED]
        if len(finished) == 1:
            (done,), other = finished, rank if finished[0] == 0 else 0
            phase, syncs, forwards, _ = ranks[other]
            steps = f"{ranks[done][1]} step{'' if ranks[done][1] == 1 else 's'}"
            return (f"uneven steps: rank {done} stopped after {steps} (its function returned), rank "
                    f"{other} is at step {syncs + 1} ({_where(phase, syncs, forwards).removeprefix('is ')}); every "
                    "rank must run the same number of steps: give each rank the same number of batches (drop an "
                    "uneven last batch)")
        behind, ahead = sorted(ranks, key=lambda r: (ranks[r][1], ranks[r][0], ranks[r][2], r))
        if ranks[behind][:2] == ranks[ahead][:2] and ranks[behind][2] != ranks[ahead][2]:
            hint = ("every rank must run the same forwards (FSDP gathers in every forward, evaluation included)"
                    if wrapper == "FSDP" else "run rank-local forwards (evaluation on one rank) under torch.no_grad()")
            return (f"{wrapper}: replicas out of step: rank {behind} is at training forward {ranks[behind][2]}, rank "
                    f"{ahead} at forward {ranks[ahead][2]} after {ranks[ahead][1]} gradient synchronizations; {hint}")
        if ranks[behind][:3] == ranks[ahead][:3]:
            return (f"{wrapper}: the ranks disagree on the size of a check ({ranks[behind][3]} values on rank "
                    f"{behind}, {ranks[ahead][3]} on rank {ahead}): they hold different models")
        return (f"{wrapper}: replicas out of step: rank {behind} {_where(*ranks[behind][:3])}, rank {ahead} "
                f"{_where(*ranks[ahead][:3]).removeprefix('is ')}; a rank skipped finish_gradient_synchronization() "
                "after a backward")
    return None


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The collective timeout ``group`` was created with (the control channel inherits it)."""
    pg = group if group is not None else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a backend without inspectable options
        return datetime.timedelta(seconds=300)


class ControlChannel:
    """Host-side messages among the ranks of one process group, on a gloo group of their own (see the
    module docstring for why). Every message is one all-gather of the same size on every rank: a header
    (phase, finished synchronisations, forwards, payload length), then the float64 payload, zero-padded to
    the largest payload any wrapper on the channel declared (:meth:`reserve`). A header that differs from
    rank 0's raises on every rank, and the payloads are then not read, so a rank out of step can never pair
    its message with another kind, nor make a collective's sizes differ (which gloo answers with an abort).
    One round trip per message: it costs the host tens of microseconds per step on a GPU node."""

    def __init__(self, group: dist.ProcessGroup | None):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # Only the group's own ranks take part in creating it, so a subgroup's wrapper needs no world-wide call.
        self.group = dist.new_group(ranks, backend="gloo", timeout=group_timeout(group),
                                    use_local_synchronization=True)
        self.world_size = len(ranks)
        self.capacity = 0  # payload values per message; every rank declares the same (wrappers are built alike)
        self.last: tuple[int, int] = (0, 0)  # (syncs, forwards) of the most recent message: what FINISHED reports

    def reserve(self, values: int) -> None:
        """Make room for payloads of ``values`` float64s (called by each wrapper at construction, on every rank)."""
        self.capacity = max(self.capacity, values)

    def exchange(self, phase: Phase, syncs: int, forwards: int, payload: torch.Tensor | None = None, *,
                 wrapper: str) -> list[torch.Tensor] | None:
        """Send this rank's header (and payload); returns every rank's payload (rank order), or raises
        ``RuntimeError`` on every rank when the headers differ."""
        self.last = (syncs, forwards)
        size = 0 if payload is None else payload.numel()
        if size > self.capacity:
            raise ValueError(f"a control payload of {size} values exceeds the {self.capacity} reserved")
        message = torch.zeros(4 + self.capacity, dtype=torch.float64)
        message[:4] = torch.tensor([int(phase), syncs, forwards, size], dtype=torch.float64)
        if payload is not None:
            message[4 : 4 + size] = payload.detach().reshape(-1).to("cpu", torch.float64)
        gathered = [torch.empty_like(message) for _ in range(self.world_size)]
        dist.all_gather(gathered, message, group=self.group)
        problem = out_of_step_message([[int(v) for v in m[:4].tolist()] for m in gathered], wrapper)
        if problem is not None:
            raise RuntimeError(problem)
        return None if payload is None else [m[4 : 4 + size] for m in gathered]


_channels: dict[Any, ControlChannel] = {}
_channels_world: list[Any] = [None]  # the default group the cached channels belong to


def control_channel(group: dist.ProcessGroup | None) -> ControlChannel:
    """The control channel of ``group`` (created on first use, a collective over its ranks; shared by every
    wrapper on that group)."""
    if _channels_world[0] is not dist.group.WORLD:  # a new process group: channels of an old one are gone
        _channels.clear()
        _channels_world[0] = dist.group.WORLD
    key = group if group is not None else dist.group.WORLD
    if key not in _channels:
        _channels[key] = ControlChannel(group)
    return _channels[key]


def drop_channels() -> None:
    """Forget the cached control channels, releasing their gloo groups. Left for the interpreter's final
    teardown, a channel's group is destroyed after parts of torch it needs, which aborts the process ("terminate
    called without an active exception") after a run that succeeded; ranks started by srun or torchrun exit
    that way (spawned ranks skip the teardown), so it runs at exit, before that teardown."""
    _channels.clear()
    _channels_world[0] = None


atexit.register(drop_channels)


def announce_finished() -> None:
    """Tell the peers on every control channel that this rank's training is over. Call it on every rank when
    the training function returns (``launch.spawn`` and ``runner.run_on_ranks`` do): a peer still training
    then fails at its next step with "uneven steps: rank 1 stopped after 2 steps, rank 0 is at step 3"
    instead of waiting for a collective that never comes. Ranks that stopped together pass silently. A no-op
    where no wrapper was built."""
    if not dist.is_initialized() or _channels_world[0] is not dist.group.WORLD:
        return
    for channel in list(_channels.values()):
        channel.exchange(Phase.FINISHED, *channel.last, wrapper="announce_finished")


# --------------------------------------------------------------------------------------------------
# The per-wrapper check
# --------------------------------------------------------------------------------------------------


class ReplicaCheck:
    """A wrapper's side of the control channel (see the module docstring): counts training forwards and
    finished gradient synchronisations and exchanges them at the end of every synchronisation, with which
    gradients were used and where a non-finite one appeared (:meth:`end_sync`); every ``every`` forwards
    also at the start of the forward (and of the synchronisation, with ``sync_start``), with exact float64
    sums of the parameters (and of ``named_buffers``: buffers the wrapper does not broadcast).

    Why the end of a synchronisation suffices on GPUs and not on gloo: a rank out of step (ahead by a step,
    or past its last step) must meet a control message before it blocks in a gradient collective with no
    partner. NCCL collectives never block the host, so the end-of-synchronisation message comes round every
    step; gloo's do (a buffer broadcast in the forward, the wait in the synchronisation), which is why
    ``"auto"`` checks at every step there. ``every=None`` leaves only the end-of-synchronisation message,
    which unused parameters depend on. Only forwards that build
    a graph (grad mode on) count, so a rank-local evaluation under ``torch.no_grad()`` stays possible;
    CUDA-graph capture sends nothing (its Python runs once, at capture).
    """

    #: Room for the values that :meth:`end_sync` compares for equality (``same``).
    SAME_VALUES = 4

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None,
                 every: int | None, *, wrapper: str, named_buffers: Sequence[tuple[str, torch.Tensor]] = (),
                 grad_names: Sequence[str] = (), sync_start: bool = False):
        self.labels = [f"parameter {name!r}" for name, _ in named_params] + \
            [f"buffer {name!r}" for name, _ in named_buffers]
        self.tensors = [p for _, p in named_params] + [b for _, b in named_buffers]
        self.first_buffer = len(named_params)
        self.grad_names = list(grad_names)
        self.group = group
        self.every = every
        self.wrapper = wrapper
        self.sync_start = sync_start
        self.channel = control_channel(group)
        self.channel.reserve(max(len(self.tensors), len(self.grad_names) + 1 + self.SAME_VALUES))
        self.finished_syncs = 0
        self.forwards = 0

    def _exchange(self, phase: Phase, payload: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        return self.channel.exchange(phase, self.finished_syncs, self.forwards, payload, wrapper=self.wrapper)

    def before_forward(self) -> None:
        """At the start of a training forward: positions (and, when due, parameter sums) are compared."""
        if not torch.is_grad_enabled() or capturing():
            return
        self.forwards += 1
        if self.every is None or self.forwards % self.every:
            return
        gathered = self._exchange(Phase.FORWARD, self._sums() if self.tensors else None)
        if gathered is not None:
            self._compare(gathered)

    def before_sync(self) -> None:
        """At the start of ``finish_gradient_synchronization()``, for strategies that communicate only there
        (naive, flat): a lagging rank would otherwise pair this step's all-reduces with its next forward's."""
        if self.sync_start and self.every is not None and (self.finished_syncs + 1) % self.every == 0 \
                and not capturing():
            self._exchange(Phase.SYNC_START)

    def end_sync(self, used: Sequence[bool], nonfinite: Sequence[int],
                 same: tuple[str, Sequence[int]] | None = None) -> list[bool] | None:
        """At the end of a synchronisation: ``used[i]`` says whether ``grad_names[i]`` received a gradient on
        this rank since the last synchronisation, ``nonfinite`` lists the indices whose local gradient held
        NaN/inf, ``same`` is ``(what, values)`` that must be equal on every rank (raises naming ``what``).
        Returns, per parameter, whether any rank used it (``None`` under CUDA-graph capture); raises on
        every rank if any rank saw a non-finite gradient."""
        if capturing():
            self.finished_syncs += 1
            self.channel.last = (self.finished_syncs, self.forwards)
            return None
        if len(used) != len(self.grad_names):
            raise ValueError(f"{len(used)} used flags for {len(self.grad_names)} gradients")
        what, values = same if same is not None else ("", ())
        if len(values) > self.SAME_VALUES:
            raise ValueError(f"at most {self.SAME_VALUES} values to compare, got {len(values)}")
        first = max(nonfinite, default=-1)  # nearest the loss (in module order): where backward met it first
        payload = torch.tensor([first, *values, *used], dtype=torch.float64)
        gathered = self._exchange(Phase.SYNC_END, payload)
        assert gathered is not None
        self.finished_syncs += 1
        self.channel.last = (self.finished_syncs, self.forwards)  # what a FINISHED message will report
        for rank, theirs in enumerate(gathered[1:], start=1):
            if not torch.equal(theirs[1 : 1 + len(values)], gathered[0][1 : 1 + len(values)]):
                raise RuntimeError(f"{self.wrapper}: in step {self.finished_syncs} {what} (rank 0: "
                                   f"{gathered[0][1:1 + len(values)].long().tolist()}, rank {rank}: "
                                   f"{theirs[1:1 + len(values)].long().tolist()})")
        reported = [(int(g[0]), rank) for rank, g in enumerate(gathered) if g[0] >= 0]
        if reported:
            index, rank = max(reported, key=lambda ir: (ir[0], -ir[1]))
            others = sorted(r for _, r in reported if r != rank)
            also = f"; also non-finite on rank(s) {', '.join(map(str, others))}" if others else ""
            raise FloatingPointError(
                f"{self.wrapper}: a non-finite gradient (NaN/inf) appeared first on rank {rank}, in parameter "
                f"{self.grad_names[index]!r}, in its own gradient of step {self.finished_syncs} before averaging{also}"
                " (averaging would have spread it to every rank)"
            )
        anywhere = torch.stack(gathered)[:, 1 + len(values):].amax(dim=0)
        return [bool(v) for v in anywhere]

    def _sums(self) -> torch.Tensor:
        return torch.stack([t.detach().sum(dtype=torch.float64) for t in self.tensors])

    @torch.no_grad()
    def verify(self) -> None:
        """Compare positions and parameter sums across ranks now (a collective on the control channel)."""
        if self.every is None or not self.tensors:
            self._exchange(Phase.FORWARD)
            return
        gathered = self._exchange(Phase.FORWARD, self._sums())
        assert gathered is not None
        self._compare(gathered)

    def _compare(self, per_rank: list[torch.Tensor]) -> None:
        bad = [(rank, i) for rank, sums in enumerate(per_rank) for i in (~torch.isfinite(sums)).nonzero().flatten().tolist()]
        if bad:  # NaN never equals NaN: name it as what it is, not as replicas that diverged
            rank, i = bad[0]
            where = sorted({r for r, _ in bad})
            raise FloatingPointError(
                f"{self.wrapper}: {self.labels[i]} holds NaN/inf on rank(s) {', '.join(map(str, where))} after "
                f"{self.finished_syncs} synchronizations ({len({j for _, j in bad})} tensor(s) in all); "
                "detect_nonfinite=True names where a gradient first went non-finite")
        for rank, theirs in enumerate(per_rank[1:], start=1):
            differs = (theirs != per_rank[0]).nonzero()
            if len(differs):
                i = int(differs[0])
                hint = "" if i < self.first_buffer else (
                    "; buffers that each rank updates from its own batch (BatchNorm statistics) drift apart unless "
                    "the wrapper broadcasts rank 0's (broadcast_buffers=True)")
                raise RuntimeError(
                    f"{self.wrapper}: replicas diverged: {self.labels[i]} differs between rank 0 (sum {float(per_rank[0][i])!r}) and rank {rank} "
                    f"(sum {float(theirs[i])!r}) after {self.finished_syncs} synchronizations; {len(differs)} "
                    f"tensor(s) differ on rank {rank}{hint}"
                )
