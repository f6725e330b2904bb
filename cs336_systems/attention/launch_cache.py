"""Repeat Triton launches without Triton's Python launch path.

``kernel[grid](*args, **constexprs)`` costs tens of microseconds of host time on every call: Triton binds
and specializes each argument (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), builds a
cache key, looks up the compiled kernel, and an autotuner first builds its own key and looks up its chosen
config. At short sequences our attention kernels run for less time than that. But a call whose
arguments agree with an earlier one in everything Triton specializes on (and in every integer) picks the
same compiled kernel and config, so :class:`LaunchCache` remembers, per such signature, the compiled
kernel and its constexpr values, and launches it directly through the compiled kernel's launcher
(``CompiledKernel.run``, the call Triton's own ``JITFunction.run`` ends with). The grid is not remembered:
it is the caller's, evaluated on every launch (with the remembered config where it is a function of it),
because a grid may depend on sizes that are no kernel argument. The attention kernels fold the batch into
the grid only; a remembered grid of another batch would run programs past the tensors' end.

The first call per signature goes through Triton unchanged (compiling and autotuning as needed). Nothing is
remembered when Triton returns no compiled kernel: under ``TRITON_INTERPRET=1``, or a launcher we do not
recognise (then every call takes Triton's path, as before). ``enabled=False`` (or :func:`disabled`) turns
the cache off, for A/B measurements of the host path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]

#: Triton's tensor-pointer specialization: whether the address is a multiple of 16 bytes.
_ALIGN = 16


def _signature(args: Sequence[Any]) -> tuple:
    """What Triton's specialization can depend on, per runtime argument: a tensor's dtype and 16-byte
    alignment, every integer's value (Triton specializes on ==1 and divisibility by 16), a float's type. One inline loop: this runs on every launch, so it must cost far
    less than the Triton path it replaces."""
    out = []
    for a in args:
        kind = type(a)
        if kind is int:
            out.append(a)
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % _ALIGN == 0))
        elif kind is float:
            out.append(float)
        elif kind is bool:
            out.append((bool, a))  # True == 1 as a key: keep the type apart
        elif isinstance(getattr(a, "base", None), torch.Tensor):  # a host-side TensorDescriptor
            base = a.base
            out.append((base.dtype, base.data_ptr() % _ALIGN == 0, tuple(a.shape), tuple(a.strides),
                        tuple(a.block_shape), repr(getattr(a, "layout", None))))
        else:
            out.append((kind, a))  # must be hashable and compare by value, or the call is not cached
    return tuple(out)


@functools.cache
def _triton_runtime() -> tuple[Any, Any]:
    """Triton's runtime knobs (launch hooks, read at every launch as Triton does) and driver config."""
    from triton import knobs
    from triton.runtime.driver import driver

    return knobs.runtime, driver


def _hook(hook: Any) -> Any:
    """``hook``, or None where it would do nothing: Triton 3.6 passes its hook chains to every launch, empty
    ones too, and the C launcher then calls into Python twice per launch for nothing."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (calls is not None and not calls) else hook


def launch_hooks() -> tuple[Any, Any]:
    """Triton's launch enter and exit hooks (a profiler's, such as proton's), None where none is set."""
    runtime = _triton_runtime()[0]
    return _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)


