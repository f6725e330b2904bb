"""Input signatures that passed :class:`~.flash_triton.FlashAttentionTriton`'s checks: a call of a known
signature skips them (see :class:`ValidatedCalls`)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from torch import Tensor

from .launch_cache import switched_off


def _input_signature(q: Tensor, k: Tensor, v: Tensor, is_causal: object) -> tuple:
    """What the input checks and layout decisions look at: shapes, strides, dtypes, devices and the mask flag
    (with its type, so that ``1`` does not pass for ``True``). The tensors' own types are checked apart
    (:meth:`ValidatedCalls.lookup`), as is the device (``flash_triton._check_device``)."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, type(is_causal), is_causal)


class ValidatedCalls:
    """Input signatures that passed :func:`validate_attention_inputs` and need no reshaping: 4-D, a head dim
    stored as it is, each head dim contiguous. A call of such a signature skips the checks and the layout
    decisions, and its signature keys the launch plans directly.

    Why: on the GPU hosts an eager forward + backward spends more host time in this module's Python than
    in its kernel launches (docs/flash_attention/host_floor.md); the checks are a large share of it
    and their outcome is a function of the signature alone (and of the device check, which the fast path
    still runs: on CPU it depends on ``TRITON_INTERPRET``). A bad call is never added, so it raises on every
    call. Only plain eager calls use it (``flash_triton._eager``): a traced call always runs the checks. Bounded, the
    least recently used dropped first; ``enabled=False`` (or :func:`validated_calls_off`, process-wide) sends
    every call through the checks, for A/B measurements."""

    def __init__(self, max_entries: int = 512, enabled: bool = True) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.enabled = enabled
        self._seen: OrderedDict[tuple, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def clear(self) -> None:
        self._seen.clear()

    def lookup(self, q: Tensor, k: Tensor, v: Tensor, is_causal: object) -> tuple | None:
        """The signature of this call if it was validated before, else None."""
        if not self.enabled or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            return None
        signature = _input_signature(q, k, v, is_causal)
        try:
            self._seen.move_to_end(signature)
        except KeyError:  # not seen (or dropped meanwhile by another thread's add)
            return None
        return signature

    def add(self, q: Tensor, k: Tensor, v: Tensor, is_causal: object) -> tuple | None:
        """Remember a call that passed the checks (and needs no reshaping); its signature, or None where the
        cache is off or a tensor is not a plain one."""
        if not self.enabled or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            return None
        signature = _input_signature(q, k, v, is_causal)
        self._seen[signature] = None
        if len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return signature


#: The signatures :class:`FlashAttentionTriton` has validated.
VALIDATED = ValidatedCalls()


def validated_calls_off(cache: ValidatedCalls = VALIDATED) -> contextlib.AbstractContextManager[None]:
    """Every call runs the input checks inside this block (an A/B switch)."""
    return switched_off(cache)
