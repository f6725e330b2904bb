"""Host cost of how our attention's kernels are registered with PyTorch, per forward+backward.

In a ``torch.compile``d step that does not replay CUDA graphs (``torch.compile(model)`` in its default mode, as
§1.3.2's ``model_ab`` runs it), the compiled graph calls our two operators, ``cs336_systems::flash_attention_forward``
and ``…_backward``, once each per layer. They are registered with ``torch.library.custom_op``, whose Python wrapper
(an output-aliasing check and a Dynamo-disabled frame) runs on every call. This benchmark issues the same
launch code three ways, alternating in one process, rotating the order each round:

- ``custom_op``: through the registered operators, as a compiled graph calls them;
- ``library``: through a twin pair registered with ``torch.library.Library`` ``define``/``impl`` plus a fake
  (shape-only) kernel: opaque to tracing in the same way, without ``custom_op``'s wrapper;
- ``direct``: the launch functions themselves (``flash_triton.eager_forward``, ``eager_backward``), what eager calls run.

Each is timed as host microseconds per forward+backward pair while the GPU sleeps
(:func:`cs336_systems.benchmarking.flash_host_overhead.host_us`), so only the cost of issuing the work counts.
``library`` minus ``direct`` is what a ``Library`` registration would cost a compiled step per layer, and
``custom_op`` minus ``library`` what switching to it would save.

    python -m cs336_systems.benchmarking.op_registration --shape 8,16,1024,64 --shape 8,25,1024,64 --rounds 5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import pandas as pd
import torch
from torch import Tensor

from cs336_systems.attention import flash_triton

#: The namespace of the twin operators (a namespace can be defined once per process: at this module's import).
NAMESPACE = "cs336_systems_registration_ab"
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_LIBRARY.define("flash_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal, float scale) "
                "-> (Tensor, Tensor)")
_LIBRARY.define("flash_attention_backward(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                "bool is_causal, float scale) -> (Tensor, Tensor, Tensor)")
# CompositeExplicitAutograd: one kernel for every device (CUDA, and CPU under the Triton interpreter); these
# operators run inside an autograd function, as ours do, so they need no autograd formula of their own.
_LIBRARY.impl("flash_attention_forward", flash_triton.eager_forward, "CompositeExplicitAutograd")
_LIBRARY.impl("flash_attention_backward", flash_triton.eager_backward, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::flash_attention_forward")
def _(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake(f"{NAMESPACE}::flash_attention_backward")
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _paths() -> dict[str, tuple[Callable[..., tuple[Tensor, ...]], Callable[..., tuple[Tensor, ...]]]]:
    twin = getattr(torch.ops, NAMESPACE)
    return {
        "custom_op": (torch.ops.cs336_systems.flash_attention_forward,
                      torch.ops.cs336_systems.flash_attention_backward),
        "library": (twin.flash_attention_forward, twin.flash_attention_backward),
        "direct": (flash_triton.eager_forward, flash_triton.eager_backward),
    }


#: The registrations compared, in their first round's order.
PATHS = ("custom_op", "library", "direct")


def make_pair(path: str, q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool) -> Callable[[], tuple[Tensor, ...]]:
    """One forward and one backward operator call of ``path`` on 4-D ``(batch, heads, seq, d)`` inputs; returns
    ``(O, dQ, dK, dV)``."""
    paths = _paths()
    if path not in paths:
        raise ValueError(f"unknown path {path!r}; choose from {', '.join(PATHS)}")
    d = q.shape[-1]
    # the operators take what the autograd function hands them: head dims it does not pad (64, 80, 128, ...)
    if q.dim() != 4 or d not in flash_triton.HEAD_DIMS or flash_triton.stored_head_dim(d, q.element_size()) != d:
        raise ValueError(f"inputs must be (batch, heads, seq, d) with a head dim the kernels take unpadded "
                         f"(16-byte rows, at most {flash_triton.HEAD_DIMS[-1]}), got {tuple(q.shape)} {q.dtype}")
    forward, backward = paths[path]
    scale = 1.0 / math.sqrt(d)

    def pair() -> tuple[Tensor, ...]:
        o, lse = forward(q, k, v, causal, scale)
        return (o, *backward(do, q, k, v, o, lse, causal, scale))

    return pair


def measure(shape: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16, causal: bool = True,
            rounds: int = 5, calls: int = 20, warmup: int = 5, layout: str = "bshd",
            paths: tuple[str, ...] = PATHS, device: str = "cuda") -> pd.DataFrame:
    """Host µs per forward+backward pair of each path, one row per (round, path), in an order that rotates
    from round to round."""
    from cs336_systems.benchmarking.flash_host_overhead import host_us, make_inputs

    if rounds < 1 or calls < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, calls >= 1 and warmup >= 0, got {rounds}, {calls}, {warmup}")
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (t.detach() for t in make_inputs(shape, dtype, layout, generator, device=device))
    pairs = {path: make_pair(path, q, k, v, do, causal) for path in paths}
    for pair in pairs.values():  # compile, tune and fill every cache before timing
        for _ in range(warmup):
            pair()
    rows = []
    for r in range(rounds):
        for path in paths[r % len(paths):] + paths[:r % len(paths)]:
            rows.append({"round": r, "path": path, "host_us": host_us(pairs[path], calls)})
    batch, heads, seq, d = shape
    return pd.DataFrame(rows).assign(batch=batch, heads=heads, seq_len=seq, head_dim=d, layout=layout,
                                     dtype=str(dtype).removeprefix("torch."), causal=causal)


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """Per shape and path: the median host µs over the rounds, its spread (max - min), and the median's
    excess over the direct call (what the registration adds per forward+backward)."""
    keys = ["batch", "heads", "seq_len", "head_dim", "layout", "dtype", "causal"]
    out = (rows.groupby([*keys, "path"], sort=False)["host_us"]
           .agg(host_us="median", host_spread_us=lambda s: s.max() - s.min()).reset_index())
    direct = out[out["path"] == "direct"].set_index(keys)["host_us"]
    base = out.set_index(keys).index.map(direct.to_dict())
    return out.assign(over_direct_us=out["host_us"] - pd.Series(base, index=out.index))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking op_registration --help``."""
    parser.add_argument("--shape", action="append", help="batch,heads,seq,head_dim (repeatable; default 8,16,1024,64)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bshd",
                        help="bshd: head views of (batch, seq, heads, d) tensors, as a Transformer block passes them")
    parser.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--csv", help="write every round here")


def run_command(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU: host time is measured while the GPU sleeps")
    from cs336_systems.cli import parse_positive_ints

    shapes = [parse_positive_ints(text, 4, "--shape is batch,heads,seq,head_dim")
              for text in args.shape or ["8,16,1024,64"]]
    dtype = getattr(torch, args.dtype)
    rows = pd.concat([measure(s, dtype, not args.full, args.rounds, args.calls, layout=args.layout)
                      for s in shapes], ignore_index=True)
    if args.csv:
        rows.to_csv(args.csv, index=False)
    print(summarize(rows).to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking op_registration`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["op_registration", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.op_registration"))
