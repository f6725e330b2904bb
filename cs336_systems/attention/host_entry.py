"""The C++ host entry: an eager attention call whose launch plans are known runs without Python between the
caller and the GPU.

Why: with launch plans (:mod:`.launch_plan`) an eager forward + backward still costs about twice the host time
of SDPA's cuDNN backend at short sequences (docs/flash_attention/host_floor.md): the autograd function's
Python, the plan key, the output allocations and one call of Triton's C launcher per kernel, which parses some
forty Python arguments. SDPA does the same kinds of work in C++. ``host_entry.cpp`` does ours in C++ too: it
keys the call from its tensors, allocates the outputs, fills a plan's holes (tensor addresses, TMA maps encoded
once per address) and calls ``cuLaunchKernelEx``; its autograd node runs the backward the same way.

Python still records every plan, on the call that :class:`~.launch_plan.PlanCache` records it: this module
only translates a recorded :class:`~.launch_plan.LaunchPlan` into the byte layout Triton 3.6's C launcher
builds (:func:`launch_records`) and hands it over (:func:`export`). A signature without a plan here takes the
Python path: the forward returns None to its caller, the backward calls back into Python. The policy (which
calls, which keys, the Python fall-back) is :mod:`.flash_triton`'s; ``options.host_entry`` (on by default)
switches it.

The extension is compiled on first use with the machine's C++ compiler against the installed torch and the
CUDA headers Triton ships, and cached under torch's extension build root; :func:`module` is None (with one
warning) where that fails, and calls then take the Python path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .launch_plan import LaunchPlan

SOURCE = Path(__file__).with_name("host_entry.cpp")
NAME = "cs336_host_entry"
#: Key kinds, as host_entry.cpp numbers them.
FORWARD, BACKWARD = 0, 1
#: The base arguments before a kernel's own in what Triton's C launcher takes (launch_plan's template).
_BASE_ARGS = 13


# --------------------------------------------------------------------------------------------------
# Building and loading
# --------------------------------------------------------------------------------------------------


def _cuda_headers() -> Path | None:
    """The CUDA headers Triton ships (``cuda.h``, ``cuda_runtime_api.h``), which the extension compiles against."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    include = Path(nvidia.__file__).parent / "include"
    return include if (include / "cuda.h").exists() else None


def _compile_command(output: Path, compiler: str, headers: Path) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    return [
        compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", str(SOURCE), "-o", str(output),
        f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
        f"-I{headers}", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
        "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl",
    ]  # fmt: skip


