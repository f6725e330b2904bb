"""Whole calls replayed: the launches of one attention call, recorded once per call signature and then issued
straight through Triton's C launcher with the new call's tensors.

Why: on a slow host the Python around our kernels, not the kernels, decides the speed of a short-sequence
call. Measured on the H100 machine at (1, 16, 1024, 64), bf16, causal (docs/flash_attention/host_floor.md): a
forward + backward cost 864 µs of host time against cuDNN's 326, of which 512 µs was our Python with the
launches stubbed out and about 160 µs per launch went through :class:`~.launch_cache.LaunchCache` (argument
signature, grid, the config's pre-hook, Triton's launcher expanding each tensor descriptor in Python).

Everything that Python computes depends only on the call's *signature*: shapes, strides, dtypes, the
16-byte alignment of each tensor (what Triton specializes on), the flags and the options. So the first call
of a signature that finds every kernel already compiled and tuned (:class:`~.launch_cache.LaunchCache` hits)
is recorded: each launch's compiled kernel, grid and full argument list. :class:`LaunchPlan` turns that
into a template of the C launcher's arguments in which only the positions that hold the call's tensors, the
stream and the TMA descriptor maps change. A replay fills those in and calls the launcher; a descriptor's
map is encoded from the new base address with Triton's own ``make_tensordesc_arg`` (the address is the only
thing about it that changes), once per address.

A tensor argument that is none of the call's tensors may still be replayed when it is a *plan constant*
(:func:`plan_constant`): a tensor kept alive for good whose contents depend only on what the plan's key fixes
(the persistent forward's item table, planned once per shape); its address is baked into the template.

A recording yields no plan (and the call keeps the full path) when a launch was not a cache hit, when an
argument tensor is none of the call's declared tensors nor a plan constant (an alignment copy made inside the
call), when a kernel needs global or profile scratch, or when Triton's launcher is not laid out as this module expects
(another Triton version). Triton's launch hooks (a profiler such as proton) also send calls down the full
path, where they run. :func:`disabled` turns plans off, for A/B measurements; so does turning the launch cache
off (:func:`.launch_cache.disabled`), whose hits plans are recorded from.
"""

from __future__ import annotations

import contextlib
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from .launch_cache import FLASH_LAUNCHES, LaunchCache, launch_hooks, switched_off

#: What LaunchCache hands a recorder per launch: the compiled kernel, the 3-D grid and every argument
#: (runtime arguments, then constexprs), or None for a launch that went through Triton's own path.
Record = tuple[Any, tuple[int, int, int], tuple] | None


class _Replay:
    """One launch of a plan: the C launcher's argument list with holes for the call's tensors."""

    __slots__ = ("kernel", "launch", "template", "tensor_slots", "descriptor_slots")

    def __init__(self, kernel: Any, launch: Callable[..., Any], template: list, tensor_slots: tuple,
                 descriptor_slots: tuple) -> None:
        self.kernel = kernel  # the compiled kernel (what the C++ host entry exports the launch from)
        self.launch = launch
        self.template = template
        self.tensor_slots = tensor_slots  # (position, index of the call's tensor)
        # (position, index, stand-in descriptor, Triton's metadata, the maps encoded so far by address)
        self.descriptor_slots = descriptor_slots

    def __call__(self, stream: int, tensors: Sequence[Tensor], addresses: Sequence[int]) -> None:
        args = self.template.copy()
        args[3] = stream
        for pos, i in self.tensor_slots:
            args[pos] = addresses[i]  # an int: the launcher skips its per-pointer driver query
        for pos, i, desc, meta, maps in self.descriptor_slots:
            address = addresses[i]
            tensor_map = maps.get(address)
            if tensor_map is None:  # encoded once per address: the caching allocator hands out the same few
                desc.base = tensors[i]
                tensor_map = _descriptor_encoder()(desc, meta)[0]
                desc.base = None
                if len(maps) >= _MAPS_PER_SLOT:
                    maps.clear()
                maps[address] = tensor_map
            args[pos] = tensor_map
        self.launch(*args)


#: TMA maps remembered per descriptor slot, by base address. A map is a pure function of the address, the
#: slot's shape, strides and box (fixed by the plan's signature) and the dtype; it travels to the kernel by value.
_MAPS_PER_SLOT = 64


def _descriptor_encoder() -> Callable[[Any, Any], list]:
    """Triton's ``make_tensordesc_arg`` (looked up on each use, as Triton's own launcher does)."""
    from triton.backends.nvidia import driver

    return driver.make_tensordesc_arg


