"""FlashAttention-2 with Triton kernels, as a ``torch.autograd.Function`` that also works under
``torch.compile``.

Layers, outside in:

- An eager call of a signature seen before goes through the C++ host entry (:mod:`.host_entry`, ``options.host_entry``,
  :func:`_host_entry_apply`), replaying the launch plans recorded below; every other call takes the Python layers.
- :class:`FlashAttentionTriton` validates inputs (the same ``ValueError``s as the PyTorch version), views
  3-D inputs as 4-D with one head, saves ``Q, K, V, O, L`` and maps gradients back.
- Two custom operators, ``cs336_systems::flash_attention_forward`` and ``…_backward``, launch the kernels.
  Registering them with ``torch.library.custom_op`` (plus a shape-only "fake" implementation) makes them
  opaque to ``torch.compile``: Dynamo and AOTAutograd trace the autograd function around them and call the
  operators as they are, whichever way the kernels were built (compiled for a GPU, or interpreted on CPU).
  Plain eager calls run the same launch code (``_forward``, ``_backward``) without the operators' Python
  dispatch, which costs more host time than the kernels take at short sequences (see :func:`_eager`).
- The kernels themselves live in :mod:`.triton_kernels`, imported on first launch (see :func:`_kernels`).
  On Hopper GPUs the forward of 16-bit inputs at head dims 64 and 128 runs the warp-specialized Gluon
  kernel of :mod:`.flash_fwd_sm90` instead, except for short rows (``options.gluon_min_key_work``), where
  the Triton forward is faster (same outputs; :func:`forward_kernel_name` says which one a call uses,
  ``options.use(gluon=False)`` turns it off). The backward runs the Triton dQ and dK/dV kernels, except on
  Hopper at long rows (``options.gluon_backward_min_keys``), where the Gluon kernel of :mod:`.flash_bwd_sm90`
  forms dK, dV and dQ in one pass (:func:`backward_kernel_name` says which; ``options.use(gluon_backward=False)``
  turns it off).
- Tiles, tuning, the exponential and the Gluon switch are :mod:`.options` values, read at each launch.

Devices: CUDA tensors; or CPU tensors when ``TRITON_INTERPRET=1`` is set, which runs the very same kernels
in Triton's numpy interpreter (slow; this is how the CPU test suite checks them). CPU tensors without the
interpreter raise a ``ValueError`` that points to ``flash_pytorch`` rather than silently falling back, so a
benchmark labelled "triton" always measures the Triton kernels.

float32 inputs follow ``torch.get_float32_matmul_precision()``, as PyTorch's own matmuls do: ``"highest"``
(PyTorch's default) uses 3xTF32 products on tensor cores, accurate to float32 round-off; ``"high"`` or
``"medium"`` uses single TF32 products (faster, ~1e-3 relative error). 16-bit inputs are unaffected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import options
from ._validation import validate_attention_inputs
from . import host_entry
from .launch_cache import FLASH_LAUNCHES
from .launch_plan import ALIGN_BYTES, FLASH_PLANS, planned_key
from .validated_calls import VALIDATED, ValidatedCalls, validated_calls_off  # noqa: F401 (re-exported)
from . import scheduling
from .scheduling import heads_per_l2_group

#: Head dimensions that run as a single slab (tl.dot needs >= 16; powers of two keep tiles aligned). Others up
#: to the largest run as two slabs, or one padded slab (:func:`head_dim_slabs`).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
#: Head dimensions the autograd function takes.
HEAD_DIMS = range(1, SUPPORTED_HEAD_DIMS[-1] + 1)


@functools.cache  # several calls per forward + backward, always the same few head dims
def head_dim_slabs(d: int) -> tuple[int, int]:
    """``(D_MAIN, D_TAIL)`` for head dim ``d``: the largest power of two in ``d`` and the smallest power of two
    (at least 16, the smallest side of ``tl.dot``) holding the rest, or one padded slab where two would not save
    work (``d`` = 24 runs as 32, 112 as 128). Plain Python, here rather than beside the kernels: importing this
    package must not import Triton (see :func:`_kernels`)."""
    if d < 1:
        raise ValueError(f"head dimension must be positive, got {d}")
    main = max(16, 1 << (d.bit_length() - 1))
    rest = d - main
    if rest <= 0:
        return main, 0
    tail = max(16, 1 << (rest - 1).bit_length())
    return (2 * main, 0) if tail >= main else (main, tail)


def stored_head_dim(d: int, element_size: int) -> int:
    """The head dim the kernels read for ``d``: ``d`` itself when its rows are whole 16-byte units (tensor
    descriptors need 16-byte row strides: any multiple of 8 in 16-bit), else ``d`` rounded up to one, with
    zero columns appended. Zeros add nothing to ``QKᵀ`` and give zero output columns."""
    if d < 1 or d > SUPPORTED_HEAD_DIMS[-1]:
        raise ValueError(f"{_IMPL_NAME}: head dimension {d} is not supported; supported: 1..{SUPPORTED_HEAD_DIMS[-1]}")
    unit = _TMA_ALIGN // element_size
    return -(-d // unit) * unit


_LOG2_E = 1.4426950408889634
_IMPL_NAME = "FlashAttention (Triton)"


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels then run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> ModuleType:
    """The kernel module, decorated in the mode ``TRITON_INTERPRET`` asks for now.

    ``@triton.jit`` chooses between compiling and interpreting when it decorates, so the module is
    imported on first use, not with this package, and re-imported if the variable changed since: a test
    module may set it after something else imported this package. Everything else about the kernels is
    an :mod:`.options` value read at each launch.
    """
    global _KERNELS
    module = _KERNELS
    if module is None or module.BUILD_MODE != interpreter_enabled():  # the import machinery only on a change
        module = importlib.import_module(".triton_kernels", __package__)
        if module.BUILD_MODE != interpreter_enabled():
            for part in module.MODULES:  # in dependency order, so each picks up the re-decorated kernels
                importlib.reload(part)
            module = importlib.reload(module)
        _KERNELS = module
    return module


_KERNELS: ModuleType | None = None


def _check_device(q: Tensor) -> None:
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(
        f"{_IMPL_NAME}: needs CUDA tensors (got {q.device}); CPU tensors run only under Triton's interpreter "
        "(set TRITON_INTERPRET=1 before the first call). On CPU use the 'flash_pytorch' implementation."
    )


#: Sequences at least this long share one autotuning class: the best tiles stop changing with length.
_LONGEST_SEQ_CLASS = 16384


def _seq_class(n_queries: int, n_keys: int) -> int:
    """Autotuning shape class: the longer sequence rounded up to a power of two, capped."""
    return min(1 << (max(n_queries, n_keys) - 1).bit_length(), _LONGEST_SEQ_CLASS)


def _unit_stride_d(t: Tensor) -> Tensor:
    """The kernels take any strides, but tiles load fast only when the head dimension is contiguous; a
    tensor without that (a transposed view, or the stride-0 gradient of ``o.sum()``) is copied once."""
    strides = t.stride()
    return t if (strides[-1] == 1 and 0 not in strides) else t.contiguous()


#: Tensor-descriptor (TMA) loads need 16-byte aligned base addresses and row strides (the alignment Triton also
#: specializes pointers on, which the launch plans key).
_TMA_ALIGN = ALIGN_BYTES


def _tma_ready(t: Tensor) -> Tensor:
    """``t`` itself if every head of it starts on a 16-byte boundary and its rows are 16-byte multiples
    (what the kernels' tensor descriptors require), else a contiguous copy in fresh memory (which
    is aligned for every supported head dim).

    Called inside each custom operator, not in the autograd function: it reads ``data_ptr()``, which
    the fake tensors of ``torch.compile`` tracing do not have. So a misaligned K or V (rare: a view at
    an odd offset) is copied once by the forward and once more by the backward."""
    size = t.element_size()
    aligned = t.data_ptr() % _TMA_ALIGN == 0 and all(s * size % _TMA_ALIGN == 0 for s in t.stride()[:-1])
    return t if aligned else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _row_buffer(rows: tuple[int, ...], n: int, device: torch.device) -> Tensor:
    """float32 ``(*rows, n)`` whose rows start on 16-byte boundaries (``n`` padded to a multiple of 4
    in memory), so that the dK/dV kernel can read the ``[L; D]`` row pairs through tensor descriptors."""
    padded = _cdiv(n, _TMA_ALIGN // 4) * (_TMA_ALIGN // 4)
    buffer = torch.empty(*rows, padded, dtype=torch.float32, device=device)  # sizes unpacked: parsed faster
    return buffer if padded == n else buffer[..., :n]


#: The streamed side of a descriptor box until a config's pre-hook sets it (``tuning.block_shape_hook``).
_UNSIZED = 16


def _descriptor(t: Tensor, box: list[int]) -> object:
    """A host-built tensor descriptor over all of ``t``, read in ``box``-shaped tiles; its streamed side starts
    as ``_UNSIZED`` and is set per config by the tuner's pre-hook (``tuning.block_shape_hook``). ``t`` must be
    :func:`_tma_ready`. Built on the host, the descriptor reaches the kernel as a parameter: the kernels no
    longer write one per program to global scratch (docs/flash_attention/host_descriptors.md)."""
    cls, direct = _descriptor_class()
    if not direct:
        return cls(t, list(t.shape), list(t.stride()), box)
    # Filled in directly: the constructor re-checks what _tma_ready guarantees (16-byte base and row strides,
    # unit last stride) and that the box is a power of two, which the pre-hook resets anyway. That cost about
    # 5 µs of host time per descriptor, seven per forward + backward (docs/flash_attention/host_overhead.md).
    desc = object.__new__(cls)
    desc.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=box, padding="zero")
    return desc


@functools.cache
def _descriptor_class() -> tuple[type, bool]:
    """Triton's ``TensorDescriptor``, and whether its fields are the five :func:`_descriptor` fills in itself
    (else it calls the constructor, so another Triton's descriptor stays correct)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # here: this module imports without Triton

    fields = tuple(f.name for f in dataclasses.fields(TensorDescriptor))
    return TensorDescriptor, fields == ("base", "shape", "strides", "block_shape", "padding")


def _head_tiles(t: Tensor, width: int) -> object:
    """:func:`_descriptor` of ``(batch, heads, n, d)`` tensor ``t`` in ``1 x 1 x rows x width`` boxes (the
    kernels' ``_tile``)."""
    return _descriptor(t, [1, 1, _UNSIZED, width])


def _slab_tiles(t: Tensor, d: int) -> tuple[object, object | None]:
    """:func:`_head_tiles` of the main slab and of the tail slab (None when the head dim has none)."""
    d_main, d_tail = head_dim_slabs(d)
    return _head_tiles(t, d_main), (_head_tiles(t, d_tail) if d_tail else None)


def _dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for these inputs (see the module docstring)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"  # TF32 for float32 at "high"/"medium"; ignored for 16-bit operands


def _device_guard(t: Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU, not on whichever one is current (nothing to switch when it is current).
    A CUDA tensor exists, so CUDA is initialized: the current device is read without going through
    ``torch.cuda.current_device``'s Python wrapper."""
    device = t.device
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device)
    return _NO_GUARD


_NO_GUARD = contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# Custom operators around the kernels (4-D tensors only)
# --------------------------------------------------------------------------------------------------


def _hopper_gluon(name: str, q: Tensor) -> tuple[ModuleType, tuple[int, int]] | None:
    """The Gluon module ``name`` and the GPU's compute capability where ``q`` lives on a Hopper GPU, else None.

    These device checks only keep CPU runs and other GPUs from importing Gluon; what a kernel takes (its
    options included) is decided in one place, the module's ``ineligibility``."""
    if q.device.type != "cuda" or interpreter_enabled():
        return None
    capability = _capability_of(q)
    if capability != (9, 0):
        return None
    return importlib.import_module(f".{name}", __package__), capability


def _gluon_forward_module(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> ModuleType | None:
    """:mod:`.flash_fwd_sm90` when its Hopper forward covers these 4-D inputs, else None (Triton forward)."""
    found = _hopper_gluon("flash_fwd_sm90", q)
    if found is None:
        return None
    module, capability = found
    return module if module.ineligibility(q, k, v, capability, is_causal) is None else None


def _gluon_backward_module(q: Tensor, k: Tensor, v: Tensor, do: Tensor, dk: Tensor, dv: Tensor) -> ModuleType | None:
    """:mod:`.flash_bwd_sm90` when its Hopper dK/dV kernel covers these 4-D tensors, else None (Triton's)."""
    found = _hopper_gluon("flash_bwd_sm90", q) if options.current().gluon_backward else None
    if found is None:
        return None
    module, capability = found
    return module if module.ineligibility(q, k, v, do, dk, dv, capability) is None else None


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _capability_of(t: Tensor) -> tuple[int, int]:
    """The compute capability of the GPU ``t`` lives on (the current one for an unindexed ``cuda`` device)."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def forward_kernel_name(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> str:
    """``"gluon"``, ``"gluon_persistent"`` (its persistent grid, ``options.gluon_persistent``) or ``"triton"``: which
    forward kernel ``FlashAttentionTriton`` runs for these inputs (3-D or 4-D, as passed to it)."""
    q, k, v = _as_launched(q, k, v)
    if _gluon_forward_module(q, k, v, is_causal) is None:
        return "triton"
    return "gluon_persistent" if options.current().persistent_forward(q.shape[-1]) else "gluon"


def backward_kernel_name(q: Tensor, k: Tensor, v: Tensor) -> str:
    """``"gluon"`` (the fused dK/dV/dQ kernel, or with ``options.dq_atomic=False`` the Gluon dK/dV kernel beside
    Triton's dQ), ``"gluon_persistent"`` (its persistent grid, ``options.gluon_persistent_backward``) or
    ``"triton"``: which backward ``FlashAttentionTriton`` runs for these inputs (as :func:`forward_kernel_name`)."""
    if _gluon_backward_module(*_as_launched(q, k, v) * 2) is None:  # dO, dK and dV laid out as Q, K and V
        return "triton"
    return "gluon_persistent" if options.current().gluon_persistent_backward else "gluon"


def _as_launched(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Inputs as given to ``FlashAttentionTriton`` (3-D or 4-D) as its launches see them: 4-D, unit stride along d."""
    return tuple(t if t.dim() == 4 else t.unsqueeze(1) for t in (_unit_stride_d(x) for x in tensors))


def _head_dim_constexprs(d: int) -> dict[str, int]:
    """The kernels' head-dim constexprs: the true ``HEAD_DIM`` and its slabs ``D_MAIN``, ``D_TAIL``."""
    d_main, d_tail = head_dim_slabs(d)
    return dict(HEAD_DIM=d, D_MAIN=d_main, D_TAIL=d_tail)


def _persistent(programs: int) -> dict[str, bool]:
    """The kernels' ``PERSISTENT`` argument for a grid of ``programs`` (0: one program per item, where the
    argument is left at its default so the launch is the one-program-per-item kernel's)."""
    return {"PERSISTENT": True} if programs else {}


def _forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
             signature: tuple | None = None) -> tuple[Tensor, Tensor]:
    """``(O, L)`` for ``(batch, heads, n, d)`` inputs, scores scaled by ``scale``; ``L`` is float32
    ``(batch, heads, n_queries)``. A call whose signature was seen before replays its recorded launches
    (:mod:`.launch_plan`); the first calls take the full path below (:func:`_launch_forward`).
    ``signature``: the autograd function's :func:`_input_signature` of these very tensors, when it has one.
    """
    batch, heads, n_queries, _ = q.shape
    o = torch.empty_like(q)  # the layout of q (a head view stays one)
    lse = torch.empty(batch, heads, n_queries, dtype=torch.float32, device=q.device)  # sizes unpacked: parsed faster
    launch = functools.partial(_launch_forward, q, k, v, o, lse, is_causal, scale)
    with _device_guard(q):  # on CPU (the interpreter) no plan is ever recorded: every call takes the full path
        FLASH_PLANS.run(_forward_key(q, k, v, is_causal, scale, signature), (q, k, v, o, lse), launch)
    return o, lse


def _forward_key(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                 signature: tuple | None = None) -> tuple:
    """The forward's launch-plan key: everything its launches depend on but the addresses (which the plan cache
    adds the alignment of). An :func:`_input_signature` of these tensors already holds their shapes, strides,
    dtypes, devices and the mask (and the scale follows from the head dim), so it stands in for them."""
    if signature is None:
        signature = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device.index, is_causal,
                     scale)
    return ("forward", signature, options.generation(), _dot_precision(q.dtype))


def _launch_forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool, scale: float) -> None:
    """Launch the forward writing ``o`` (laid out as ``empty_like(q)``) and ``lse`` (contiguous float32)."""
    gluon = _gluon_forward_module(q, k, v, is_causal)
    if gluon is not None:
        gluon.flash_forward(q, k, v, is_causal, scale, out=(o, lse))
        return
    kernels = _kernels()
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    k, v = _tma_ready(k), _tma_ready(v)

    programs = scheduling.persistent_programs(q.device)

    def grid(meta: dict) -> tuple[int]:
        return scheduling.grid(_cdiv(n_queries, meta["BLOCK_M"]) * batch * heads, programs)

    (k_main, k_tail), (v_main, v_tail) = _slab_tiles(k, d), _slab_tiles(v, d)
    group = heads_per_l2_group(batch * heads, 2 * n_keys * d * k.element_size(), q.device)
    FLASH_LAUNCHES.launch(kernels.tuned("forward", options.current()), grid, (
        q, k_main, v_main, k_tail, v_tail, o, lse,
        *q.stride(), *o.stride(), *lse.stride(),
        heads, group, n_queries, n_keys, _LOG2_E * scale, _seq_class(n_queries, n_keys),
    ), dict(_head_dim_constexprs(d), IS_CAUSAL=is_causal, DOT_PRECISION=_dot_precision(q.dtype),
            **_persistent(programs)))  # fmt: skip