def _fingerprint(command: list[str], headers: Path) -> str:
    """What the compiled module depends on: its source, the compile command (compiler, flags, include and library
    paths), the CUDA header it includes, torch's version and the Python it is built for."""
    parts = (SOURCE.read_bytes(), "\0".join(command).encode(), (headers / "cuda.h").read_bytes(),
             torch.__version__.encode(), sys.version.encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(build_root: Path | None = None, compiler: str | None = None) -> Path:
    """The compiled extension's path, compiling it first where no build of this source, torch and Python exists
    (about a minute). Raises ``RuntimeError`` with the compiler's message where it cannot be built."""
    from torch.utils import cpp_extension

    compiler = compiler or os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
    headers = _cuda_headers()
    if headers is None:
        raise RuntimeError("Triton's CUDA headers (triton/backends/nvidia/include/cuda.h) are missing")
    name = f"{NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    fingerprint = _fingerprint(_compile_command(Path(name), compiler, headers), headers)
    root = Path(build_root or cpp_extension.get_default_build_root()) / f"{NAME}_{fingerprint}"
    output = root / name
    if output.exists():
        return output
    root.mkdir(parents=True, exist_ok=True)
    print(f"compiling the C++ host entry of FlashAttentionTriton into {root} (once; about half a minute)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=root) as scratch:  # built aside, then renamed: concurrent builds race safely
        partial = Path(scratch) / output.name
        done = subprocess.run(_compile_command(partial, compiler, headers), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(partial, output)
    return output


def load(path: Path) -> ModuleType:
    """Import the compiled extension at ``path``."""
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def module() -> ModuleType | None:
    """The compiled host entry, built on first use; None, with one warning saying why, where it cannot be."""
    try:
        return load(build())
    except (RuntimeError, OSError, ImportError) as e:
        warnings.warn(f"the C++ host entry is unavailable, calls take the Python path: {e}", stacklevel=2)
        return None


# --------------------------------------------------------------------------------------------------
# Plans in the C launcher's layout
# --------------------------------------------------------------------------------------------------

#: struct formats of the scalar parameter types (Triton's ``ty_to_cpp``, floats in their storage type).
_SCALAR = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H", "u32": "I",
           "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
#: A ``CUtensorMap``'s size and alignment.
_MAP_BYTES = 128


def expanded_types(signature: Sequence[Any], metas: Sequence[Any] | None) -> list[str] | None:
    """The kernel's parameter types as Triton's C launcher takes them: each tensor descriptor expanded into a TMA
    map (``nvTmaDesc``) where it has metadata, else into its base pointer, shape and strides (``i64``) and a
    padding flag, in both cases followed by its shape (``i32``) and strides (``i64``). None for a signature this
    module does not lay out (tuples)."""
    metas = list(metas or [])
    out: list[str] = []
    n_desc = 0
    for ty in signature:
        if not isinstance(ty, str):
            return None
        match = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty)
        if match is None:
            out.append(ty)
            continue
        meta = metas[n_desc] if n_desc < len(metas) else None
        n_desc += 1
        rank = match.group(2).count(",") + 1
        out += ["nvTmaDesc"] if meta is not None else ["*" + match.group(1), *["i64"] * (2 * rank), "i1"]
        out += ["i32"] * rank + ["i64"] * rank
    return out


def _pack(ty: str, value: Any) -> bytes:
    if ty.startswith("*"):
        return struct.pack("<Q", 0 if value is None else value)
    if ty == "bf16":  # the top half of the float32, as Triton's pack_bf16
        return struct.pack("<H", struct.unpack("<I", struct.pack("<f", value))[0] >> 16)
    return struct.pack("<" + _SCALAR[ty], value)


def _map_hole(offset: int, role: int, stand_in: Any, meta: dict) -> tuple:
    """What ``cuTensorMapEncodeTiled`` takes for a descriptor, innermost dimension first, as Triton's
    ``fill_tma_descriptor`` derives it from the descriptor and its metadata (all but the base address)."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    shape = list(stand_in.shape)
    if meta.get("fp4_padded"):
        shape[-1] *= 2
    elem = meta["elem_size"]
    strides = [elem * s for s in stand_in.strides[:-1]][::-1]
    fill = 1 if stand_in.padding == "nan" else 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA, else NONE
    return (offset, role, TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], shape[::-1], strides,
            list(meta["block_size"])[::-1], meta["swizzle"], fill)


def launch_records(plan: LaunchPlan) -> list[tuple] | None:
    """``plan``'s launches as host_entry.cpp takes them (see ``add_plan`` there): per launch the function, grid,
    block, shared memory, launch attributes, the parameter bytes, each parameter's offset in them, and the holes
    for the call's pointers and TMA maps. None where a launch is laid out otherwise than this module knows."""
    records = []
    for replay in plan.replays:
        kernel, template = replay.kernel, replay.template
        md = kernel.metadata
        if getattr(md, "num_ctas", 1) != 1:
            return None
        types = expanded_types(list(kernel.src.signature.values()), getattr(md, "tensordesc_meta", None))
        values = template[_BASE_ARGS:]
        if types is None or len(types) != len(values):
            return None
        pointer_at = dict(replay.tensor_slots)
        map_at = {pos: (role, stand_in, meta) for pos, role, stand_in, meta, _ in replay.descriptor_slots}
        data, offsets, pointers, maps = bytearray(), [], [], []
        for pos, (ty, value) in enumerate(zip(types, values), start=_BASE_ARGS):
            if ty == "constexpr":
                continue
            if ty == "nvTmaDesc":
                if pos not in map_at:
                    return None
                data += bytes(-len(data) % _MAP_BYTES)
                maps.append(_map_hole(len(data), *map_at[pos]))
                offsets.append(len(data))
                data += bytes(_MAP_BYTES)
                continue
            try:
                packed = _pack(ty, None if pos in pointer_at else value)
            except (KeyError, struct.error, TypeError, OverflowError):
                return None
            data += bytes(-len(data) % len(packed))
            if pos in pointer_at:
                pointers.append((len(data), pointer_at[pos]))
            offsets.append(len(data))
            data += packed
        for _ in range(2):  # global and profile scratch: plans exist only for kernels that need neither
            data += bytes(-len(data) % 8)
            offsets.append(len(data))
            data += bytes(8)
        grid = tuple(template[:3])
        records.append((int(kernel.function), grid, 32 * md.num_warps, md.shared, bool(template[5]),
                        bool(template[6]), bytes(data), offsets, pointers, maps))
    return records


def export(entry: ModuleType, kind: int, key_tensors: Sequence[Tensor], is_causal: bool, generation: int,
           plan: LaunchPlan | None, dq_rows: int | None = None) -> bool:
    """Hand ``plan`` (None: the Python path's recording yielded none) to ``entry`` under the key of
    ``key_tensors``: (q, k, v) for a forward, (dO, q, k, v, O, L) for a backward, whose ``dq_rows`` are the rows
    per head of its float32 dQ sums (None where it has none). Returns whether a plan was handed over."""
    records = None if plan is None else launch_records(plan)
    entry.add_plan(kind, list(key_tensors), is_causal, generation, -1 if dq_rows is None else dq_rows, records)
    return records is not None