def _encode_descriptor(desc: Any, meta: Any) -> list:
    return _descriptor_encoder()(desc, meta)


def _base_args_len() -> int | None:
    try:
        from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN
    except ImportError:
        return None
    return _BASE_ARGS_FORMAT_LEN


def _role(t: Tensor, tensors: Sequence[Tensor]) -> int | None:
    return next((i for i, x in enumerate(tensors) if x is t), None)


#: Plan constants by ``id``: held here for the life of the process, so a baked-in address stays valid (also
#: inside a CUDA graph that captured a replay).
_CONSTANTS: dict[int, Tensor] = {}


def plan_constant(t: Tensor) -> Tensor:
    """Mark ``t`` as a tensor a plan may bake in by address, and keep it alive for good; returns ``t``. Only for
    tensors whose contents follow from the call signature that keys the plan (a per-shape table), never for
    data of the call."""
    _CONSTANTS[id(t)] = t
    return t


def _constant(t: Tensor) -> bool:
    return _CONSTANTS.get(id(t)) is t


def _c_launcher(launcher: Any, n_descriptors: int) -> Callable[..., Any] | None:
    """Triton's compiled C ``launch`` under its launcher object: the object's ``launch`` itself, or, where the
    kernel takes tensor descriptors, the C function that Triton's Python descriptor expansion wraps."""
    launch = getattr(launcher, "launch", None)
    if launch is None:
        return None
    if n_descriptors:
        code, cells = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if code is None or cells is None:
            return None
        launch = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("launcher")
    return launch if callable(launch) else None


def _replay(record: Record, tensors: Sequence[Tensor]) -> _Replay | None:
    """The replay of one recorded launch, or None when it cannot be replayed (see the module docstring)."""
    if record is None:
        return None
    kernel, (gx, gy, gz), full = record
    launcher = kernel.run
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    signature = list(getattr(getattr(kernel, "src", None), "signature", {}).values())
    if len(signature) != len(full) or _base_args_len() != 13:
        return None
    desc_positions = [i for i, s in enumerate(signature) if isinstance(s, str) and s.startswith("tensordesc")]
    metas = getattr(kernel.metadata, "tensordesc_meta", None) or [None] * len(desc_positions)
    launch = _c_launcher(launcher, len(desc_positions))
    if launch is None or len(metas) != len(desc_positions):
        return None
    # What Triton's CudaLauncher hands its C launcher: grid, stream, function, cooperative, PDL, global and
    # profile scratch, then (from CompiledKernel.run's caller) the packed metadata, launch metadata and the
    # two launch hooks, then every kernel argument with descriptors expanded.
    template: list = [gx, gy, gz, None, kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                      None, None, kernel.packed_metadata, None, None, None]
    tensor_slots, descriptor_slots = [], []
    meta_of = dict(zip(desc_positions, metas))
    for i, arg in enumerate(full):
        if i in meta_of:
            base = getattr(arg, "base", None)
            role = _role(base, tensors) if isinstance(base, Tensor) else None
            if role is None:
                return None
            stand_in = types.SimpleNamespace(base=base, shape=list(arg.shape), strides=list(arg.strides),
                                             padding=arg.padding)
            expanded = _encode_descriptor(stand_in, meta_of[i])
            if meta_of[i] is None:  # no TMA map: the base pointer travels as a plain tensor argument
                tensor_slots.append((len(template), role))
            else:
                descriptor_slots.append((len(template), role, stand_in, meta_of[i], {}))
            template.extend(expanded)
        elif isinstance(arg, Tensor):
            role = _role(arg, tensors)
            if role is None:
                if not _constant(arg):
                    return None
                template.append(arg.data_ptr())  # the same table for every call of this signature
                continue
            tensor_slots.append((len(template), role))
            template.append(None)
        else:
            template.append(arg)
    for pos, _ in tensor_slots:
        template[pos] = None  # the plan keeps no tensor alive
    for pos, *_ in descriptor_slots:
        template[pos] = None
    for _, _, stand_in, _, _ in descriptor_slots:
        stand_in.base = None
    return _Replay(kernel, launch, template, tuple(tensor_slots), tuple(descriptor_slots))


