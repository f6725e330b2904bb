"""Autotuning of the FlashAttention-2 kernels: candidate tiles from :mod:`.options` become
``triton.Config`` lists, pruned to what fits the GPU's shared memory, and one autotuned launcher per phase
and option set (:func:`tuned`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import triton
import triton.testing

from .flash_bwd import (
    DKDV_DESCRIPTORS,
    DKDV_SMEM,
    DQ_DESCRIPTORS,
    DQ_SMEM,
    flash_backward_dkdv_kernel,
    flash_backward_dq_kernel,
)
from .flash_common import INTERPRETED
from .flash_fwd import FORWARD_DESCRIPTORS, FORWARD_SMEM, flash_forward_kernel
from .options import FlashOptions

# --------------------------------------------------------------------------------------------------
# Tile configurations. The interpreter gets one small config (tl.dot needs every side >= 16; numpy is
# fastest with few, small tiles and there is nothing to tune). On GPUs a short list per phase is
# autotuned once per shape class, so first-call tuning stays at a few seconds per class.
# --------------------------------------------------------------------------------------------------

def block_shape_hook(descriptors: dict[str, str]) -> Callable[..., None]:
    """A config ``pre_hook`` that sizes the launch's host-built tensor descriptors to the config's tile.

    ``descriptors`` maps each descriptor parameter to the tile side it streams along (``"BLOCK_M"`` or
    ``"BLOCK_N"``); that side is the last-but-one box dimension of a head's ``1 x 1 x rows x width`` box, and
    the last of the ``[L; D]`` row pair's ``1 x 2 x BLOCK_M`` box. Triton runs the hook before timing each
    candidate and before every launch of the chosen one (and ``LaunchCache`` before each replay), so the
    descriptors are built once per call with any box and sized here. Absent descriptors (``None``) are skipped.
    """

    def hook(nargs: dict[str, Any], reset_only: bool = False) -> None:
        for name, side in descriptors.items():
            desc = nargs.get(name)
            if desc is not None:
                shape = list(desc.block_shape)
                shape[-1 if len(shape) == 3 else -2] = nargs[side]
                desc.block_shape = shape

    return hook


#: Each phase's descriptor parameters (see :func:`block_shape_hook`).
_PHASE_DESCRIPTORS = {"forward": FORWARD_DESCRIPTORS, "dkdv": DKDV_DESCRIPTORS, "dq": DQ_DESCRIPTORS}


@functools.cache
def _hook(phase: str) -> Callable[..., None]:
    """One hook per phase: a config's hash includes its hook, so every config of a phase shares one."""
    return block_shape_hook(_PHASE_DESCRIPTORS[phase])


def _configs(phase: str, options: FlashOptions) -> list[triton.Config]:
    """``triton.Config`` per candidate tile of ``phase``; the first is the untuned default. ``POLY_EXP2`` is
    a meta-parameter of every config, so the launch never passes it."""
    if INTERPRETED:
        # One small config: tl.dot needs every side >= 16, numpy is fastest with few, small tiles.
        meta = {"BLOCK_M": 16, "BLOCK_N": 16, "POLY_EXP2": options.poly_for(phase, options.tiles(phase)[0])}
        return [triton.Config(meta, num_warps=1, num_stages=1, pre_hook=_hook(phase))]
    return [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "POLY_EXP2": options.poly_for(phase, t)},
                      num_warps=t.warps, num_stages=t.stages, maxnreg=t.maxnreg, pre_hook=_hook(phase))
        for t in options.tiles(phase)
    ]


#: Tuning key: the shape class. SEQ_CLASS is the longer sequence length rounded up to a power of two
#: (capped; see ``flash_triton._seq_class``); dtypes are added to the key by Triton itself.
AUTOTUNE_KEY = ["SEQ_CLASS", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]


#: Share of the per-block shared memory the operand buffers may take; the rest is left for the scratch
#: Triton allocates for layout conversions and reductions.
_SHARED_MEMORY_SHARE = 0.85


