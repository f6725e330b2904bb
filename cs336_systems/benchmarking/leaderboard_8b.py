"""The 2026 leaderboard's training step: an 8B model (vocab 151,936, d 4096, d_ff 11008, 34 layers, 32 heads) at
batch 2 and context 32,768 in bf16, timed with ``triton.testing.do_bench`` over forward, loss, backward and AdamW.

Two parts:

- :func:`memory_plan`: what the full shape needs per GPU, step by step from the handout's plain model to one that
  fits (flash attention instead of score matrices, the fused LM head + cross-entropy instead of
  ``[batch, seq, vocab]`` logits, activation checkpointing of the fewest blocks that make it fit, FSDP over the
  GPUs), from the calculator in :mod:`cs336_systems.configs` (parameters, activations saved per block).
- :func:`time_step`: the step at any shape (scale layers and context down to fit one GPU), with our options
  (attention, fused head, checkpointing, optimizer, compile), the wall time from the first line to the last
  (compilation and autotuning included) checked against the 10-minute rule.

On several ranks (``--nproc 2``, or under ``torchrun``) the step runs under our FSDP: each rank holds half
of the batch and a shard of every weight, the LM head stays replicated when the fused loss reads it, and the
step is timed by :func:`collective_bench`, ``do_bench``'s protocol with step counts every rank agrees on
(``do_bench`` sizes its loops from each process's own estimate, and ranks that ran different numbers of
collective steps would hang). :meth:`StepOptions.reference` is the torch-native step to compare with: the
same model, head and checkpointed blocks under FSDP2, SDPA with cuDNN first, fused AdamW, compiled blocks.

    python -m cs336_systems.benchmarking.leaderboard_8b --plan-only
    python -m cs336_systems.benchmarking.leaderboard_8b --layers 4 --context 8192 --checkpoint 1
    python -m cs336_systems.benchmarking.leaderboard_8b --nproc 2 --checkpoint 1      # the handout's step
    python -m cs336_systems.benchmarking.leaderboard_8b --nproc 2 --checkpoint 1 --reference  # FSDP2's
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
import torch

from cs336_systems.configs import ModelConfig, activation_elements_per_layer, param_counts

#: The 10-minute rule: a benchmarking run from an empty cache must finish within it.
TIME_LIMIT_S = 600.0
OPTIMIZERS = ("torch_fused", "basics")
#: Who shards the step over ranks: our FSDP, or PyTorch's FSDP2 (``fully_shard`` per block and at the root).
STACKS = ("ours", "fsdp2")


@dataclass(frozen=True)
class LeaderboardShape:
    """The handout's ``Config`` (defaults), or a scaled-down copy of it."""

    context_length: int = 32768
    vocab_size: int = 151936
    d_model: int = 4096
    d_ff: int = 11008
    num_layers: int = 34
    num_heads: int = 32
    batch_size: int = 2

    def config(self) -> ModelConfig:
        """As a :class:`~cs336_systems.configs.ModelConfig` (which checks the shape in one line)."""
        return ModelConfig("leaderboard_8b", d_model=self.d_model, d_ff=self.d_ff, num_layers=self.num_layers,
                           num_heads=self.num_heads, vocab_size=self.vocab_size, context_length=self.context_length,
                           batch_size=self.batch_size)


