"""Optimizer-state sharding (the idea of ZeRO stage 1, Rajbhandari et al., 2020, on top of plain DDP).

With data parallelism every rank holds the same parameters and, after gradient synchronisation, the same
gradients, so every rank would compute the *same* optimizer update — and keep the same optimizer state
(two fp32 moments for AdamW: twice the parameter memory). :class:`ShardedOptimizer` removes that
redundancy: each parameter is *owned* by one rank, only the owner keeps its optimizer state and
computes its update, and after the local step every owner broadcasts its freshly updated parameters so
all replicas agree again.

Design:

- **Wraps any optimizer class.** Each rank builds one ``optimizer_cls`` instance (the *inner* optimizer)
  over the parameters it owns, with one inner parameter group per outer group, so per-group
  hyperparameters (and LR schedulers that edit ``param_groups``) keep working: outer hyperparameters are
  copied into the inner groups before every step.
- **Balanced ownership.** Parameters are assigned greedily, largest first, to the rank that currently
  owns the fewest bytes (the classic LPT heuristic: within 4/3 of the optimal makespan). The assignment
  is a pure function of the parameter sizes and their order, so all ranks compute it identically
  without communicating; ``add_param_group`` (during construction or mid-training) extends it.
- **Parameter synchronisation.** After the local step each rank's owned parameters travel in flat
  buckets (at most ``broadcast_bucket_mb`` MiB, one dtype/device each) broadcast from their owner.
- **Checkpoints.** :meth:`shard_state_dict` is a rank's own slice (no communication);
  :meth:`consolidate_state_dict` gathers every slice onto one rank, after which :meth:`state_dict` there
  returns the whole-model state in the *unsharded* layout (global parameter indices), loadable by the
  plain optimizer class too. :meth:`load_state_dict` accepts a consolidated dict, the list of all shard
  dicts, or this rank's own shard, and works across world sizes: each rank picks the entries it owns
  under the current assignment, so training continues bit for bit.

Compared with ZeRO-1 proper: ZeRO-1 reduce-scatters gradients (each rank receives only the averaged
gradient of its own partition) and all-gathers the updated parameters — ``2Ψ`` of traffic per step, the
same as DDP's all-reduce — and partitions one flat buffer into exactly equal slices. Here gradients are
all-reduced by ordinary DDP (``2Ψ``, every rank keeps full gradients) and parameters are then broadcast
(``Ψ``): ``3Ψ`` in total, with tensor-granular, approximately balanced shards. ``accounting.py`` has
both models.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed.grad_sync import bucket_size_mb_value

MIB = 2**20

StateDict = dict[str, Any]


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world_size); a single process without ``torch.distributed`` counts as world size 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def greedy_balanced_assignment(sizes: Iterable[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank for each item: largest item first, to the currently least-loaded rank (lowest rank on
    ties). ``loads`` (bytes already owned per rank) is updated in place, so successive calls — one per
    parameter group — keep balancing the running totals."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sizes = list(sizes)
    if loads is None:
        loads = [0] * world_size
    elif len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for world size {world_size}")
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class ShardedOptimizer(torch.optim.Optimizer):
    """Keeps optimizer state for ``1/world_size`` of the parameters on each rank (see module docstring).

    Use it exactly like the optimizer it wraps, after gradients have been averaged across ranks (DDP)::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        loss.backward(); ddp.finish_gradient_synchronization()
        opt.step(); opt.zero_grad()

    ``step`` is a collective: every rank of ``group`` must call it. A ``closure`` is evaluated once, here,
    before the local step (re-evaluating it inside the inner optimizer would need every rank to agree on
    how often it runs).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup | None = None,
        broadcast_bucket_mb: float = 64.0,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise ValueError("cannot shard a ShardedOptimizer")
        broadcast_bucket_mb = bucket_size_mb_value(broadcast_bucket_mb, "broadcast_bucket_mb", allow_none=False)
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self.process_group = group
        self.rank, self.world_size = _world(group)
        self.broadcast_bucket_bytes = int(broadcast_bucket_mb * MIB)
        self.inner: torch.optim.Optimizer | None = None
        self._owner: dict[torch.Tensor, int] = {}
        self._owned_bytes = [0] * self.world_size
        self._buckets: list[tuple[int, list[torch.Tensor]]] | None = None
        self._consolidated: StateDict | None = None
        self.steps_taken = 0  # stamped into shard dicts: shards of different steps must not be merged
        super().__init__(params, defaults=dict(optimizer_kwargs))
        assert self.inner is not None
        self.state = self.inner.state  # ``opt.state[p]`` shows this rank's state, as for a plain optimizer

    # ---------------------------------------------------------------------------------------------
    # Ownership
    # ---------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also mid-training): its parameters are assigned to ranks on top of the bytes each
        rank already owns, and this rank's share becomes a new group of the inner optimizer with the same
        hyperparameters. Existing ownership never moves, so no optimizer state has to migrate."""
        super().add_param_group(param_group)  # validation, defaults, duplicate check
        group = self.param_groups[-1]
        params: list[torch.Tensor] = group["params"]
        owners = greedy_balanced_assignment((_tensor_bytes(p) for p in params), self.world_size, self._owned_bytes)
        for p, owner in zip(params, owners):
            self._owner[p] = owner
        local = [p for p, owner in zip(params, owners) if owner == self.rank]
        hyper = {k: v for k, v in group.items() if k != "params"}
        if self.inner is None:
            self.inner = self.optimizer_cls([{"params": local, **hyper}], **self.optimizer_kwargs)
        else:
            self.inner.add_param_group({"params": local, **hyper})
        for k, v in self.inner.param_groups[-1].items():  # adopt the wrapped class's own defaults
            if k != "params":
                group.setdefault(k, v)
        self._buckets = None

    def owner(self, param: torch.Tensor) -> int:
        """The rank that keeps ``param``'s optimizer state and computes its update."""
        try:
            return self._owner[param]
        except KeyError:
            raise ValueError("tensor is not a parameter of this optimizer") from None

    def owned_parameters(self, rank: int | None = None) -> list[torch.Tensor]:
        rank = self.rank if rank is None else rank
        return [p for g in self.param_groups for p in g["params"] if self._owner[p] == rank]

    def owned_bytes(self) -> list[int]:
        """Parameter bytes owned by each rank (the balance the assignment achieved)."""
        return list(self._owned_bytes)

    # ---------------------------------------------------------------------------------------------
    # Step
    # ---------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Update the owned parameters with the inner optimizer, then broadcast every rank's updated
        parameters from their owners. Extra keyword arguments go to the inner ``step``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self.inner is not None
        self._consolidated = None
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        self.inner.step(**kwargs)
        self._broadcast_parameters()
        self.steps_taken += 1
        return loss

    def _broadcast_buckets(self) -> list[tuple[int, list[torch.Tensor]]]:
        """(owner, parameters) buckets: per owner, in parameter order, split by dtype/device and size."""
        if self._buckets is None:
            buckets: list[tuple[int, list[torch.Tensor]]] = []
            for owner in range(self.world_size):
                open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
                for p in self.owned_parameters(owner):
                    key = (p.dtype, p.device)
                    members, nbytes = open_buckets.get(key, ([], 0))
                    if members and nbytes + _tensor_bytes(p) > self.broadcast_bucket_bytes:
                        buckets.append((owner, members))
                        members, nbytes = [], 0
                    open_buckets[key] = (members + [p], nbytes + _tensor_bytes(p))
                buckets.extend((owner, members) for members, _ in open_buckets.values() if members)
            self._buckets = buckets
        return self._buckets

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        if self.world_size == 1:
            return
        in_flight: collections.deque = collections.deque()
        for owner, params in self._broadcast_buckets():
            src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
            if len(params) == 1:
                flat = params[0].data
            elif owner == self.rank:
                flat = torch.cat([p.data.reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            work = dist.broadcast(flat, src=src, group=self.process_group, async_op=True)
            in_flight.append((owner, params, flat, work))
            if len(in_flight) > 2:  # bound the extra memory to a few buckets
                self._finish_broadcast(*in_flight.popleft())
        while in_flight:
            self._finish_broadcast(*in_flight.popleft())

    def _finish_broadcast(self, owner: int, params: list[torch.Tensor], flat: torch.Tensor, work: Any) -> None:
        work.wait()
        if owner == self.rank or len(params) == 1:
            return
        offset = 0
        for p in params:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # ---------------------------------------------------------------------------------------------
    # Checkpoints
    # ---------------------------------------------------------------------------------------------

    def _global_indices(self) -> list[list[int]]:
        """Per group, the global (unsharded ``state_dict``) index of each parameter."""
        out, start = [], 0
        for g in self.param_groups:
            out.append(list(range(start, start + len(g["params"]))))
            start += len(g["params"])
        return out

    def _owners_by_index(self) -> list[int]:
        return [self._owner[p] for g in self.param_groups for p in g["params"]]

    def shard_state_dict(self) -> StateDict:
        """This rank's optimizer state under global parameter indices, plus all hyperparameters and the
        ownership map. No communication; save one per rank for a sharded checkpoint."""
        assert self.inner is not None
        inner_sd = self.inner.state_dict()
        local_to_global = [
            gidx
            for g, indices in zip(self.param_groups, self._global_indices())
            for p, gidx in zip(g["params"], indices)
            if self._owner[p] == self.rank
        ]
        groups = []
        for g, indices in zip(self.param_groups, self._global_indices()):
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": indices})
        return {
            "state": {local_to_global[i]: s for i, s in inner_sd["state"].items()},
            "param_groups": groups,
            "sharding": {"rank": self.rank, "world_size": self.world_size, "owners": self._owners_by_index(),
                         "steps_taken": self.steps_taken},
        }

    @staticmethod
    def merge_shard_state_dicts(shards: list[StateDict]) -> StateDict:
        """Combine the shard dicts of *all* ranks of one run into a consolidated (unsharded-layout) dict."""
        if not shards:
            raise ValueError("no shard state dicts given")
        world_size = shards[0]["sharding"]["world_size"]
        ranks = sorted(s["sharding"]["rank"] for s in shards)
        if ranks != list(range(world_size)):
            raise ValueError(f"need one shard per rank 0..{world_size - 1}, got ranks {ranks}")
        owners = shards[0]["sharding"]["owners"]
        steps = {s["sharding"]["rank"]: s["sharding"].get("steps_taken") for s in shards}
        if len(set(steps.values())) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in sorted(steps.items()))
            raise ValueError(f"the shard state dicts were saved after different numbers of steps ({listed}): "
                             "shards of one checkpoint come from one step")
        state: dict[int, Any] = {}
        for shard in shards:
            if shard["sharding"]["owners"] != owners or len(shard["param_groups"]) != len(shards[0]["param_groups"]):
                raise ValueError("shard state dicts come from different runs (ownership or groups differ)")
            rank = shard["sharding"]["rank"]
            for idx, s in shard["state"].items():
                if owners[idx] != rank:
                    raise ValueError(f"rank {rank}'s shard holds state for parameter {idx}, owned by rank {owners[idx]}")
                state[idx] = s
        return {"state": dict(sorted(state.items())), "param_groups": shards[0]["param_groups"]}

    def consolidate_state_dict(self, to: int = 0) -> StateDict | None:
        """Collective: gather every rank's shard (state moved to CPU) onto rank ``to``, which returns the
        consolidated dict and also serves it from :meth:`state_dict` until the next step."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to must be a rank in [0, {self.world_size}), got {to}")
        shard = _to_cpu(self.shard_state_dict())
        if self.world_size == 1:
            self._consolidated = self.merge_shard_state_dicts([shard])
            return self._consolidated
        gathered: list[StateDict] | None = [None] * self.world_size if self.rank == to else None  # type: ignore[list-item]
        dst = dist.get_global_rank(self.process_group, to) if self.process_group is not None else to
        dist.gather_object(shard, gathered, dst=dst, group=self.process_group)
        self._consolidated = self.merge_shard_state_dicts(gathered) if gathered is not None else None
        return self._consolidated

    def state_dict(self) -> StateDict:
        """The consolidated whole-model state, in the layout of the unsharded optimizer.

        Available on the rank that called :meth:`consolidate_state_dict` (or always with one rank);
        elsewhere this raises, because silently returning a shard would make a truncated checkpoint.
        """
        if self._consolidated is None and self.world_size == 1:
            return self.merge_shard_state_dicts([self.shard_state_dict()])
        if self._consolidated is None:
            raise RuntimeError(
                "the optimizer state is sharded: call consolidate_state_dict(to=r) on every rank and then "
                "state_dict() on rank r, or save shard_state_dict() on every rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: StateDict | list[StateDict]) -> None:
        """Load a consolidated dict (from :meth:`state_dict`, or from the plain optimizer class), the list
        of all ranks' :meth:`shard_state_dict`, or this rank's own shard from a run with the same world
        size. The saved world size may differ from the current one.

        Before anything is changed, the dict's structure, the number of parameters per group and the
        shape and dtype of every saved state tensor are checked against this optimizer's parameters; the
        first mismatch raises a ``ValueError`` naming it (a checkpoint of another model fails here, not
        inside the next ``step()``)."""
        first = state_dict[0] if isinstance(state_dict, list) and state_dict else state_dict
        steps_taken = first.get("sharding", {}).get("steps_taken", 0) if isinstance(first, dict) else 0
        if isinstance(state_dict, list):
            if not state_dict or not all(isinstance(s, dict) for s in state_dict):
                raise ValueError("expected a list of shard state dicts (one per rank), got "
                                 f"{type(state_dict).__name__} of {sorted({type(s).__name__ for s in state_dict})}")
            state_dict = self.merge_shard_state_dicts(state_dict)
        elif not isinstance(state_dict, dict):
            raise ValueError(f"expected an optimizer state dict, got {type(state_dict).__name__}")
        elif "sharding" in state_dict:
            sharding = state_dict["sharding"]
            same_layout = (
                sharding["world_size"] == self.world_size
                and sharding["rank"] == self.rank
                and sharding["owners"] == self._owners_by_index()
            )
            if sharding["world_size"] == 1:
                state_dict = self.merge_shard_state_dicts([state_dict])
            elif not same_layout:
                raise ValueError(
                    f"a single shard (rank {sharding['rank']} of {sharding['world_size']}) only resumes the same "
                    f"rank with the same ownership; pass the list of all shards to load into a different layout"
                )
        self._validate_loadable(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        inner_state: dict[int, Any] = {}
        inner_groups = []
        next_inner = 0
        for g, sg in zip(self.param_groups, saved_groups):
            hyper = {k: v for k, v in sg.items() if k != "params"}
            g.update(hyper)
            ids = []
            for p, gidx in zip(g["params"], sg["params"]):
                if self._owner[p] != self.rank:
                    continue
                if gidx in saved_state:
                    inner_state[next_inner] = saved_state[gidx]
                ids.append(next_inner)
                next_inner += 1
            inner_groups.append({**hyper, "params": ids})
        assert self.inner is not None
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self.inner.state
        self._consolidated = None
        self.steps_taken = steps_taken

    def _validate_loadable(self, state_dict: StateDict) -> None:
        """Raise ``ValueError`` at the first way ``state_dict`` (consolidated) does not fit this optimizer."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            keys = list(state_dict)[:3] if isinstance(state_dict, dict) else []
            hint = (" — it looks like a model's state_dict (keys such as " + ", ".join(map(repr, keys)) +
                    "); pass optimizer.state_dict()") if keys and all(isinstance(k, str) for k in keys) else ""
            raise ValueError(f"not an optimizer state dict: 'state' and 'param_groups' are missing{hint}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} parameter groups, optimizer has {len(self.param_groups)}")
        owner_of: dict[Any, tuple[int, int, torch.Tensor]] = {}
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"group {i}: state dict has {len(sg['params'])} parameters, optimizer has {len(g['params'])}")
            for j, (p, gidx) in enumerate(zip(g["params"], sg["params"])):
                owner_of[gidx] = (i, j, p)
        for gidx, entry in state_dict["state"].items():
            if gidx not in owner_of:
                raise ValueError(f"state dict has state for parameter index {gidx!r}, which no parameter group lists")
            i, j, p = owner_of[gidx]
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # scalars such as the step count
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"group {i}, parameter {j}: saved {key!r} has shape {tuple(value.shape)} but the "
                                     f"parameter has shape {tuple(p.shape)} (a checkpoint of another model?)")
                if value.is_floating_point() and value.dtype != p.dtype:
                    raise ValueError(f"group {i}, parameter {j}: saved {key!r} is {value.dtype} but the parameter is "
                                     f"{p.dtype}")

    def __repr__(self) -> str:
        mib = [round(b / MIB, 2) for b in self._owned_bytes]
        return (
            f"ShardedOptimizer({self.optimizer_cls.__name__}, rank {self.rank}/{self.world_size}, "
            f"{len(self.param_groups)} group(s), owned MiB per rank {mib})"
        )
