"""A whole training step captured once in a CUDA graph and replayed: one launch per step.

Why: under bf16 autocast a large model at a small batch is *launch-bound*. The XL model at 2 × 512
tokens runs about 7,000 kernels per forward + backward (``docs/ddp/NOTES.md``), and the host needs longer to
launch them than the GPU needs to run them. Data parallelism adds a few hundred gradient hooks and
collective launches to that host path, and each rank's host jitter makes the other ranks' collectives
wait. Replaying a captured graph takes the host out of the step: forward, backward, the gradient
hooks' all-reduces and the optimizer step are replayed by the GPU from one ``cudaGraphLaunch``.

What a captured step requires (the CUDA-graph rules of ``torch.cuda.graphs``, plus NCCL's):

- *Static inputs.* The step reads its batch from tensors that stay at the same address; copy each new
  batch into them (``x.copy_(batch)``) before :meth:`CapturedStep.__call__`.
- *Static control flow and shapes.* Python runs once, at capture: hooks, bucket bookkeeping and
  ``if`` statements are frozen into the graph. A gradient hook that launches an all-reduce is
  captured as that all-reduce, which is why DDP's hooks need no changes.
- *Gradients set to None before capture* (``zero_grad(set_to_none=True)`` at the start of the step):
  backward then allocates them from the graph's memory pool and every replay overwrites them. With
  gradients as bucket views, the zeroing kernel of the buckets is captured with the forward.
- *An optimizer whose state lives on the GPU* (``torch.optim.AdamW(..., capturable=True)``), or the
  step counter would be frozen at its capture-time value.
- *Warm-up on a side stream first*: lazy initialisations (cuBLAS handles, NCCL communicators, the
  optimizer state, torch DDP's bucket rebuild after its first iterations and its logging at
  iteration 10) must not happen during capture. ``torch`` DDP needs at least 11 eager iterations and
  must be constructed on the side stream (:func:`side_stream`).
- *Every rank captures the same collectives*, and replays together (NCCL's rule for captured
  collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

#: Eager iterations before capture; torch DDP needs at least 11 (its first iterations rebuild buckets
#: and log), so the default covers it.
DEFAULT_WARMUP = 11

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError("CUDA graphs need a CUDA device; none is available")
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def side_stream(device: torch.device | str | int | None = None) -> Iterator[torch.cuda.Stream]:
    """Run the body on a non-default stream of ``device`` (the same one each time), ordered after the
    work already queued on the current stream, and make the current stream wait for it afterwards.

    Warm-up before capture must run off the default stream, and torch DDP must be constructed there
    (its gradient accumulators remember the stream they were created on)."""
    device = _cuda_device(device)
    stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield stream
    current.wait_stream(stream)


class CapturedStep(Generic[T]):
    """``step()`` captured in a CUDA graph after ``warmup`` eager calls; calling the object replays it.

    ``step`` is a zero-argument function that runs one whole training step on static tensors (see the
    module docstring) and returns what the caller wants to read after each replay, typically the loss
    tensor; the returned tensors are the graph's static outputs, overwritten by every replay.

    Usage::

        x, y = x_batch0.clone(), y_batch0.clone()          # static inputs
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            model.finish_gradient_synchronization()          # our DDP wrappers; torch DDP needs nothing
            optimizer.step()                                 # AdamW(..., capturable=True)
            return loss
        captured = CapturedStep(step, device)
        for xb, yb in loader:
            x.copy_(xb); y.copy_(yb)
            loss = captured()
    """

    def __init__(self, step: Callable[[], T], device: torch.device | str | int | None = None, *,
                 warmup: int = DEFAULT_WARMUP):
        if not callable(step):
            raise ValueError("step must be a zero-argument callable")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 eager call before capture, got {warmup}")
        self.device = _cuda_device(device)
        self.warmup = warmup
        with side_stream(self.device):
            for _ in range(warmup):
                step()
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs: T = step()
        torch.cuda.synchronize(self.device)

    def __call__(self) -> T:
        """Replay the captured step on the current stream; returns the static outputs."""
        self.graph.replay()
        return self.outputs

    def reset(self) -> None:
        """Free the graph and its private memory pool."""
        self.graph.reset()
