"""§1.2.1: attention alone at scale — time, memory saved for backward, and where it runs out.

Inputs are ``(batch, 1, seq, d)``: one head, so the ``seq × seq`` score matrix is the only quadratic
term. :func:`benchmark_attention` times 100 forward passes and 100 backward passes of a registered
attention implementation (eager or ``torch.compile``-d) and records the memory in use just before a
backward pass; :func:`naive_attention_memory` predicts that memory tensor by tensor, and
:func:`saved_tensor_bytes` measures what autograd actually saved, which is how the prediction is tested.
:func:`attention_step_memory` runs one forward and backward and reads the allocator before the backward and at
the step's peak: where a grid fits the GPU everywhere, it finds the sequence length that does not, and shows
what the backward adds to what the forward saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cs336_basics.model import get_attention

from .end_to_end import default_device
from .sweep import OK, OOM, free_memory, is_oom
from .timing import TimingStats, synchronize, time_calls

HANDOUT_D_MODELS = [16, 32, 64, 128]
HANDOUT_SEQ_LENS = [256, 1024, 4096, 8192, 16384]


def attention_callable(impl: str = "naive", *, compile: bool = False, is_causal: bool = True) -> Callable[..., torch.Tensor]:
    """``fn(q, k, v)`` for a registered implementation, optionally compiled.

    Compiling resets dynamo's caches first: every grid cell is a new static shape, and dynamo's
    recompile limit (8 by default) would otherwise silently fall back to eager on the ninth shape.
    """
    attn = get_attention(impl)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attn(q, k, v, is_causal)

    if compile:
        torch._dynamo.reset()
        return torch.compile(fn)
    return fn


def benchmark_attention(
    d_model: int,
    seq_len: int,
    *,
    batch_size: int = 8,
    impl: str = "naive",
    compile: bool = False,
    n_forward: int = 100,
    n_backward: int = 100,
    warmup: int = 5,
    is_causal: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Time ``n_forward`` forward passes and ``n_backward`` backward passes (each on a fresh forward graph)
    of single-head attention; report mean/std times and the memory allocated right before backward."""
    if min(d_model, seq_len, batch_size, n_forward, n_backward) < 1:
        raise ValueError("d_model, seq_len, batch_size, n_forward and n_backward must be positive")
    device = torch.device(device) if device else default_device()
    fn = attention_callable(impl, compile=compile, is_causal=is_causal)
    shape = (batch_size, 1, seq_len, d_model)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)

    with torch.no_grad():  # forward timing: no graph, as at inference
        fwd = time_calls(lambda: fn(q, k, v), warmup=warmup, steps=n_forward, device=device)

    for _ in range(warmup):  # also compiles the backward graph when compiled
        fn(q, k, v).backward(grad_out)
    synchronize(device)
    memory_before_backward = 0
    times = []
    for _ in range(n_backward):
        q.grad = k.grad = v.grad = None  # so that "memory before backward" is the forward's alone
        out = fn(q, k, v)
        synchronize(device)
        if device.type == "cuda":
            memory_before_backward = torch.cuda.memory_allocated(device)
        bwd = time_calls(lambda: out.backward(grad_out), warmup=0, steps=1, device=device)
        times.extend(bwd.times_s)
        del out
    q.grad = k.grad = v.grad = None
    row = {**fwd.summary("forward_"), **TimingStats.from_seconds(times).summary("backward_")}
    row["memory_before_backward_MiB"] = memory_before_backward / 2**20 if device.type == "cuda" else float("nan")
    return row


def attention_step_memory(d_model: int, seq_len: int, *, batch_size: int = 8, dtype: torch.dtype = torch.float32,
                          device: str | torch.device | None = None) -> dict[str, Any]:
    """One forward and one backward of naive causal attention (one head, ``(batch, 1, seq, d)``) on a CUDA device:
    ``status`` (ok or OOM), ``oom_in`` (the pass that ran out of memory, else None), the memory allocated before
    the backward and the step's peak, in MiB (NaN where the step did not get that far)."""
    device = torch.device(device) if device else default_device()
    if device.type != "cuda":
        raise ValueError(f"attention_step_memory reads the CUDA caching allocator; got device {device}")
    if min(d_model, seq_len, batch_size) < 1:
        raise ValueError(f"d_model, seq_len and batch_size must be positive, got {d_model}, {seq_len}, {batch_size}")
    row: dict[str, Any] = {"d_model": d_model, "seq_len": seq_len, "status": OK, "oom_in": None,
                           "memory_before_backward_MiB": float("nan"), "peak_MiB": float("nan")}
    fn = attention_callable("naive")

    def step() -> None:  # its tensors die with its frame, also when it raises
        shape = (batch_size, 1, seq_len, d_model)
        row["oom_in"] = "forward"
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(shape, device=device, dtype=dtype)
        out = fn(q, k, v)
        torch.cuda.synchronize(device)
        row["memory_before_backward_MiB"] = torch.cuda.memory_allocated(device) / 2**20
        row["oom_in"] = "backward"
        out.backward(grad_out)
        torch.cuda.synchronize(device)
        row["peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["oom_in"] = None

    free_memory()  # the peak counts from here
    try:
        step()
    except Exception as exc:
        if not is_oom(exc):
            raise
        row["status"] = OOM
    free_memory()
    return row


def naive_attention_memory(
    batch_size: int,
    seq_len: int,
    d_model: int,
    *,
    dtype_bytes: int = 4,
    is_causal: bool = True,
    grad_output: bool = False,
) -> dict[str, int]:
    """Bytes alive after the forward pass of ``cs336_basics.model`` naive attention, before backward.

    Follows the code: ``scores = Q Kᵀ / √d`` saves Q and K (inputs); ``masked_fill`` saves the inverted
    boolean mask (seq²); our softmax saves the masked scores and their row max (for ``amax``), ``exp``'s
    output, and the row sums (for the division); ``probs @ V`` saves the probabilities and V. The output
    is alive too, and with ``grad_output`` the upstream gradient a benchmark holds ready for backward.
    Three ``batch × seq²`` tensors dominate: memory grows with seq², independent of d.
    """
    b, s, d = batch_size, seq_len, d_model
    terms = {
        "inputs_qkv": 3 * b * s * d * dtype_bytes,
        "output": b * s * d * dtype_bytes,
        "masked_scores": b * s * s * dtype_bytes,
        "exp_scores": b * s * s * dtype_bytes,
        "probabilities": b * s * s * dtype_bytes,
        "row_max_and_sum": 2 * b * s * dtype_bytes,
        "causal_mask": s * s if is_causal else 0,
        "grad_output": b * s * d * dtype_bytes if grad_output else 0,
    }
    terms["total"] = sum(terms.values())
    return terms


def saved_tensor_bytes(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> dict[str, int]:
    """Run ``fn(*inputs)`` and measure what autograd keeps: bytes of distinct storages saved for backward
    (inputs included when saved), plus the output. Storages are deduplicated by data pointer, so a tensor
    saved by two operations (or saved as a view) counts once."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out_bytes = out.untyped_storage().nbytes()
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    return {
        "saved_total": sum(saved.values()),
        "saved_inputs": sum(n for p, n in saved.items() if p in input_ptrs),
        "saved_intermediates": sum(n for p, n in saved.items() if p not in input_ptrs),
        "output": out_bytes,
    }