@functools.cache
def _shared_memory_bytes(device_index: int) -> int:
    """Opt-in shared memory per block: the limit Triton checks a compiled kernel against."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver without the query: ask PyTorch instead
        import torch

        props = torch.cuda.get_device_properties(device_index)
        for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
            if getattr(props, name, 0):
                return int(getattr(props, name))
        return 99 * 1024  # the smallest opt-in limit of current NVIDIA GPUs


def _fit_configs(resident_rows: Callable[[int, int], int], streamed_rows: Callable[[int, int, int], int],
                 min_block_m: int = 16, autotune: bool = True):
    """An ``early_config_prune`` for one kernel: drop tiles much longer than the sequences (work wasted
    on padding), and lower ``num_stages`` until the operand tiles fit in shared memory.

    ``resident_rows(BLOCK_M, BLOCK_N)`` rows of ``D_MAIN + D_TAIL`` elements stay loaded for the whole program;
    ``streamed_rows(BLOCK_M, BLOCK_N, layouts)`` more are buffered once per pipeline stage, where
    ``layouts`` is how many shared-memory copies a tile used both plain and transposed needs: 16-bit
    tiles are read transposed from one copy (``ldmatrix.trans``), 32-bit tiles get a second copy. (The dQ
    kernel at float32, head dim 128 measured 256 KiB with the second copy of K, against the 227 KiB limit.)
    float32 at head dim 128 is where the default stage counts would overflow (and fail to launch).
    Tiles with fewer than ``min_block_m`` rows along BLOCK_M are dropped (a kernel's hardware limit).
    Without tuning the first survivor runs.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**kwargs, **named_args}
        inputs = args["Q"] if "Q" in args else args["K"]  # the kernel's first input tensor (dK/dV has no Q pointer)
        row_bytes = (args["D_MAIN"] + args["D_TAIL"]) * inputs.element_size()  # both slabs of a row
        layouts = 2 if inputs.element_size() == 4 else 1
        budget = _SHARED_MEMORY_SHARE * _shared_memory_bytes(inputs.device.index or 0)
        longest = max(args.get("SEQ_CLASS", 1 << 30), 64)
        fitted: dict[tuple[int, ...], triton.Config] = {}
        for config in configs:
            m, n, maxnreg = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.maxnreg
            meta = tuple(sorted(config.kwargs.items()))
            if max(m, n) > longest or m < min_block_m:
                continue
            stages = config.num_stages
            while stages > 1 and row_bytes * (resident_rows(m, n) + stages * streamed_rows(m, n, layouts)) > budget:
                stages -= 1
            if row_bytes * (resident_rows(m, n) + stages * streamed_rows(m, n, layouts)) > budget:
                continue
            fitted.setdefault(
                (meta, config.num_warps, stages, maxnreg),
                triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=stages,
                              maxnreg=maxnreg, pre_hook=config.pre_hook),
            )
        if not fitted:  # nothing fits the estimate: try the smallest tiles, unpipelined
            allowed = [c for c in configs if c.kwargs["BLOCK_M"] >= min_block_m] or configs
            smallest = min(allowed, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
            return [triton.Config(dict(smallest.kwargs), num_warps=smallest.num_warps, num_stages=1,
                                  pre_hook=smallest.pre_hook)]
        survivors = list(fitted.values())
        return survivors if autotune else survivors[:1]

    return prune


def _autotune(configs: list[triton.Config], prune: Callable, reset_to_zero: list[str] | None = None):
    """``triton.autotune`` keyed on the shape class, with a shorter benchmark per config than Triton's
    (10 ms warm-up, 50 ms of timed runs instead of 25/100) where this Triton lets us pass one: at the
    leaderboard size 20 ms held only a handful of runs of the dK/dV kernel, too few to separate close
    candidates, and compilation, not timing, is most of the tuning time (docs/flash_attention/NOTES.md)."""
    kwargs: dict = dict(configs=configs, key=AUTOTUNE_KEY, prune_configs_by={"early_config_prune": prune},
                        reset_to_zero=reset_to_zero)
    if "do_bench" in inspect.signature(triton.autotune).parameters and not INTERPRETED:
        kwargs["do_bench"] = functools.partial(triton.testing.do_bench, warmup=10, rep=50)
    return triton.autotune(**kwargs)


# --------------------------------------------------------------------------------------------------
# Tuned launchers, one per phase and option set
# --------------------------------------------------------------------------------------------------

_PHASE_KERNELS = {
    "forward": (flash_forward_kernel, FORWARD_SMEM),
    "dkdv": (flash_backward_dkdv_kernel, DKDV_SMEM),
    "dq": (flash_backward_dq_kernel, DQ_SMEM),
}


def tuned(phase: str, options: FlashOptions) -> Any:
    """``phase``'s kernel wrapped in an autotuner over ``options``' candidate tiles, keyed on the shape
    class. Cached per option set: the compiled variants and tuning results of each set are kept, so
    switching options back and forth re-tunes nothing. ``host_entry`` picks no kernel: both of its values share
    one autotuner, so turning it on runs the very tiles tuned without it."""
    return _tuned(phase, options if options.host_entry else _with_host_entry(options))


@functools.cache
def _with_host_entry(options: FlashOptions) -> FlashOptions:
    return dataclasses.replace(options, host_entry=True)


@functools.cache
def _tuned(phase: str, options: FlashOptions) -> Any:
    kernel, (resident, streamed, min_block_m) = _PHASE_KERNELS[phase]
    prune = _fit_configs(resident, streamed, min_block_m, options.autotune)
    # dQ accumulated by dK/dV (options.dq_atomic) is added to, not written: every timed candidate would add its
    # own copy, so the tuner zeroes it before each and before the chosen config's real run
    reset = ["DQ_ACC"] if phase == "dkdv" and options.dq_atomic else None
    return _autotune(_configs(phase, options), prune, reset)(kernel)
