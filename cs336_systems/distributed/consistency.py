"""Cross-rank checks that turn silent divergence into an error at the step it starts.

Data-parallel training is correct only while every rank runs the same model through the same sequence of
collectives. Two ways that breaks without any error of its own:

- **Different models at wrap time** (a rank built another width, or loaded another checkpoint). The first
  collective then has mismatched sizes, which gloo answers with an abort (``SIGABRT``, cause only in its
  stderr) and NCCL with a hang or garbage. :func:`check_same_parameters` compares names, shapes and
  dtypes with one small ``all_gather_object`` before any parameter is communicated.
- **Replica drift during training** (a rank skipped ``finish_gradient_synchronization()``, or changed its
  parameters by itself). :class:`ReplicaCheck` exchanges each rank's count of finished synchronisations
  at the start of a training forward and of each synchronisation, and a float64 sum of every parameter
  at the forward: 8-byte all-gathers plus one of 8 bytes per parameter, every ``every`` steps. With
  ``every=1`` (the default on gloo) a skipped synchronisation fails at the very next collective; with a
  longer interval the lagging rank's collectives can pair up wrongly before the check comes round,
  which then ends as a collective timeout or size error rather than silently.

Both raise on every rank with the same message, naming the first mismatch and the ranks involved.
"""

from __future__ import annotations

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


class ReplicaCheck:
    """Counts a wrapper's finished gradient synchronisations and, every ``every`` training forwards,
    verifies across ranks that the counts agree and that the parameters in ``named_params`` are
    bit-identical (their float64 sums are compared exactly: replicas that took the same averaged steps
    are equal to the bit).

    Only forwards that build a graph (grad mode on) count, so a rank-local evaluation under
    ``torch.no_grad()`` stays possible; CUDA-graph capture skips the check (it reads results on the host).
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None,
                 every: int | None, *, wrapper: str):
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.every = every
        self.wrapper = wrapper
        self.finished_syncs = 0
        self._forwards = 0

    def on_sync_finished(self) -> None:
        self.finished_syncs += 1

    def before_forward(self) -> None:
        """At the start of a training forward: counts (and, when due, parameters) are compared."""
        if self._skip():
            return
        self._forwards += 1
        if self._forwards % self.every == 0:
            self.verify(2 * self.finished_syncs)

    def before_sync(self) -> None:
        """At the start of ``finish_gradient_synchronization()``: strategies that communicate only there
        (naive, flat) would otherwise pair this step's all-reduces with a lagging rank's next forward."""
        if self._skip():
            return
        if (self.finished_syncs + 1) % self.every == 0:
            self.verify(2 * self.finished_syncs + 1, parameters=False)

    def _skip(self) -> bool:
        if self.every is None or not torch.is_grad_enabled():
            return True
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, tensor, group=self.group)
        return [t.cpu() for t in out]

    @staticmethod
    def _where(position: int) -> str:
        syncs, in_sync = divmod(position, 2)
        return f"{'in finish_gradient_synchronization()' if in_sync else 'at a forward'} after {syncs} finished"

    @torch.no_grad()
    def verify(self, position: int | None = None, parameters: bool = True) -> None:
        """Compare where each rank is (``position``: twice the finished synchronisations, plus one inside
        a synchronisation), then parameter checksums, across ranks (a collective)."""
        device = self._device()
        position = 2 * self.finished_syncs if position is None else position
        at = [int(t) for t in self._gather(torch.tensor([position], dtype=torch.int64, device=device))]
        if len(set(at)) > 1:
            behind = min(range(len(at)), key=at.__getitem__)
            ahead = max(range(len(at)), key=at.__getitem__)
            raise RuntimeError(
                f"{self.wrapper}: replicas out of step: rank {behind} is {self._where(at[behind])} gradient "
                f"synchronizations, rank {ahead} {self._where(at[ahead])}; a rank skipped "
                "finish_gradient_synchronization() after a backward"
            )
        counts = [a // 2 for a in at]
        if not parameters:
            return
        if not self.params:
            return
        sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in self.params]).to(device)
        per_rank = self._gather(sums)
        for rank, theirs in enumerate(per_rank[1:], start=1):
            differs = (theirs != per_rank[0]).nonzero()
            if len(differs):
                i = int(differs[0])
                raise RuntimeError(
                    f"{self.wrapper}: replicas diverged: parameter {self.names[i]!r} differs between rank 0 "
                    f"(sum {float(per_rank[0][i])!r}) and rank {rank} (sum {float(theirs[i])!r}) after "
                    f"{counts[0]} synchronizations; {len(differs)} parameter(s) differ on rank {rank}"
                )