@dataclass(frozen=True)
class StepOptions:
    attention: str = "flash_triton"
    fused_head: bool = True
    """The LM head and cross-entropy as :func:`cs336_systems.lm_head_loss.linear_cross_entropy` (no logits)."""
    checkpoint: tuple[int, ...] = ()
    """Activation-checkpoint levels (:func:`cs336_systems.checkpointing.checkpoint_layers`)."""
    optimizer: str = "torch_fused"
    compile: bool = False
    chunk_size: int = 4096
    checkpoint_blocks: int | None = None
    """Checkpoint only the first this many blocks (None: every block the levels cover); the memory plan's
    ``checkpointed_blocks`` is the fewest that fit."""
    stack: str = "ours"
    """``ours`` (our FSDP on several ranks) or ``fsdp2`` (``fully_shard``; with ``compile``, each block compiled)."""
    compile_backend: str = "inductor"
    """``torch.compile``'s backend (``aot_eager`` traces and differentiates without generating kernels)."""
    compile_pointwise: bool = False
    """Compile only RMSNorm, RoPE and SwiGLU's gate (:func:`cs336_systems.pointwise_compile.compile_pointwise`):
    the part of ``compile`` that runs under our FSDP, whose hooks a whole compiled block would break on."""

    def reference(self) -> StepOptions:
        """The torch-native step to compare with: the same model, head and checkpointed blocks under FSDP2, with
        SDPA (cuDNN first) for attention, fused AdamW and every block compiled."""
        return replace(self, stack="fsdp2", attention="sdpa", optimizer="torch_fused", compile=True,
                       compile_pointwise=False)

    def check(self) -> None:
        from cs336_basics.model import available_attention_impls

        if self.attention not in available_attention_impls():
            raise ValueError(f"unknown attention {self.attention!r}; available: {available_attention_impls()}")
        if self.compile:
            import torch._dynamo

            if self.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
                raise ValueError(f"unknown torch.compile backend {self.compile_backend!r}; available: "
                                 f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}")
        if self.compile and self.compile_pointwise:
            raise ValueError("compile_pointwise compiles part of what compile compiles whole: choose one")
        if self.stack not in STACKS:
            raise ValueError(f"stack must be one of {', '.join(STACKS)}, got {self.stack!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.chunk_size < 1 or any(level < 1 for level in self.checkpoint):
            raise ValueError(f"chunk_size and checkpoint levels must be positive, got {self.chunk_size}, "
                             f"{self.checkpoint}")
        if self.checkpoint_blocks is not None and (self.checkpoint_blocks < 0 or not self.checkpoint):
            raise ValueError(f"checkpoint_blocks needs checkpoint levels and a count >= 0, got "
                             f"{self.checkpoint_blocks} with levels {list(self.checkpoint)}")


# --------------------------------------------------------------------------------------------------
# Memory plan of the full shape
# --------------------------------------------------------------------------------------------------

BYTES = 2  # bf16 weights, gradients, AdamW moments (``zeros_like`` the parameters) and activations


#: What the plan leaves free on each GPU beyond what it counts: the CUDA context, NCCL's buffers, the
#: allocator's fragmentation and the temporaries of a kernel (a plan at 100% of the card runs out of memory).
HEADROOM_GB = 8.0


def memory_plan(shape: LeaderboardShape = LeaderboardShape(), gpus: int = 2, gpu_gb: float = 180.0,
                chunk_size: int = 4096, headroom_gb: float = HEADROOM_GB) -> pd.DataFrame:
    """Per-GPU memory (GB) of the training step, one row per measure, each adding to the ones above it.

    Counted: bf16 weights, gradients and AdamW's two moments; the activations each block saves for backward
    (:func:`~cs336_systems.configs.activation_elements_per_layer`); the logits with their float32 log-softmax,
    or one chunk of them with the fused head. With FSDP the weights, gradients and moments are split over the
    GPUs and each GPU holds ``batch / gpus`` sequences; a gathered block's weights are counted once. With
    checkpointing, a checkpointed block keeps only its input, and one block's activations are live while it is
    recomputed; the row "checkpoint k of L blocks" uses the fewest ``k`` that fits. A row fits when its total
    leaves ``headroom_gb`` of ``gpu_gb`` free for what it does not count.
    """
    if gpus < 1 or gpu_gb <= 0 or not 0 <= headroom_gb < gpu_gb:
        raise ValueError(f"need gpus >= 1, gpu_gb > 0 and 0 <= headroom_gb < gpu_gb, got {gpus}, {gpu_gb}, "
                         f"{headroom_gb}")
    usable = (gpu_gb - headroom_gb) * 1e9
    cfg = shape.config()
    n_params = param_counts(cfg)["total"]
    block_params = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model
    tokens = shape.batch_size * shape.context_length

    def per_gpu(*, flash: bool, fused: bool, checkpointed: int, shards: int) -> dict[str, float]:
        batch = shape.batch_size / shards
        acts = activation_elements_per_layer(cfg, 1, shape.context_length)
        block = sum(v for k, v in acts.items() if not (flash and k == "attention_scores")) * batch * BYTES
        block_input = batch * shape.context_length * cfg.d_model * BYTES
        live = (cfg.num_layers - checkpointed) * block + checkpointed * block_input + (block if checkpointed else 0)
        logit_rows = min(chunk_size, tokens / shards) if fused else tokens / shards
        state = n_params * BYTES / shards
        return {"weights": state + (block_params * BYTES if shards > 1 else 0.0), "gradients": state,
                "adamw_moments": 2 * state, "activations": live, "logits": logit_rows * cfg.vocab_size * (BYTES + 4)}

    steps: list[tuple[str, dict[str, float]]] = [
        ("the handout's model on one GPU (score matrices, full logits)",
         per_gpu(flash=False, fused=False, checkpointed=0, shards=1)),
        ("+ flash attention (no score matrices)", per_gpu(flash=True, fused=False, checkpointed=0, shards=1)),
        ("+ fused LM head and cross-entropy (one chunk of logits)",
         per_gpu(flash=True, fused=True, checkpointed=0, shards=1)),
        (f"+ FSDP over {gpus} GPUs", per_gpu(flash=True, fused=True, checkpointed=0, shards=gpus)),
    ]
    fewest = next((k for k in range(cfg.num_layers + 1)
                   if sum(per_gpu(flash=True, fused=True, checkpointed=k, shards=gpus).values()) <= usable),
                  None)
    if fewest:
        steps.append((f"+ checkpoint {fewest} of {cfg.num_layers} blocks",
                      per_gpu(flash=True, fused=True, checkpointed=fewest, shards=gpus)))
    elif fewest is None:
        steps.append((f"+ checkpoint all {cfg.num_layers} blocks (still does not fit)",
                      per_gpu(flash=True, fused=True, checkpointed=cfg.num_layers, shards=gpus)))
    rows = []
    for measure, parts in steps:
        total = sum(parts.values())
        rows.append({"measure": measure, **{f"{k}_GB": v / 1e9 for k, v in parts.items()}, "total_GB": total / 1e9,
                     "fits": total <= usable})
    table = pd.DataFrame(rows)
    table.attrs.update(params=n_params, gpus=gpus, gpu_gb=gpu_gb, headroom_gb=headroom_gb, checkpointed_blocks=fewest)
    return table


# --------------------------------------------------------------------------------------------------
# The timed step
# --------------------------------------------------------------------------------------------------


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_step(shape: LeaderboardShape, options: StepOptions, device: torch.device,
               seed: int = 0) -> Callable[[], torch.Tensor]:
    """The handout's ``train_step`` (zero_grad, forward, loss, backward, AdamW) on a bf16 model of ``shape``;
    under an initialised process group of several ranks, with our FSDP and this rank's part of the batch."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy

    options.check()
    cfg = shape.config()
    rank, world = _world()
    if shape.batch_size % world:
        raise ValueError(f"batch {shape.batch_size} does not split over {world} ranks")
    if world > 1 and options.compile and options.stack == "ours":
        raise ValueError("--compile is not supported with our FSDP (its gathers run from Python hooks); "
                         "--stack fsdp2 compiles each block")
    if options.stack == "fsdp2" and world < 2:
        raise ValueError("--stack fsdp2 shards over ranks: run it with --nproc 2 or more")
    torch.manual_seed(seed)
    model = BasicsTransformerLM(**cfg.model_kwargs(), attention_impl=options.attention, device=device,
                                dtype=torch.bfloat16)
    if options.checkpoint:
        from cs336_systems.checkpointing import checkpoint_layers

        checkpoint_layers(model, options.checkpoint, first=options.checkpoint_blocks)
    if options.compile_pointwise:
        from cs336_systems.pointwise_compile import compile_pointwise

        compile_pointwise(model, backend=options.compile_backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs, targets = torch.randint(0, cfg.vocab_size, (2, shape.batch_size, shape.context_length), device=device,
                                    generator=gen)
    if world > 1:
        shard = _fsdp2_step if options.stack == "fsdp2" else _fsdp_step
        return _sdpa_prefers_cudnn(shard(model, options, inputs, targets, rank, world), options, device)
    optimizer = _optimizer(model.parameters(), options, device)

    if options.fused_head:
        from functools import partial

        from cs336_systems.lm_head_loss import hidden_states, linear_cross_entropy

        hidden = partial(hidden_states, model)
        body = torch.compile(hidden, backend=options.compile_backend) if options.compile else hidden

        def loss_fn() -> torch.Tensor:
            return linear_cross_entropy(body(inputs), model.lm_head.weight, targets, options.chunk_size)
    else:
        forward = torch.compile(model, backend=options.compile_backend) if options.compile else model

        def loss_fn() -> torch.Tensor:
            return cross_entropy(forward(inputs), targets).sum()

    return _sdpa_prefers_cudnn(_train_step(loss_fn, optimizer, model), options, device)


def _sdpa_prefers_cudnn(step: Callable[[], torch.Tensor], options: StepOptions,
                        device: torch.device) -> Callable[[], torch.Tensor]:
    """With SDPA attention on a GPU, the whole step (the backward's recomputation included) runs with cuDNN's
    attention first and flash second (SDPA's default order may pick flash; cuDNN's is the faster built-in
    attention on Hopper, :mod:`cs336_systems.experiments.flash_benchmarking`)."""
    if options.attention != "sdpa" or device.type != "cuda":
        return step
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn_step() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            return step()

    cudnn_step.model = step.model  # type: ignore[attr-defined]
    return cudnn_step


def _train_step(loss_fn: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                after_backward: Callable[[], None] | None = None) -> Callable[[], torch.Tensor]:
    """zero_grad, loss, backward (then ``after_backward``, e.g. FSDP's gradient synchronisation), AdamW."""

    def train_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        return loss.detach()

    train_step.model = model  # type: ignore[attr-defined]  # for tests and inspection
    return train_step


def _optimizer(params: Any, options: StepOptions, device: torch.device) -> torch.optim.Optimizer:
    if options.optimizer == "basics":
        from cs336_basics.optimizer import AdamW

        return AdamW(params)
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, fused=fused, foreach=not fused)


def _fsdp_step(model: torch.nn.Module, options: StepOptions, inputs: torch.Tensor, targets: torch.Tensor,
               rank: int, world: int) -> Callable[[], torch.Tensor]:
    """The step under our FSDP: weights, gradients and AdamW state sharded over the ranks, each rank on
    ``batch / world`` sequences; with the fused head the LM head stays replicated (the loss reads its weight
    outside the head's forward)."""
    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.distributed.fsdp import FSDP
    from cs336_systems.lm_head_loss import FusedLMLoss

    part = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
    x, y = inputs[part], targets[part]
    if options.fused_head:
        net = FSDP(FusedLMLoss(model, options.chunk_size), replicated_modules=("lm.lm_head",))

        def loss_fn() -> torch.Tensor:
            return net(x, y)
    else:
        net = FSDP(model)

        def loss_fn() -> torch.Tensor:
            return cross_entropy(net(x), y).sum()
    return _train_step(loss_fn, _optimizer(net.parameters(), options, x.device), net,
                       net.finish_gradient_synchronization)


def _fsdp2_step(model: torch.nn.Module, options: StepOptions, inputs: torch.Tensor, targets: torch.Tensor,
                rank: int, world: int) -> Callable[[], torch.Tensor]:
    """The step under PyTorch's FSDP2: ``fully_shard`` on every block, then on the whole loss module (the
    embedding, final norm and LM head, gathered for the root's forward, so the fused loss may read the head's
    weight); with ``compile`` each block is compiled (FSDP2's hooks stay outside the compiled graphs)."""
    from torch.distributed.fsdp import fully_shard

    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.lm_head_loss import FusedLMLoss

    part = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
    x, y = inputs[part], targets[part]
    for block in model.layers.children():  # (a checkpointed ``layers`` iterates over segments, not blocks)
        fully_shard(block)
        if options.compile:
            block.compile(backend=options.compile_backend)
    net = FusedLMLoss(model, options.chunk_size) if options.fused_head else model
    fully_shard(net)
    if options.fused_head:
        def loss_fn() -> torch.Tensor:
            return net(x, y)
    else:
        def loss_fn() -> torch.Tensor:
            return cross_entropy(net(x), y).sum()
    return _train_step(loss_fn, _optimizer(net.parameters(), options, x.device), net)


def collective_bench(fn: Callable[[], Any], warmup_ms: float, rep_ms: float,
                     device: torch.device) -> tuple[float, float]:
    """``triton.testing.do_bench``'s protocol (estimate from 5 calls, warm up for ``warmup_ms``, then the
    median of ``rep_ms`` worth of timed calls), with the call counts agreed over the ranks (from the slowest
    rank's estimate): the slowest rank's median and the largest step-to-step spread (half the 20-80% range)
    over the ranks. On CPU, ``perf_counter`` replaces CUDA events."""
    import statistics


    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    sync()
    estimate = _largest_over_ranks((time.perf_counter() - t0) * 1e3 / 5, device)
    n_warmup, n_repeat = max(1, int(warmup_ms / estimate)), max(1, int(rep_ms / estimate))
    for _ in range(n_warmup):
        fn()
    times = []
    for _ in range(n_repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return (_largest_over_ranks(statistics.median(times), device),
            _largest_over_ranks(_spread(times), device))


def _largest_over_ranks(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _spread(times: list[float]) -> float:
    """Half the range from the 20th to the 80th percentile: the step-to-step spread a comparison must exceed."""
    import statistics

    if len(times) < 2:
        return 0.0
    cuts = statistics.quantiles(times, n=5, method="inclusive")
    return (cuts[3] - cuts[0]) / 2


def time_step(shape: LeaderboardShape, options: StepOptions, device: torch.device | None = None,
              warmup_ms: float = 10_000.0, rep_ms: float = 30_000.0) -> dict[str, object]:
    """Build and time the step: ``do_bench`` (median ms) on a GPU, a ``perf_counter`` mean on CPU (smoke runs),
    with the step-to-step spread (half the 20-80% range), peak memory, the whole run's wall time and whether it kept the 10-minute rule."""
    from cs336_systems.benchmarking.end_to_end import default_device

    started = time.perf_counter()
    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build_step(shape, options, device)
    _, world = _world()
    if world > 1:
        ms, spread = collective_bench(step, warmup_ms, rep_ms, device)
        peak = _largest_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30, device) \
            if device.type == "cuda" else float("nan")
    elif device.type == "cuda":
        import triton.testing

        ms, low, high = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        ms, spread = float(ms), (float(high) - float(low)) / 2
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        step()  # warm-up
        calls = max(2, math.ceil(rep_ms / 1000))
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        ms, spread, peak = sum(times) / calls, _spread(times), float("nan")
    wall = time.perf_counter() - started
    # the model's parameters (under FSDP a rank holds shards of them, so count from the shape)
    return {"step_ms": ms, "step_spread_ms": spread, "peak_GiB": peak, "wall_s": wall, "within_10_min": wall <= TIME_LIMIT_S,
            "params": param_counts(shape.config())["total"], "gpus": world}


def _rank_worker(shape: LeaderboardShape, options: StepOptions, warmup_ms: float, rep_ms: float) -> dict[str, object]:
    import gc

    from cs336_systems.distributed import launch

    device = launch.current_context().device
    result = time_step(shape, options, device, warmup_ms, rep_ms)
    gc.collect()  # under torchrun the next stack runs in these processes: leave it the memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def time_step_on_ranks(shape: LeaderboardShape, options: StepOptions, nproc: int, warmup_ms: float = 10_000.0,
                       rep_ms: float = 30_000.0) -> dict[str, object]:
    """:func:`time_step` under FSDP on ``nproc`` spawned ranks (or on the ranks of ``torchrun``/``srun``, which
    fix the count): rank 0's result (the step time is already the slowest rank's, the peak the largest), with the
    wall time of the whole run, process start-up included, against the 10-minute rule. Spawned ranks compile
    into empty Triton and Inductor caches (:func:`empty_compile_caches`; ``empty_caches`` in the result)."""
    from cs336_systems.distributed import runner

    started = time.perf_counter()
    external = runner.launched_externally()
    if not external and nproc < 2:
        raise ValueError(f"time_step_on_ranks needs nproc >= 2, got {nproc}")
    # A collective may wait for a rank's whole first step (minutes at the full shape), so no short timeout; and
    # no limit on the run: one past 10 minutes is measured to the end and reported as such (within_10_min).
    with empty_compile_caches(not external) as emptied:
        result = dict(runner.run_on_ranks(_rank_worker, 0 if external else nproc, shape, options, warmup_ms, rep_ms,
                                          collective_timeout_s=TIME_LIMIT_S)[0])
    result["empty_caches"] = emptied
    if not external:
        result["wall_s"] = time.perf_counter() - started
        result["within_10_min"] = result["wall_s"] <= TIME_LIMIT_S
    return result


#: The environment variables that place Triton's and Inductor's on-disk caches.
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@contextlib.contextmanager
def empty_compile_caches(enabled: bool = True) -> Iterator[bool]:
    """Point Triton's and Inductor's caches at a new empty folder for the processes started inside (the rule
    is "from an empty cache"); yields whether it did. Ranks started by an outside launcher (torchrun, srun) have
    their environment already: there it yields False and the result says so."""
    if not enabled:
        yield False
        return
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="cs336-empty-cache-") as folder:
        for name in CACHE_VARIABLES:
            os.environ[name] = os.path.join(folder, name.lower())
        try:
            yield True
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking leaderboard_8b --help``."""
    full = LeaderboardShape()
    parser.add_argument("--layers", type=int, default=full.num_layers)
    parser.add_argument("--context", type=int, default=full.context_length)
    parser.add_argument("--batch-size", type=int, default=full.batch_size)
    parser.add_argument("--attention", default="flash_triton")
    parser.add_argument("--unfused-head", action="store_true", help="materialize the logits (the handout's model)")
    parser.add_argument("--checkpoint", default="", help="checkpoint levels, e.g. 1 (every block) or 6,2")
    parser.add_argument("--checkpoint-blocks", default="all",
                        help="how many blocks the levels cover, from the first: all, plan (the fewest that let the "
                             "timed shape fit its --nproc GPUs of --gpu-gb, by the memory plan) or a number")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="torch_fused")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model body (one rank) or each "
                        "block (--stack fsdp2)")
    parser.add_argument("--compile-pointwise", action="store_true", help="compile only RMSNorm, RoPE and SwiGLU's "
                        "gate (runs under our FSDP, unlike --compile)")
    parser.add_argument("--stack", choices=STACKS, default="ours", help="who shards the step over ranks")
    parser.add_argument("--reference", action="store_true", help="time the torch-native reference instead: "
                        "FSDP2, SDPA (cuDNN), fused AdamW, compiled blocks, the same checkpointed blocks")
    parser.add_argument("--warmup-ms", type=float, default=10_000.0)
    parser.add_argument("--rep-ms", type=float, default=30_000.0)
    parser.add_argument("--nproc", type=int, default=1, help="ranks of the timed step (2: FSDP over two GPUs, "
                        "spawned here; under torchrun the launcher's count)")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the memory plan")
    parser.add_argument("--gpu-gb", type=float, default=180.0, help="memory per GPU of the plan (B200: 180 GB)")
    parser.add_argument("--plan-only", action="store_true", help="print the full shape's memory plan and stop")


def run_command(args: argparse.Namespace) -> int:
    from cs336_systems.benchmarking.train_step import parse_levels

    full = LeaderboardShape()
    levels = parse_levels(args.checkpoint)
    plan = memory_plan(full, args.gpus, args.gpu_gb)
    shape = replace(full, num_layers=args.layers, context_length=args.context, batch_size=args.batch_size)
    shape.config()
    own_plan = memory_plan(shape, max(args.nproc, 1), args.gpu_gb) if args.checkpoint_blocks == "plan" else plan
    options = StepOptions(args.attention, not args.unfused_head, levels, args.optimizer, args.compile,
                          checkpoint_blocks=checkpoint_blocks(args.checkpoint_blocks, own_plan), stack=args.stack,
                          compile_pointwise=args.compile_pointwise)
    if args.reference:
        options = options.reference()
    options.check()
    print(f"Memory plan of the full shape ({plan.attrs['params'] / 1e9:.2f} B parameters) on {args.gpus} GPUs of "
          f"{args.gpu_gb:g} GB:")
    print(plan.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    if args.plan_only:
        return 0
    from cs336_systems.distributed import runner

    if args.nproc > 1 or runner.launched_externally():
        result = time_step_on_ranks(shape, options, args.nproc, args.warmup_ms, args.rep_ms)
        if not runner.is_main_process():
            return 0
    else:
        result = time_step(shape, options, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    print(f"\n{shape}, {options}:")
    print(pd.DataFrame([result]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def checkpoint_blocks(value: str, plan: pd.DataFrame | None) -> int | None:
    """``all`` -> None (every block), ``plan`` -> ``plan``'s fewest checkpointed blocks that fit (every block
    where even all do not), a number -> that many. Pass the plan of the shape and GPUs the step runs on."""
    if value == "all":
        return None
    if value == "plan":
        fewest = plan.attrs.get("checkpointed_blocks") if plan is not None else None
        return None if fewest is None else int(fewest)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"checkpoint blocks are all, plan or a number, got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    """The same as ``python -m cs336_systems.benchmarking leaderboard_8b`` (this module\'s own command form)."""
    from cs336_systems.benchmarking.__main__ import main as benchmarking

    return benchmarking(["leaderboard_8b", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.benchmarking.leaderboard_8b"))
