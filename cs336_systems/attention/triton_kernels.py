"""Triton kernels of FlashAttention-2, by role: :mod:`.flash_common` (exponentials, loop bounds, masks,
descriptors), :mod:`.flash_fwd` (forward), :mod:`.flash_bwd` (dQ, which also writes the ``[L; D]`` rows, and dK/dV) and
:mod:`.tuning` (candidate tiles to autotuned launchers), plus :mod:`.rope_qk` (the rotary embedding of packed
Q and K, for ``flash_qkvpacked``). This module gathers them for ``flash_triton``.

Layout: every tensor is addressed as ``(batch, heads, n, d)`` through its four strides (3-D inputs arrive
with a unit head dimension). The grid is one-dimensional, ``tiles along the sequence x batch * heads``,
in groups of heads whose streamed operands fit in L2 (see ``_tile_and_head`` and :mod:`.scheduling`).

Loads. Tiles that stay resident for a whole program use pointer arithmetic (no ``tl.make_block_ptr``,
which newer Triton removed). Tiles that stream past in a loop (K and V in the forward and dQ kernels; Q,
dO, L and D in dK/dV) come through tensor descriptors that ``flash_triton`` builds on the host, one per
tensor, and passes as kernel parameters (``TensorDescriptor``: TMA bulk copies on Hopper and later, plain
loads elsewhere); a config's pre-hook sizes their boxes to its tiles (``tuning.block_shape_hook``) and the
kernels read them with ``flash_common._tile``. Descriptors need a unit stride along the head dimension and
16-byte aligned heads and rows; ``flash_triton`` copies the rare input that is not. Both forms run on the
GPU nodes' Triton and under ``TRITON_INTERPRET=1`` on CPU tensors.

Causal structure. With top-left alignment query ``i`` sees key ``j`` iff ``j <= i``. Each loop over tiles is
split into an unmasked part (tiles every row of which sees every column) and a masked part (tiles that
straddle the diagonal, plus the ragged tile at the end of a sequence whose length is not a multiple of the
tile). Tiles entirely above the diagonal are never visited. The masked part is a separate instantiation of
the same inner loop (``MASKED`` is a compile-time flag), so the unmasked tiles pay for no masking at all.

Matmul precision (``DOT_PRECISION``) only matters for float32 inputs: ``tf32`` (tensor cores, ~1e-3
relative error) or ``tf32x3`` (three TF32 products, float32-level accuracy); ``flash_triton`` picks it from
``torch.get_float32_matmul_precision()`` like any PyTorch matmul.

Softmax arithmetic is in base 2: scores are scaled by ``log2(e) / √d`` and exponentiated with ``exp2``,
which maps to one hardware instruction; with 16-bit inputs the dK/dV kernel may use a polynomial on the
FMA pipe instead (:func:`_exp2_fma`): its candidate tiles come both ways and the autotuner picks
(:class:`~.options.Tile`, ``FlashOptions.poly_exp2``). ``L`` is stored in natural-log units, as the
interface requires.

This module is imported lazily (by ``flash_triton.py``, on first launch) because ``@triton.jit`` decides
at decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

from . import flash_bwd, flash_common, flash_fwd, rope_qk, tuning
from .flash_bwd import flash_backward_dkdv_kernel, flash_backward_dq_kernel
from .flash_common import INTERPRETED, LOG2_E, exp2_fma_kernel, program_order_kernel
from .flash_fwd import flash_forward_kernel
from .rope_qk import ROPE_BLOCK_P, ROPE_BLOCK_T, rope_qk_kernel
from .tuning import tuned

#: What the ``@triton.jit`` decorators were built for; ``flash_triton`` re-imports the kernel modules when
#: ``TRITON_INTERPRET`` changes (decoration decides between compiling and interpreting).
BUILD_MODE = INTERPRETED
#: The modules behind this one, in the order a re-import must follow (each imports the ones before it).
MODULES = (flash_common, flash_fwd, flash_bwd, tuning, rope_qk)

__all__ = [
    "INTERPRETED", "LOG2_E", "MODULES", "ROPE_BLOCK_P", "ROPE_BLOCK_T", "exp2_fma_kernel",
    "flash_backward_dkdv_kernel", "flash_backward_dq_kernel", "flash_bwd",
    "flash_common", "flash_forward_kernel", "flash_fwd", "program_order_kernel", "rope_qk", "rope_qk_kernel", "tuned", "tuning",
]  # fmt: skip
