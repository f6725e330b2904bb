"""All-reduce benchmark (§2.1.3): time, algorithm bandwidth and bus bandwidth of fp32 all-reduce for
several message sizes, backends (gloo on CPU, NCCL on GPU) and process counts, next to the peak the
measured NVLink topology allows.

Conventions follow nccl-tests (``doc/PERFORMANCE.md``):

- **algbw** = ``size / time``: bytes of each rank's buffer per second;
- **busbw** = ``algbw × 2(n−1)/n``: a ring all-reduce sends and receives ``2(n−1)/n × size`` bytes per
  rank, so busbw is the per-GPU link bandwidth the collective actually used, comparable across ``n``
  and with the hardware's link speed;
- time is the slowest rank's mean over the timed iterations (the collective is not done until every
  rank is done).

The theoretical ceiling comes from ``nvidia-smi topo -m``: ``NV<k>`` between two GPUs means ``k``
NVLinks; per-GPU bandwidth is ``links × per-link bandwidth`` (one direction), which is the peak busbw.

Run::

    python -m cs336_systems.distributed.allreduce --backends nccl gloo --nproc 2 4
    torchrun --nproc-per-node 8 -m cs336_systems.distributed.allreduce --backends nccl --append
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.distributed import launch, runner

SECTION = "distributed_communication_single_node"
DEFAULT_SIZES = ["1MB", "10MB", "100MB", "1GB"]
SMOKE_SIZES = ["1KB", "10KB", "100KB", "1MB"]
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}

#: Unidirectional bandwidth of one NVLink, GB/s, by GPU generation (NVLink 2, 3 and 4 all move 25 GB/s
#: per link and direction; NVLink 5 doubles it). Matched against the device name.
NVLINK_GBPS_PER_LINK = {"B200": 50.0, "GB200": 50.0, "B100": 50.0, "H200": 25.0, "H100": 25.0, "H800": 25.0,
                        "A100": 25.0, "A800": 25.0, "V100": 25.0}
DEFAULT_NVLINK_GBPS = 25.0
#: The most NVLinks any GPU has (Hopper and Blackwell: 18).
MAX_NVLINKS_PER_GPU = 18


# --------------------------------------------------------------------------------------------------
# Sizes and bandwidth conventions
# --------------------------------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """``"1MB"`` → 1_000_000 (decimal units, as in GB/s), ``"1MiB"`` → 1_048_576, ``"4096"`` → 4096."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS | {"": 1}:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 1MB, 100MB, 1GB, 64MiB or a byte count")
    value = int(float(m.group(1)) * _UNITS.get(m.group(2).upper(), 1))
    if value < 4 or value % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (fp32 elements)")
    return value


def size_label(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def bus_bandwidth_factor(world_size: int) -> float:
    """``2(n−1)/n``: bytes each rank sends (and receives) per byte of buffer in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


# --------------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------------


@dataclass
class Topology:
    """What ``nvidia-smi topo -m`` says about the GPUs, and the peak bus bandwidth it implies."""

    available: bool
    text: str
    gpu_name: str | None
    links: dict[str, str]  # "i-j" → connection type ("NV18", "SYS", "PIX", ...)
    gbps_per_link: float
    note: str

    def nvlinks_per_gpu(self, world_size: int) -> int | None:
        """NVLinks each of the first ``world_size`` GPUs can drive in a ring, or ``None`` when some pair
        in the group is not NVLink-connected (PCIe/SYS paths are not modelled).

        ``NV<k>`` is the number of links on the path between two GPUs. Behind an NVSwitch every pair
        reports the GPU's *full* link count (``NV18`` everywhere on HGX H100/H200), so a GPU's pair counts
        add up to more links than any GPU has (:data:`MAX_NVLINKS_PER_GPU`); then the GPU drives ``k``
        links. Directly connected GPUs (NV4 all-to-all on 4×A100, NV1/NV2 meshes on DGX-1) use the links
        to every peer at once, so a GPU drives the sum over its peers in the group. The ring is as fast
        as its slowest GPU.
        """
        if world_size < 2:
            return None
        counts = {k: _nv_count(v) for k, v in self.links.items()}
        group = range(world_size)
        per_gpu = []
        for i in group:
            in_group = [counts.get(f"{i}-{j}") for j in group if j != i]
            if any(c is None for c in in_group):
                return None
            all_peers = [c for k, c in counts.items() if k.startswith(f"{i}-") and c is not None]
            behind_switch = sum(all_peers) > MAX_NVLINKS_PER_GPU
            per_gpu.append(max(in_group) if behind_switch else sum(in_group))  # type: ignore[arg-type]
        return min(per_gpu)

    def peak_busbw_gbps(self, world_size: int) -> float | None:
        links = self.nvlinks_per_gpu(world_size)
        return None if links is None else links * self.gbps_per_link

    def peak_algbw_gbps(self, world_size: int) -> float | None:
        bus = self.peak_busbw_gbps(world_size)
        return None if bus is None else bus / bus_bandwidth_factor(world_size)


def _nv_count(kind: str) -> int | None:
    m = re.fullmatch(r"NV(\d+)", kind)
    return int(m.group(1)) if m else None


def parse_topology_matrix(text: str) -> dict[str, str]:
    """GPU-to-GPU connection types from ``nvidia-smi topo -m`` output: ``{"0-1": "NV18", ...}``.

    nvidia-smi underlines the header with ANSI escapes even when writing to a pipe; they are removed
    first, otherwise the header's first column is not recognised and GPU0's links are lost.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln) or ln.split()[:1] == ["GPU0"]), None)
    if header is None:
        return {}
    columns = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    links: dict[str, str] = {}
    for ln in lines:
        fields = ln.split()
        if not fields or not re.fullmatch(r"GPU\d+", fields[0]) or ln is header:
            continue
        i = int(fields[0][3:])
        for col, value in zip(columns, fields[1 : 1 + len(columns)]):
            j = int(col[3:])
            if i != j:
                links[f"{i}-{j}"] = value
    return links