class LaunchPlan:
    """The launches of one call signature, replayed with a new call's tensors (see the module docstring)."""

    __slots__ = ("replays",)

    def __init__(self, replays: tuple[_Replay, ...]) -> None:
        self.replays = replays

    @classmethod
    def build(cls, records: Sequence[Record], tensors: Sequence[Tensor]) -> LaunchPlan | None:
        """A plan from one call's launch records, whose tensor arguments must all be among ``tensors`` (by
        identity; a replay takes its tensors in that order), or None if any launch cannot be replayed."""
        if not records:
            return None
        replays = tuple(_replay(r, tensors) for r in records)
        return None if any(r is None for r in replays) else cls(replays)  # type: ignore[arg-type]

    def run(self, tensors: Sequence[Tensor], stream: int, addresses: Sequence[int] | None = None) -> None:
        """Issue every launch on ``stream`` (a raw CUDA stream handle) with ``tensors`` in the recorded roles;
        ``addresses``: their ``data_ptr()``s, when the caller has read them already (each is read once per call,
        not once per launch that takes it)."""
        if addresses is None:
            addresses = [t.data_ptr() for t in tensors]
        for replay in self.replays:
            replay(stream, tensors, addresses)


class PlanCache:
    """Plans by call signature (least recently used dropped beyond ``max_entries``). A signature whose
    recording yielded no plan is remembered as such, so it is not recorded again."""

    def __init__(self, launches: LaunchCache, max_entries: int = 512, enabled: bool = True) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.launches = launches  # records the full path's launches; off, it turns plans off too
        self.max_entries = max_entries
        self.enabled = enabled
        self._plans: OrderedDict[Hashable, LaunchPlan | None] = OrderedDict()
        self.replays = 0

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
        self.replays = 0

    def lookup(self, key: Hashable) -> tuple[bool, LaunchPlan | None]:
        """``(known, plan)``: whether ``key`` was recorded before, and its plan (None: replay impossible)."""
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            return False, None
        self._plans.move_to_end(key)  # the least recently used go first
        return True, plan  # type: ignore[return-value]

    def store(self, key: Hashable, plan: LaunchPlan | None) -> None:
        self._plans[key] = plan
        if len(self._plans) > self.max_entries:
            self._plans.popitem(last=False)

    def run(self, key: Hashable, tensors: Sequence[Tensor], launch: Callable[[], None]) -> None:
        """Replay ``key``'s plan with ``tensors`` (every tensor the call's launches take, in a fixed order);
        without one, call ``launch`` (the full path) and, the first time a signature is seen while every
        kernel is ready, record it into a plan. ``key`` must determine everything but the tensors' addresses:
        shapes, strides, dtypes, device, flags and the options' generation. Which of the addresses are 16-byte
        aligned (what Triton specializes a pointer on, and what a descriptor's base needs) is added here."""
        if not self.replaying():
            launch()
            return
        addresses = [t.data_ptr() for t in tensors]
        key = (key, _alignment(addresses))
        known, plan = self.lookup(key)
        if plan is not None:
            self.replays += 1
            plan.run(tensors, self._stream(tensors[0].device), addresses)
            return
        if known:
            launch()
            return
        with self.launches.recording() as records:
            launch()
        if all(r is not None for r in records):  # a miss compiled or tuned: record the next call instead
            self.store(key, LaunchPlan.build(records, tensors))

    def replaying(self) -> bool:
        """Whether calls replay plans now: plans and the launch cache on, and no Triton launch hooks set."""
        return self.enabled and self.launches.enabled and not _launch_hooks_set()

    @staticmethod
    def _stream(device: torch.device) -> int:
        """The raw current stream of ``device``, as Triton's own launch path reads it."""
        return torch._C._cuda_getCurrentRawStream(device.index)


_MISSING = object()

#: Triton specializes a pointer argument on its divisibility by 16, and a tensor descriptor's base needs it.
ALIGN_BYTES = 16


def planned_key(key: Hashable, tensors: Sequence[Tensor]) -> tuple:
    """The key :meth:`PlanCache.run` stores a call's plan under, for ``key`` and the call's ``tensors``."""
    return key, _alignment([t.data_ptr() for t in tensors])


def _alignment(addresses: Sequence[int]) -> bool | tuple[bool, ...]:
    """True when every address is 16-byte aligned (the usual case, one test), else which ones are."""
    combined = 0
    for a in addresses:
        combined |= a
    return True if combined % ALIGN_BYTES == 0 else tuple(a % ALIGN_BYTES == 0 for a in addresses)


def _launch_hooks_set() -> bool:
    return launch_hooks() != (None, None)


#: The plans the attention calls replay.
FLASH_PLANS = PlanCache(FLASH_LAUNCHES)


def disabled(cache: PlanCache = FLASH_PLANS) -> contextlib.AbstractContextManager[None]:
    """Every call takes the full launch path inside this block (an A/B switch)."""
    return switched_off(cache)