@torch.library.custom_op("cs336_systems::flash_attention_forward", mutates_args=())
def flash_attention_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool,
                            scale: float) -> tuple[Tensor, Tensor]:
    """The forward as a custom operator: what ``torch.compile`` and other tracers see."""
    return _forward(q, k, v, is_causal, scale)


@flash_attention_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool, scale: float,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)``: dQ over query tiles (which also computes D), then dK/dV over key tiles (no atomics).
    ``out``: tensors of Q's, K's and V's shapes (any strides) to write the gradients into, such as head views
    of one packed buffer (:mod:`.flash_qkvpacked`); by default they are new tensors in the inputs' layouts.
    Replays recorded launches as :func:`_forward` does."""
    batch, heads, n_queries, d = q.shape
    ld = _row_buffer((batch * heads, 2), n_queries, q.device)  # [L · log2(e); D] per head
    dq, dk, dv = out if out is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    key = _backward_key(do, q, k, v, o, lse, is_causal, scale, out)
    gluon, dq_rows = _backward_route(key, q, k, v, do, dk, dv)
    # float32 dQ that the dK/dV kernel adds to (options.dq_atomic); the dQ kernel, which runs first, zeroes it
    dq_acc = None if dq_rows is None else torch.empty((batch, heads, dq_rows, d), dtype=torch.float32, device=q.device)
    launch = functools.partial(_launch_backward, do, q, k, v, o, lse, ld, dq, dk, dv, dq_acc, is_causal, scale, gluon)
    with _device_guard(q):
        FLASH_PLANS.run(key, (do, q, k, v, o, lse, ld, dq, dk, dv, *([] if dq_acc is None else [dq_acc])), launch)
    return dq, dk, dv


#: :func:`_backward_route` per backward key and alignment (deciding costs more than a launch), bounded as plans are.
_BACKWARD_ROUTES: dict[tuple, tuple[ModuleType | None, int | None]] = {}
_MAX_BACKWARD_ROUTES = 512


def _backward_route(key: tuple, q: Tensor, k: Tensor, v: Tensor, do: Tensor, dk: Tensor,
                    dv: Tensor) -> tuple[ModuleType | None, int | None]:
    """``(gluon, dq_rows)``: the Gluon dK/dV module where it runs these tensors, else None (Triton's kernel), and the
    rows per head of the float32 dQ sums where the dK/dV kernel forms dQ (``options.fuses_dq``), else None. Decided
    once per backward key (shapes, strides, dtype, device, options) and 16-byte alignment of the tensors, all that
    the Gluon kernel's eligibility reads, on the tensors as passed: a misaligned one goes to the Triton kernels,
    never to Gluon on an aligned copy whose sums were sized for Triton's."""
    memo = _route_memo(key, q, k, v, do, dk, dv)
    route = _BACKWARD_ROUTES.get(memo)
    if route is not None:
        return route
    opts = options.current()
    gluon = _gluon_backward_module(q, k, v, do, dk, dv)
    rows = None
    if opts.fuses_dq(gluon is not None):
        rows = q.shape[2] if gluon is None else gluon.dq_rows(q.shape[2], q.shape[3])  # whole tiles for its adds
    if len(_BACKWARD_ROUTES) >= _MAX_BACKWARD_ROUTES:
        _BACKWARD_ROUTES.clear()
    route = _BACKWARD_ROUTES[memo] = (gluon, rows)
    return route


def _route_memo(key: tuple, *tensors: Tensor) -> tuple:  # the key and Q, K, V, dO, dK, dV's 16-byte alignment
    return (key, *(t.data_ptr() % 16 == 0 for t in tensors))


def _backward_key(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool,
                  scale: float, out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple:
    """The backward's launch-plan key, from the tensors it launches with. Not from the forward's signature: saved
    tensors can come back in other layouts than they were saved in (``save_on_cpu`` and other saved-tensor
    hooks copy them), and a plan bakes in every stride."""
    return ("backward", q.shape, q.stride(), k.shape, k.stride(), v.stride(), o.stride(), lse.stride(),
            do.stride(), q.dtype, q.device.index, is_causal, scale, options.generation(), _dot_precision(q.dtype),
            None if out is None else (out[0].stride(), out[1].stride(), out[2].stride()))


def _launch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, ld: Tensor, dq: Tensor,
                     dk: Tensor, dv: Tensor, dq_acc: Tensor | None, is_causal: bool, scale: float,
                     gluon: ModuleType | None) -> None:
    """Launch the backward kernels: dQ, which also fills ``ld`` (:func:`_row_buffer`'s
    ``(batch * heads, 2, n_queries)``) with the ``[L; D]`` row pairs, then dK/dV, which reads them: the Gluon
    dK/dV kernel ``gluon`` where :func:`_backward_route` chose it, else Triton's. With ``dq_acc`` the
    first kernel writes the rows only, dK/dV, Triton's or Gluon's, adds dQ's products to ``dq_acc``
    (``options.dq_atomic``; by default where the Gluon kernel runs), and a third kernel scales them into dQ."""
    kernels = _kernels()
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    shape_args = (n_queries, n_keys, scale * _LOG2_E, scale, _seq_class(n_queries, n_keys))
    # dK/dV streams Q, dO and the [L; D] pair of a head; dQ streams its K and V.
    dkdv_group = heads_per_l2_group(batch * heads, n_queries * (2 * d * q.element_size() + 8), q.device)
    dq_group = heads_per_l2_group(batch * heads, 2 * n_keys * d * k.element_size(), q.device)
    precision = _dot_precision(q.dtype)
    opts = options.current()

    programs = scheduling.persistent_programs(q.device)
    constexprs = dict(_head_dim_constexprs(d), IS_CAUSAL=is_causal, DOT_PRECISION=precision,
                      **_persistent(programs))

    def key_tiles(meta: dict) -> tuple[int]:
        return scheduling.grid(_cdiv(n_keys, meta["BLOCK_N"]) * batch * heads, programs)

    def query_tiles(meta: dict) -> tuple[int]:
        return scheduling.grid(_cdiv(n_queries, meta["BLOCK_M"]) * batch * heads, programs)

    # Descriptors per launch: dK/dV streams Q and dO along BLOCK_M, dQ streams K and V along BLOCK_N (each
    # config's pre-hook sizes its own), and the [L; D] row pairs as one 1 x 2 x BLOCK_M box per query tile.
    q_tiles, do_tiles = _slab_tiles(q, d), _slab_tiles(do, d)
    (k_main, k_tail), (v_main, v_tail) = _slab_tiles(k, d), _slab_tiles(v, d)
    ld_tiles = _descriptor(ld, [1, 2, _UNSIZED])
    # dQ first: it writes the [L; D] rows that dK/dV reads (same stream, so in order). Where dK/dV forms dQ, this
    # kernel writes the rows only, and zeros into the float32 sums in place of dQ.
    dq_out = dq if dq_acc is None else dq_acc
    FLASH_LAUNCHES.launch(kernels.tuned("dq", opts), query_tiles, (
        q, k_main, v_main, k_tail, v_tail, do, o, lse, ld, dq_out,
        *q.stride(), *do.stride(), *o.stride(), *lse.stride(), *ld.stride()[:2], *dq_out.stride(), heads, dq_group,
        *shape_args,
    ), constexprs if dq_acc is None else dict(constexprs, LD_ONLY=True))  # fmt: skip
    if gluon is not None:
        gluon.flash_backward_dkdv(q, k, v, do, ld, dk, dv, is_causal, scale, dq_acc)
    else:
        FLASH_LAUNCHES.launch(kernels.tuned("dkdv", opts), key_tiles, (
            k, v, q_tiles[0], do_tiles[0], q_tiles[1], do_tiles[1], ld_tiles, dk, dv, dq_acc,
            *k.stride(), *v.stride(), *dk.stride(), *dv.stride(), heads, dkdv_group, *shape_args,
        ), constexprs)  # fmt: skip
    if dq_acc is not None:  # dQ = scale · the sums, once every dK/dV program has added its share (same stream)
        block_d = 1 << (d - 1).bit_length()  # the head dim's power of two
        rows = kernels.flash_bwd.DQ_CONVERT_ELEMENTS // block_d
        FLASH_LAUNCHES.launch(kernels.flash_bwd.flash_backward_dq_convert_kernel, (
            batch * heads, _cdiv(n_queries, rows)), (
            dq_acc, dq, *dq_acc.stride()[:3], *dq.stride(), heads, n_queries, scale,
        ), dict(HEAD_DIM=d, BLOCK_N=rows, BLOCK_D=block_d))  # fmt: skip


@torch.library.custom_op("cs336_systems::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward as a custom operator: what ``torch.compile`` and other tracers see."""
    return _backward(do, q, k, v, o, lse, is_causal, scale)


@flash_attention_backward.register_fake
def _(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_backward(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.scale = is_causal, scale


def _operator_backward(ctx, do: Tensor, _dlse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None, None]:
    q, k, v, o, lse = ctx.saved_tensors
    return (*flash_attention_backward(_unit_stride_d(do), q, k, v, o, lse, ctx.is_causal, ctx.scale), None, None)


# The forward operator's own autograd, for :func:`flash_attention` under torch.compile (see there).
flash_attention_forward.register_autograd(_operator_backward, setup_context=_setup_backward)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _eager(t: Tensor) -> bool:
    """Whether a call may run the kernels directly instead of through the custom operators.

    A custom operator's Python path (dispatcher, aliasing check, Dynamo guard) costs several hundred
    microseconds of host time per call, more than the kernels take at short sequences. Plain eager calls
    skip it; anything that traces (``torch.compile``, a fake or functional tensor, a dispatch mode such as
    ``make_fx``'s) still sees the operators, whose kernels cannot be traced into."""
    return type(t) is Tensor and not torch.compiler.is_compiling() and _current_dispatch_mode() is None


# --------------------------------------------------------------------------------------------------
# The autograd function
# --------------------------------------------------------------------------------------------------


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 on Triton kernels: ``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``.

    Accepts ``(batch, n, d)`` or ``(batch, heads, n, d)``, float32/float16/bfloat16, any head dimension up to
    128, any lengths and strides; saves ``Q, K, V, O, L``. A head dimension that is not a power of two (80 for
    the 2.7B / 2026-xl models, 96, …) runs as two slabs, 80 as 64 + 16, so it costs its own work and needs
    no padded copies (:func:`head_dim_slabs`). Only a ``d`` whose rows are not whole 16-byte
    units (odd sizes) is copied with zero columns appended (:func:`stored_head_dim`); scores keep the
    ``1/sqrt(d)`` of the true ``d`` either way.
    """

    @classmethod
    def apply(cls, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:  # type: ignore[override]
        """``Function.apply``, through the C++ host entry for eager calls (``options.host_entry``), whose autograd node
        exposes no saved tensors: inspect them with ``options.use(host_entry=False)``."""
        if torch.compiler.is_dynamo_compiling():  # Dynamo tracing this very method (``torch.compile(Fn.apply)``)
            return cls.apply(q, k, v, is_causal)  # not a recursion: Dynamo handles a Function's ``apply`` by name
        if torch.compiler.is_compiling():  # another tracer (non-strict export): the Python path, as ever
            return super().apply(q, k, v, is_causal)
        if (options.current().host_entry and _eager(q) and q.is_cuda and type(k) is Tensor and type(v) is Tensor
                and type(is_causal) is bool and FLASH_PLANS.replaying()
                and not torch._C._are_functorch_transforms_active()):  # functorch's wrappers have no strides
            return _host_entry_apply(super().apply, q, k, v, is_causal)
        return super().apply(q, k, v, is_causal)

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False
    ) -> Tensor:
        signature = VALIDATED.lookup(q, k, v, is_causal) if _eager(q) else None
        if signature is None:
            shape = validate_attention_inputs(q, k, v, is_causal, head_dims=HEAD_DIMS,
                                              implementation=_IMPL_NAME)
            _check_device(q)
            d = q.shape[-1]
            stored = stored_head_dim(d, q.element_size())
            as_is = (shape.has_heads and stored == d and _eager(q)
                     and all(_unit_stride_d(t) is t for t in (q, k, v)))
            if as_is:  # the next call of this signature skips the checks above; this one keys its plan alike
                signature = VALIDATED.add(q, k, v, is_causal)
        else:  # checked before (:class:`ValidatedCalls`): launch the tensors as they are
            _check_device(q)  # not a function of the signature on CPU (TRITON_INTERPRET)
            as_is = True
        if as_is:
            d = q.shape[-1]
            scale = 1.0 / math.sqrt(d)
            o, lse = _forward(q, k, v, is_causal, scale, signature)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.is_causal, ctx.scale, ctx.head_dim = is_causal, scale, d
            return o
        q, k, v = (_unit_stride_d(t) if stored == d else F.pad(t, (0, stored - d)) for t in (q, k, v))
        scale = 1.0 / math.sqrt(d)
        forward = _forward if _eager(q) else flash_attention_forward
        if shape.has_heads:
            o, lse = forward(q, k, v, is_causal, scale)
        else:
            o, lse = forward(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal, scale)
            o, lse = o.squeeze(1), lse.squeeze(1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale, ctx.head_dim = is_causal, scale, d
        return o if stored == d else o[..., :d].contiguous()

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        d, stored = ctx.head_dim, q.shape[-1]
        do = _unit_stride_d(do) if stored == d else F.pad(do, (0, stored - d))
        backward = _backward if _eager(do) else flash_attention_backward
        if q.dim() == 4:
            grads = backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale)
        else:
            grads = backward(*(t.unsqueeze(1) for t in (do, q, k, v, o, lse)), ctx.is_causal, ctx.scale)
            grads = tuple(g.squeeze(1) for g in grads)
        if stored != d:
            grads = tuple(g[..., :d] for g in grads)
        return (*grads, None)


def _host_entry_apply(apply, q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:  # noqa: ANN001
    """The C++ host entry's forward (:mod:`.host_entry`) where it holds this signature's plan; else ``apply`` (the
    Python path), after which a plan that path recorded for these very tensors is handed to the entry."""
    entry = _host_entry()
    if entry is None:
        return apply(q, k, v, is_causal)
    generation = options.generation()
    o = entry.forward(q, k, v, is_causal, generation)
    if o is not None:
        return o if o is not False else apply(q, k, v, is_causal)  # False: known, and no plan to replay
    o = apply(q, k, v, is_causal)
    signature = VALIDATED.lookup(q, k, v, is_causal)  # None unless launched as they are (4-D, no copies)
    if signature is not None and q.dtype != torch.float32:  # float32's key also holds the matmul precision
        key = _forward_key(q, k, v, is_causal, 1.0 / math.sqrt(q.shape[-1]), signature)
        known, plan = FLASH_PLANS.lookup(planned_key(key, (q, k, v, o, o)))  # L: fresh, aligned as O is
        if known:
            host_entry.export(entry, host_entry.FORWARD, (q, k, v), is_causal, generation, plan)
    return o


def _host_entry_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool,
                         scale: float, generation: int) -> tuple[Tensor, Tensor, Tensor]:
    """A host-entry backward without a plan: the Python path's, its plan handed over if under the forward's options."""
    dq, dk, dv = _backward(do, q, k, v, o, lse, is_causal, scale)
    entry = _host_entry()
    if entry is not None and generation == options.generation():
        key = _backward_key(do, q, k, v, o, lse, is_causal, scale)
        route = _BACKWARD_ROUTES.get(_route_memo(key, q, k, v, do, dk, dv))
        if route is not None:  # [L; D] and the dQ sums are fresh allocations, aligned as dQ is
            tensors = (do, q, k, v, o, lse, dq, dq, dk, dv, *([] if route[1] is None else [dq]))
            known, plan = FLASH_PLANS.lookup(planned_key(key, tensors))
            if known:
                host_entry.export(entry, host_entry.BACKWARD, tensors[:6], is_causal, generation, plan, route[1])
    return dq, dk, dv


@functools.cache
def _host_entry() -> ModuleType | None:
    """The compiled host entry with its backward's Python fall-back set; None where it is unavailable."""
    entry = host_entry.module()
    if entry is not None:
        entry.set_backward_miss(_host_entry_backward)
    return entry


def flash_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
    """``FlashAttentionTriton.apply(q, k, v, is_causal)``, the model's entry (``attention_impl="flash_triton"``).

    Under ``torch.compile``, 4-D inputs whose head dim needs no padding call the forward operator instead,
    whose backward is registered on it (``register_autograd``). Dynamo traces an ``autograd.Function``'s
    backward with contiguous gradients, so inside a compiled step dO reached our backward head-major and the
    graph copied it there first (a copy per layer); the operator's backward gets dO in the layout
    the step produced it in (token-major, from the output projection). Same kernels, same numbers."""
    d = q.shape[-1]
    if (torch.compiler.is_compiling() and q.dim() == 4 and 1 <= d <= SUPPORTED_HEAD_DIMS[-1]
            and stored_head_dim(d, q.element_size()) == d):
        validate_attention_inputs(q, k, v, is_causal, head_dims=HEAD_DIMS, implementation=_IMPL_NAME)
        _check_device(q)
        q, k, v = (_unit_stride_d(t) for t in (q, k, v))
        return flash_attention_forward(q, k, v, is_causal, 1.0 / math.sqrt(d))[0]
    return FlashAttentionTriton.apply(q, k, v, is_causal)


#: The entry points benchmarks call directly, beside the custom operators above that tracers see: the eager
#: launch paths (what an eager call runs, replayed plans included) and the kernel module as decorated now.
eager_forward = _forward
eager_backward = _backward
kernel_module = _kernels