def read_topology(gbps_per_link: float | None = None) -> Topology:
    """Run ``nvidia-smi topo -m`` (if present) and parse it. Never raises: without ``nvidia-smi`` or
    GPUs the result says so, and the theoretical curve is simply left out."""
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if gbps_per_link is None:
        gbps_per_link = next(
            (v for k, v in NVLINK_GBPS_PER_LINK.items() if gpu_name and k in gpu_name), DEFAULT_NVLINK_GBPS
        )
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Topology(False, "", gpu_name, {}, gbps_per_link, "nvidia-smi not found: no theoretical curve")
    try:
        proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return Topology(False, "", gpu_name, {}, gbps_per_link, f"nvidia-smi topo -m failed: {e}")
    links = parse_topology_matrix(proc.stdout)
    note = f"{gbps_per_link:g} GB/s per NVLink per direction" + ("" if links else "; no GPU matrix found")
    return Topology(True, proc.stdout, gpu_name, links, gbps_per_link, note)


# --------------------------------------------------------------------------------------------------
# Measurement (inside an initialised process group)
# --------------------------------------------------------------------------------------------------


def default_iterations(size_bytes: int, backend: str) -> tuple[int, int]:
    """(warm-up, timed) iterations: many for small GPU messages, few for gigabyte all-reduces on CPU."""
    if backend == "nccl":
        return (5, 50) if size_bytes <= 10**8 else (3, 20)
    return (2, 10) if size_bytes <= 10**7 else (1, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(size_bytes: int, warmup: int | None = None, iters: int | None = None) -> dict[str, Any]:
    """Mean seconds per fp32 all-reduce of ``size_bytes`` on this process group (slowest rank)."""
    ctx = launch.current_context()
    default_warmup, default_iters = default_iterations(size_bytes, ctx.backend)
    warmup = default_warmup if warmup is None else warmup
    iters = default_iters if iters is None else iters
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    data = torch.randn(size_bytes // 4, dtype=torch.float32, device=ctx.device)
    for _ in range(warmup):
        dist.all_reduce(data)
    _sync(ctx.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    _sync(ctx.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = float(elapsed.item())
    algbw = size_bytes / seconds / 1e9
    del data
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "backend": ctx.backend,
        "device": "cuda" if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size,
        "size_bytes": size_bytes,
        "size": size_label(size_bytes),
        "time_ms": seconds * 1e3,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * bus_bandwidth_factor(ctx.world_size),
        "iters": iters,
    }


def benchmark_worker(sizes_bytes: list[int], warmup: int | None, iters: int | None) -> list[dict[str, Any]]:
    """All sizes on the current process group (run on every rank; rows are identical across ranks)."""
    return [time_all_reduce(s, warmup, iters) for s in sizes_bytes]


def run_allreduce_benchmark(
    backend: str,
    world_size: int,
    sizes: list[str | int],
    warmup: int | None = None,
    iters: int | None = None,
) -> list[dict[str, Any]]:
    """Spawn ``world_size`` local processes on ``backend`` and measure every size."""
    sizes_bytes = [parse_size(s) for s in sizes]
    results = launch.spawn(benchmark_worker, world_size, sizes_bytes, warmup, iters, backend=backend)
    return results[0]


# --------------------------------------------------------------------------------------------------
# Tables and figure
# --------------------------------------------------------------------------------------------------


def theoretical_rows(topology: Topology, world_sizes: list[int], sizes_bytes: list[int]) -> list[dict[str, Any]]:
    """Peak bus/algorithm bandwidth and the corresponding time for each (n, size), NCCL only."""
    rows = []
    for n in world_sizes:
        bus = topology.peak_busbw_gbps(n)
        if bus is None:
            continue
        alg = bus / bus_bandwidth_factor(n)
        for s in sizes_bytes:
            rows.append({"world_size": n, "size_bytes": s, "size": size_label(s), "links_per_gpu":
                         topology.nvlinks_per_gpu(n), "peak_busbw_GBps": bus, "peak_algbw_GBps": alg,
                         "min_time_ms": s / (alg * 1e9) * 1e3})
    return rows


def ring_allreduce_seconds(size_bytes: Any, world_size: int, alpha_s: float, bandwidth_Bps: float) -> Any:
    """The latency-bandwidth (alpha-beta) time of a ring all-reduce of ``size_bytes`` per rank over
    ``world_size`` ranks: ``2(p-1)`` steps of latency ``alpha`` each, and every rank sends and receives
    ``2(p-1)/p`` of the data over a link of ``bandwidth_Bps`` (Thakur et al., 2005; NCCL's ring)."""
    p = world_size
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * size_bytes / bandwidth_Bps


def fit_alpha_beta(df: Any) -> Any:
    """Fit :func:`ring_allreduce_seconds` to the measured times of each (backend, process count), by least
    squares on the *relative* error (so the 1 MB points count as much as the 1 GB ones).

    Returns one row per group: ``alpha_us`` (per-step latency), ``bandwidth_GBps`` (the per-rank link
    bandwidth the ring sees), the fitted time of each size's extremes, and the worst relative error of the
    fit over the measured points with the size where it occurs."""
    import numpy as np
    import pandas as pd

    rows = []
    for (backend, p), sub in df.groupby(["backend", "world_size"]):
        p = int(p)
        if p < 2 or len(sub) < 2:
            continue
        n = sub["size_bytes"].to_numpy(float)
        t = sub["time_ms"].to_numpy(float) * 1e-3
        # t = a + b n with a = 2(p-1) alpha, b = 2(p-1) / (p B); weights 1/t make the residuals relative.
        design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
        (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
        if a <= 0 or b <= 0:  # no latency or bandwidth visible in these points: no meaningful fit
            continue
        alpha, bandwidth = a / (2 * (p - 1)), 2 * (p - 1) / (p * b)
        errors = np.abs(ring_allreduce_seconds(n, p, alpha, bandwidth) - t) / t
        rows.append({"backend": backend, "world_size": p, "alpha_us": alpha * 1e6, "bandwidth_GBps": bandwidth / 1e9,
                     "points": len(sub), "max_rel_error": float(errors.max()),
                     "worst_size": size_label(int(n[int(errors.argmax())]))})
    return pd.DataFrame(rows, columns=["backend", "world_size", "alpha_us", "bandwidth_GBps", "points",
                                       "max_rel_error", "worst_size"])


def plot_alpha_beta(df: Any, fit: Any, theory: Any = None) -> Any:
    """Measured all-reduce time against the fitted alpha-beta model (solid) and, for NCCL, the link
    specification's bandwidth with the fitted latency (dashed), one panel per process count."""
    import matplotlib.pyplot as plt
    import numpy as np

    groups = fit[["backend", "world_size"]].drop_duplicates().sort_values(["world_size", "backend"])
    sizes = list(groups["world_size"].drop_duplicates())
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4), squeeze=False, sharey=True)
    colors = {"nccl": "tab:green", "gloo": "tab:blue"}
    for ax, p in zip(axes[0], sizes):
        for _, g in fit[fit["world_size"] == p].iterrows():
            sub = df[(df["backend"] == g["backend"]) & (df["world_size"] == p)]
            grid = np.geomspace(sub["size_bytes"].min(), sub["size_bytes"].max(), 100)
            color = colors.get(g["backend"], "gray")
            ax.plot(sub["size_bytes"], sub["time_ms"], "o", color=color, label=f"{g['backend']} measured")
            model = ring_allreduce_seconds(grid, p, g["alpha_us"] * 1e-6, g["bandwidth_GBps"] * 1e9) * 1e3
            ax.plot(grid, model, "-", color=color, lw=1,
                    label=f"fit: α = {g['alpha_us']:.3g} µs, B = {g['bandwidth_GBps']:.3g} GB/s")
            if g["backend"] == "nccl" and theory is not None and len(theory[theory["world_size"] == p]):
                peak = float(theory.loc[theory["world_size"] == p, "peak_algbw_GBps"].iloc[0])
                link = peak * 2 * (p - 1) / p  # the per-rank link rate behind that algorithm bandwidth
                spec = ring_allreduce_seconds(grid, p, g["alpha_us"] * 1e-6, link * 1e9) * 1e3
                ax.plot(grid, spec, "--", color="gray", lw=1, label=f"link spec {link:.0f} GB/s, fitted α")
        ax.set(xscale="log", yscale="log", xlabel="message size per rank (bytes)", title=f"{p} processes")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("all-reduce time (ms)")
    fig.tight_layout()
    return fig


def plot_bandwidth(df: Any, theory: Any = None, metric: str = "busbw_GBps") -> Any:
    """Bandwidth vs message size, one curve per process count, one panel per backend, with the
    topology's peak as dashed lines (NCCL panel)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    backends = sorted(df["backend"].unique(), key=lambda b: b != "nccl")
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4.2), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        sub = df[df["backend"] == backend]
        sns.lineplot(data=sub, x="size_bytes", y=metric, hue="world_size", marker="o", palette="viridis", ax=ax)
        if backend == "nccl" and theory is not None and len(theory):
            peak = "peak_busbw_GBps" if metric == "busbw_GBps" else "peak_algbw_GBps"
            # One dashed line per distinct peak (behind an NVSwitch every n shares the same one).
            peaks = theory.groupby("world_size")[peak].first()
            for value, ns in peaks.groupby(peaks).groups.items():
                ax.axhline(value, ls="--", lw=1, color="gray")
                label = ", ".join(str(n) for n in ns)
                ax.annotate(f"NVLink peak {value:.0f} GB/s (n = {label})", (sub["size_bytes"].min(), value),
                            fontsize=8, va="bottom", color="gray")
        ax.set_xscale("log")
        ax.set_xlabel("message size per rank (bytes, fp32)")
        ax.set_ylabel("bus bandwidth (GB/s)" if metric == "busbw_GBps" else "algorithm bandwidth (GB/s)")
        ax.set_title(f"all-reduce, {backend} ({sub['device'].iloc[0]})")
        ax.legend(title="processes")
    fig.tight_layout()
    return fig


def merge_rows(old: Any, new: Any) -> Any:
    """Append new measurements, replacing older rows for the same (backend, world_size, size)."""
    import pandas as pd

    if old is None or not len(old):
        return new.reset_index(drop=True)
    key = ["backend", "world_size", "size_bytes"]
    merged = pd.concat([old, new], ignore_index=True).drop_duplicates(subset=key, keep="last")
    return merged.sort_values(key).reset_index(drop=True)


def write_results(rows: list[dict[str, Any]], topology: Topology, params: dict[str, Any], append: bool) -> Any:
    """Table ``allreduce`` (+ ``allreduce_theory``), JSON ``topology`` and figure ``allreduce_bandwidth``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from cs336_systems.results import ResultWriter

    out = ResultWriter(SECTION, params=params)
    new = pd.DataFrame(rows)
    old = pd.read_csv(out.path("allreduce.csv")) if append and out.path("allreduce.csv").exists() else None
    df = merge_rows(old, new)
    out.table(df, "allreduce")
    world_sizes = sorted(df.loc[df["backend"] == "nccl", "world_size"].unique().tolist())
    theory = pd.DataFrame(theoretical_rows(topology, world_sizes, sorted(df["size_bytes"].unique().tolist())))
    if len(theory):
        out.table(theory, "allreduce_theory")
    out.json({**asdict(topology), "peak_busbw_GBps": {n: topology.peak_busbw_gbps(n) for n in world_sizes}}, "topology")
    fig = plot_bandwidth(df, theory if len(theory) else None)
    out.figure(fig, "allreduce_bandwidth")
    plt.close(fig)
    _write_alpha_beta(out, df, theory, source=None)
    print(df.to_string(index=False))
    if not topology.available or not len(theory):
        print(f"theoretical curve omitted: {topology.note}")
    print(out.banner())
    return df


def rederive_theory(publish: bool = False) -> Any:
    """Recompute the theoretical curve and the figure from committed results (``allreduce`` table and
    the ``topology`` text captured on the measuring machine), without GPUs, into ``.scratch/figures/``
    or, with ``publish``, beside the measurements. The measured table is left untouched; the derived
    artefacts carry the measuring run's provenance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from cs336_systems.results import ResultWriter, load_json, load_meta, load_table

    df = load_table(SECTION, "allreduce")
    saved = load_json(SECTION, "topology")
    source = load_meta(SECTION, "allreduce")
    topology = Topology(
        saved["available"], saved["text"], saved["gpu_name"], parse_topology_matrix(saved["text"]),
        saved["gbps_per_link"], f"{saved['gbps_per_link']:g} GB/s per NVLink per direction",
    )
    out = ResultWriter(SECTION, params=source.get("params", {}), smoke=False, publish=publish)
    world_sizes = sorted(df.loc[df["backend"] == "nccl", "world_size"].unique().tolist())
    theory = pd.DataFrame(theoretical_rows(topology, world_sizes, sorted(df["size_bytes"].unique().tolist())))
    if len(theory):
        out.table(theory, "allreduce_theory", source=source)
    peaks = {n: topology.peak_busbw_gbps(n) for n in world_sizes}
    out.json({**asdict(topology), "peak_busbw_GBps": peaks}, "topology", source=source)
    fig = plot_bandwidth(df, theory if len(theory) else None)
    out.figure(fig, "allreduce_bandwidth", source=source)
    plt.close(fig)
    _write_alpha_beta(out, df, theory, source=source)
    return theory


def _write_alpha_beta(out: Any, df: Any, theory: Any, source: dict[str, Any] | None) -> None:
    """Table ``allreduce_alpha_beta`` and its figure: the latency-bandwidth model fitted to ``df``."""
    import matplotlib.pyplot as plt

    fit = fit_alpha_beta(df)
    if not len(fit):
        return
    out.table(fit, "allreduce_alpha_beta", source=source)
    fig = plot_alpha_beta(df, fit, theory if theory is not None and len(theory) else None)
    out.figure(fig, "allreduce_alpha_beta", source=source)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.results import is_smoke_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", choices=["nccl", "gloo"], default=None,
                        help="default: nccl and gloo with GPUs, gloo without")
    parser.add_argument("--nproc", nargs="+", type=int, default=[2, 4],
                        help="process counts to spawn locally (ignored under torchrun/srun)")
    parser.add_argument("--sizes", nargs="+", default=None, help=f"default {DEFAULT_SIZES} ({SMOKE_SIZES} in smoke runs)")
    parser.add_argument("--gloo-max-size", default="1GB", help="skip gloo sizes above this (CPU all-reduce of 1 GB is slow)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--gbps-per-link", type=float, default=None, help="override NVLink GB/s per link and direction")
    parser.add_argument("--append", action="store_true", help="merge into an existing allreduce table")
    parser.add_argument("--rederive", action="store_true",
                        help="no measurement: recompute the theoretical curve and figure from committed results "
                             "(into .scratch/figures/; with --publish into figures/)")
    parser.add_argument("--publish", action="store_true", help="with --rederive: write into figures/")
    args = parser.parse_args(argv)
    if args.publish and not args.rederive:
        parser.error("--publish goes with --rederive (a measured run always writes its results)")
    if args.rederive:
        print(rederive_theory(publish=args.publish).to_string(index=False))
        return 0

    smoke = is_smoke_run()
    sizes = [parse_size(s) for s in (args.sizes or (SMOKE_SIZES if smoke else DEFAULT_SIZES))]
    backends = args.backends or (["nccl", "gloo"] if torch.cuda.is_available() else ["gloo"])
    gloo_max = parse_size(args.gloo_max_size)
    params = {"sizes": sizes, "backends": backends, "warmup": args.warmup, "iters": args.iters}

    rows: list[dict[str, Any]] = []
    if runner.launched_externally():
        # torchrun / srun: the launcher fixed the process count; one backend per job.
        if len(backends) != 1:
            parser.error("under torchrun/srun pass exactly one --backends value")
        bsizes = [s for s in sizes if backends[0] == "nccl" or s <= gloo_max]
        rows = runner.run_on_ranks(benchmark_worker, 0, bsizes, args.warmup, args.iters, backend=backends[0])[0]
        if not runner.is_main_process():
            return 0
    else:
        for backend in backends:
            for n in args.nproc:
                bsizes = [s for s in sizes if backend == "nccl" or s <= gloo_max]
                print(f"all-reduce: {backend}, {n} processes, sizes {[size_label(s) for s in bsizes]}", flush=True)
                rows += run_allreduce_benchmark(backend, n, bsizes, args.warmup, args.iters)
    write_results(rows, read_topology(args.gbps_per_link), {**params, "nproc": sorted({r["world_size"] for r in rows})},
                  args.append)
    return 0


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.distributed.allreduce"))