class LaunchCache:
    """Remembers, per launch signature, what Triton chose; see the module docstring.

    Bounded (least recently used entries are dropped beyond ``max_entries``): every distinct shape is an
    entry, and a long-running process may see many.
    """

    #: Tensors on other devices (CPU tensors under the interpreter) always take Triton's path.
    device_type = "cuda"

    def __init__(self, max_entries: int = 1024, enabled: bool = True) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.enabled = enabled
        self._entries: OrderedDict[tuple, tuple[Any, dict[str, Any], tuple, Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._records: list | None = None  # see recording()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[list]:
        """Inside the block, every launch appends ``(compiled kernel, 3-D grid, all arguments)`` to the list
        yielded, or None when it went through Triton's own path (a miss, the interpreter, the cache off):
        what :mod:`.launch_plan` builds a replay from."""
        previous, self._records = self._records, []
        try:
            yield self._records
        finally:
            self._records = previous

    def launch(self, fn: Any, grid: Grid, args: Sequence[Any], constexprs: dict[str, Any]) -> None:
        """``fn[grid](*args, **constexprs)`` on the current stream of the first tensor argument's device
        (which the caller makes the current device, as Triton launches there). ``fn`` is a
        ``JITFunction`` or an autotuner around one; ``args`` are its leading parameters in order and
        ``constexprs`` the rest by name (an autotuner's config supplies its own). Calls on CPU tensors
        (the interpreter) always take Triton's path."""
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        records = self._records
        if not self.enabled or device is None or device.type != self.device_type:  # interpreter: nothing to skip
            fn[grid](*args, **constexprs)
            if records is not None:
                records.append(None)
            return
        try:
            key = (id(fn), device.index, _signature(args), tuple(constexprs.items()))
            hash(key)
        except TypeError:  # an unhashable argument: never cached
            fn[grid](*args, **constexprs)
            if records is not None:
                records.append(None)
            return
        entry = self._entries.get(key)
        if entry is None:
            if records is not None:
                records.append(None)
            self.misses += 1
            kernel = fn[grid](*args, **constexprs)
            entry = self._remember(fn, args, constexprs, kernel)
            if entry is not None:
                self._entries[key] = entry
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            return
        self.hits += 1
        self._entries.move_to_end(key)
        kernel, meta, tail, pre_hook = entry
        gx, gy, gz = _grid3(grid(meta) if callable(grid) else grid)
        stream = self._stream(device)
        full = (*args, *tail)
        if pre_hook is not None:  # the config's hook, as Triton runs it before each launch (sizes descriptors)
            pre_hook(dict(zip(fn.arg_names, full)))  # an autotuner copies its function's names
        enter, leave = launch_hooks()
        metadata = kernel.launch_metadata((gx, gy, gz), stream, *full) if enter is not None else None
        kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *full)
        if records is not None:
            records.append((kernel, (gx, gy, gz), full))

    @staticmethod
    def _stream(device: torch.device) -> int:
        """The raw current stream of ``device``, as Triton's own launch path reads it."""
        return _triton_runtime()[1].active.get_current_stream(device.index)

    @staticmethod
    def _remember(fn: Any, args: Sequence[Any], constexprs: dict[str, Any], kernel: Any):
        """``(kernel, grid meta, constexpr tail, pre-hook)`` for replaying this launch, or None if it cannot be
        replayed. The grid meta is what a callable grid reads: the scalar arguments by name (tensors and
        descriptors are left out, so the cache keeps none alive) and the config. A config's ``pre_hook`` is
        kept and run before each replay with every argument by name, as Triton runs it before each launch."""
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            return None  # the interpreter, or a Triton whose launch path we do not know
        config = getattr(fn, "best_config", None)
        names = tuple(fn.arg_names)
        # Parameters the caller leaves at their defaults (an opt-in path's constexprs) are bound by Triton too.
        defaults = _defaults(fn)
        if defaults is None:
            return None
        meta = {**defaults, **constexprs, **(config.all_kwargs() if config is not None else {})}
        try:
            tail = tuple(meta[name] for name in names[len(args):])
        except KeyError:
            return None
        scalars = {name: a for name, a in zip(names, args) if isinstance(a, (int, float, bool))}
        return kernel, {**scalars, **meta}, tail, getattr(config, "pre_hook", None)


def _defaults(fn: Any) -> dict[str, Any] | None:
    """The default values of ``fn``'s parameters: an autotuner, ``JITFunction`` and the interpreter's function
    each wrap the next in ``.fn``, down to the Python function written; empty where there is none. None where a
    ``triton.heuristics`` wrapper is in the chain: it computes values at each launch that a replay would not."""
    while hasattr(fn, "fn"):
        if type(fn).__name__ == "Heuristics":
            return None
        fn = fn.fn
    if not inspect.isfunction(fn):
        return {}
    parameters = inspect.signature(fn).parameters
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    grid = tuple(grid)
    return (*grid, *(1,) * (3 - len(grid)))[:3]  # type: ignore[return-value]


#: The cache the attention kernels launch through.
FLASH_LAUNCHES = LaunchCache()


@contextlib.contextmanager
def switched_off(switch: Any) -> Iterator[None]:
    """``switch.enabled`` False inside this block, restored after: the A/B switch that the host path's caches
    (launches, plans, validated signatures) share."""
    previous, switch.enabled = switch.enabled, False
    try:
        yield
    finally:
        switch.enabled = previous


def disabled(cache: LaunchCache = FLASH_LAUNCHES) -> contextlib.AbstractContextManager[None]:
    """Every launch through ``cache`` takes Triton's own path inside this block (an A/B switch)."""
    return switched_off(cache)
