"""All-reduce benchmark (§2.1): time, algorithm bandwidth and bus bandwidth of fp32 all-reduce for
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

Problem ``distributed_communication_single_node``. Run::

    python -m cs336_systems.experiments distributed_communication_single_node --set nproc=2,4,6
    torchrun --nproc-per-node 8 -m cs336_systems.experiments.distributed_communication_single_node --set backends=nccl --set append=true
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems.benchmarking.allreduce import (
    DEFAULT_SIZES,
    SMOKE_SIZES,
    benchmark_worker,
    bus_bandwidth_factor,
    parse_size,
    run_allreduce_benchmark,
    size_label,
)
from cs336_systems.distributed import runner
from cs336_systems.experiments.section import Section, param
from cs336_systems.derived import Derived
from cs336_systems.report import fmt
from cs336_systems.report.answers import join_words, question
from cs336_systems.report.data import SectionData
from cs336_systems.report.document import BEYOND_HANDOUT, Block, Text
from cs336_systems.results import ResultWriter

SECTION_NAME = "distributed_communication_single_node"


#: Unidirectional bandwidth of one NVLink, GB/s, by GPU generation (NVLink 2, 3 and 4 all move 25 GB/s
#: per link and direction; NVLink 5 doubles it). Matched against the device name.
NVLINK_GBPS_PER_LINK = {"B200": 50.0, "GB200": 50.0, "B100": 50.0, "H200": 25.0, "H100": 25.0, "H800": 25.0,
                        "A100": 25.0, "A800": 25.0, "V100": 25.0}
DEFAULT_NVLINK_GBPS = 25.0
#: The most NVLinks any GPU has (Hopper and Blackwell: 18).
MAX_NVLINKS_PER_GPU = 18


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
    if old is None or not len(old):
        return new.reset_index(drop=True)
    key = ["backend", "world_size", "size_bytes"]
    merged = pd.concat([old, new], ignore_index=True).drop_duplicates(subset=key, keep="last")
    return merged.sort_values(key).reset_index(drop=True)


def write_measurements(out: ResultWriter, rows: list[dict[str, Any]], topology: Topology, append: bool) -> Any:
    """The measured table ``allreduce`` (merged into the existing one with ``append``) and the ``topology``
    the measuring machine reported."""
    new = pd.DataFrame(rows)
    old = pd.read_csv(out.path("allreduce.csv")) if append and out.path("allreduce.csv").exists() else None
    df = merge_rows(old, new)
    out.table(df, "allreduce")
    world_sizes = sorted(df.loc[df["backend"] == "nccl", "world_size"].unique().tolist())
    out.json({**asdict(topology), "peak_busbw_GBps": {n: topology.peak_busbw_gbps(n) for n in world_sizes}}, "topology")
    print(df.to_string(index=False))
    if not topology.available:
        print(f"theoretical curve omitted: {topology.note}")
    return df


def derive(tables: dict[str, Any], meta: dict[str, Any]) -> Derived:
    """From the measured table and topology: the theoretical curve, the bandwidth figure and the α–β fit."""
    df, saved = tables["allreduce"], tables.get("topology")
    theory = pd.DataFrame()
    if saved:
        topology = Topology(
            saved["available"], saved["text"], saved["gpu_name"], parse_topology_matrix(saved["text"]),
            saved["gbps_per_link"], f"{saved['gbps_per_link']:g} GB/s per NVLink per direction",
        )
        world_sizes = sorted(df.loc[df["backend"] == "nccl", "world_size"].unique().tolist())
        theory = pd.DataFrame(theoretical_rows(topology, world_sizes, sorted(df["size_bytes"].unique().tolist())))
    derived = Derived(figures={"allreduce_bandwidth": (plot_bandwidth(df, theory if len(theory) else None), "allreduce")})
    if len(theory):
        derived.tables["allreduce_theory"] = (theory, "allreduce")
    fit = fit_alpha_beta(df)
    if len(fit):
        derived.tables["allreduce_alpha_beta"] = (fit, "allreduce")
        derived.figures["allreduce_alpha_beta"] = (plot_alpha_beta(df, fit, theory if len(theory) else None), "allreduce")
    return derived


# --------------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    backends: list[str] = param(["nccl", "gloo"], "nccl (GPUs) and/or gloo (CPU processes)")
    nproc: list[int] = param([2, 4, 6], "process counts; NCCL counts above the GPUs present are skipped")
    sizes: list[str] = param(DEFAULT_SIZES, "message sizes per rank (decimal units: 1MB = 10^6 bytes)")
    gloo_max_size: str = param("1GB", "skip gloo sizes above this (a CPU all-reduce of 1 GB is slow)")
    warmup: int | None = param(None, "untimed all-reduces per size (None: by size and backend)")
    iters: int | None = param(None, "timed all-reduces per size (None: by size and backend)")
    gbps_per_link: float | None = param(None, "NVLink GB/s per link and direction (None: by GPU generation)")
    append: bool = param(False, "merge into the existing table instead of replacing it")

    def check(self) -> None:
        bad = [b for b in self.backends if b not in ("nccl", "gloo")]
        if bad:
            raise ValueError(f"backends must be nccl or gloo, got {bad[0]!r}")
        if any(n < 2 for n in self.nproc):
            raise ValueError(f"an all-reduce needs at least 2 processes, got nproc={self.nproc}")
        for size in (*self.sizes, self.gloo_max_size):
            parse_size(size)


PRESETS = {
    "full": Params(),
    "quick": Params(nproc=[2, 4]),
    "smoke": Params(backends=["gloo"], nproc=[2], sizes=SMOKE_SIZES),
}


def run(p: Params, out: ResultWriter) -> Any:
    """Spawn each (backend, process count) in turn on this machine and time every size."""
    sizes, gloo_max = [parse_size(s) for s in p.sizes], parse_size(p.gloo_max_size)
    rows: list[dict[str, Any]] = []
    for backend in p.backends:
        for n in p.nproc:
            if backend == "nccl" and n > torch.cuda.device_count():
                print(f"skipping nccl with {n} processes: {torch.cuda.device_count()} GPUs here")
                continue
            bsizes = [s for s in sizes if backend == "nccl" or s <= gloo_max]
            print(f"all-reduce: {backend}, {n} processes, sizes {[size_label(s) for s in bsizes]}", flush=True)
            rows += run_allreduce_benchmark(backend, n, bsizes, p.warmup, p.iters)
    if not rows:
        raise ValueError("no (backend, process count) could run here")
    return write_measurements(out, rows, read_topology(p.gbps_per_link), p.append)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The torchrun / srun form, with the section's own options::

        torchrun --nproc-per-node 2 -m cs336_systems.experiments.distributed_communication_single_node --set backends=nccl

    The launcher fixes the process count, so one backend a job; without a launcher this is the section's run
    (``python -m cs336_systems.experiments distributed_communication_single_node``)."""
    from cs336_systems.experiments.__main__ import build_parser, run_section

    args = build_parser().parse_args([SECTION_NAME, *(sys.argv[1:] if argv is None else argv)])
    overrides = dict(args.set)
    if not runner.launched_externally():
        return run_section(SECTION_NAME, args.preset, overrides, publish=args.publish)
    p = SECTION.params("full", {"backends": ["nccl"], **overrides})
    if len(p.backends) != 1:
        raise ValueError("under torchrun/srun pass exactly one backend: --set backends=nccl (or gloo)")
    sizes = [s for s in map(parse_size, p.sizes) if p.backends[0] == "nccl" or s <= parse_size(p.gloo_max_size)]
    rows = runner.run_on_ranks(benchmark_worker, 0, sizes, p.warmup, p.iters, backend=p.backends[0])[0]
    if runner.is_main_process():
        out = ResultWriter(SECTION_NAME, params=asdict(p))
        write_measurements(out, rows, read_topology(p.gbps_per_link), p.append)
        SECTION.rederive(out)
        print(out.banner())
    return 0


# === Answers: formatting only; changes below this line do not make results stale ===


def _edition_flag(d: SectionData) -> str:
    """`` --edition E`` where ``d`` is an edition's grid (``<name>/<edition>``), else empty."""
    _, _, edition = d.folder.partition("/")
    return f" --edition {edition}" if edition else ""


def _prompt(d: SectionData) -> str:
    """The question as this grid asks it: its backends and process counts (2025: Gloo and NCCL on 2, 4 and 6
    processes; CSE599-O: NCCL on 2, 4 and 8 GPUs)."""
    params = d.meta("allreduce").get("params") or {}
    backends = params.get("backends") or ["gloo", "nccl"]
    names = {"gloo": "Gloo (CPU)", "nccl": "NCCL (GPU)"}
    counts = params.get("nproc") or [2, 4, 6]
    return (f"All-reduce latency for {join_words([names.get(b, b) for b in backends])}, 1 MB–1 GB of float32, "
            f"{join_words([str(n) for n in counts])} processes.")


def _interaction(df: pd.DataFrame) -> str:
    """How the process count interacts with the message size: NCCL's time at the smallest size and bus bandwidth
    at the largest, fewest ranks against most; Gloo's bus bandwidth at the largest size by rank count."""
    if "busbw_GBps" not in df.columns:
        return ""

    def label(size_bytes: int) -> str:
        row = df[df["size_bytes"] == size_bytes].iloc[0]
        return str(row["size"]) if "size" in df.columns else fmt.sig(size_bytes)

    parts = []
    nccl = df[df["backend"] == "nccl"]
    if nccl["world_size"].nunique() > 1:
        small, large = nccl["size_bytes"].min(), nccl["size_bytes"].max()
        few, many = nccl["world_size"].min(), nccl["world_size"].max()

        def at(size_bytes: int, ranks: int, column: str) -> float:
            return float(nccl.loc[(nccl["size_bytes"] == size_bytes) & (nccl["world_size"] == ranks), column].mean())

        t_few, t_many = at(small, few, "time_ms"), at(small, many, "time_ms")
        b_few, b_many = at(large, few, "busbw_GBps"), at(large, many, "busbw_GBps")
        parts.append(f"for NCCL, {int(many)} ranks are {'slower' if t_many > t_few else 'faster'} than {int(few)} at "
                     f"{label(small)} ({fmt.sig(1e3 * t_many)} µs against {fmt.sig(1e3 * t_few)} µs), while at {label(large)} they reach "
                     f"{'more' if b_many > b_few else 'less'} bus bandwidth ({fmt.sig(b_many)} GB/s against "
                     f"{fmt.sig(b_few)} GB/s)")
    gloo = df[(df["backend"] == "gloo") & (df["size_bytes"] == df.loc[df["backend"] == "gloo", "size_bytes"].max())]
    if gloo["world_size"].nunique() > 1:
        bw = gloo.groupby("world_size")["busbw_GBps"].mean()
        trend = ("falls" if bw.is_monotonic_decreasing else "rises" if bw.is_monotonic_increasing else
                 "goes, not monotonically,")
        parts.append(f"Gloo's bus bandwidth at {label(gloo['size_bytes'].iloc[0])} {trend} from "
                     f"{fmt.sig(bw.iloc[0])} GB/s with {int(bw.index[0])} ranks to {fmt.sig(bw.iloc[-1])} GB/s with "
                     f"{int(bw.index[-1])}")
    if not parts:
        return ""
    return ", and the process count interacts with the message size: " + "; ".join(parts)


def _per_call(d: SectionData, world_size: int) -> str:
    """The fit as the DDP sections quote it, a cost per call and a rate (``ddp_common.published_fit``, the one
    conversion), where they use this world size's fit."""
    from cs336_systems.experiments.ddp_common import published_fit

    fit = published_fit(d, "nccl", world_size) if world_size == 2 else None  # the DDP sections run on 2 GPUs
    if fit is None:
        return ""
    return (f", which later sections use as a cost per call $o = 2(p-1)\\,\\alpha$ = {fmt.sig(fit['o'] * 1e6)} µs "
            f"and a rate $w = \\frac{{p}}{{2(p-1)}}B$ = {fmt.sig(fit['w'] / 1e9)} GB/s")


def answer(d: SectionData) -> list[Block]:
    df = d.frame("allreduce")
    text = more = reference = None
    if df is not None and {"backend", "world_size", "size_bytes", "time_ms"} <= set(df.columns) and len(df):
        parts = []
        big = df[df["size_bytes"] == df["size_bytes"].max()]
        for _, r in big.sort_values(["backend", "world_size"]).iterrows():
            bw = f" ({fmt.sig(r['busbw_GBps'])} GB/s bus bandwidth)" if "busbw_GBps" in r and pd.notna(r["busbw_GBps"]) else ""
            parts.append(f"{r['backend']} with {int(r['world_size'])} processes {fmt.ms(r['time_ms'])}{bw}")
        size = big["size"].iloc[0] if "size" in big.columns else fmt.sig(big["size_bytes"].iloc[0])
        lead = f"All-reducing {size}: " + join_words(parts)
        both = big[big["world_size"] == big["world_size"].min()].set_index("backend")
        if {"nccl", "gloo"} <= set(both.index):  # (the handout's 2-3 sentences: every cell is the table's)
            nccl_row, gloo_row = both.loc["nccl"], both.loc["gloo"]
            bw = (f" ({fmt.sig(nccl_row['busbw_GBps'])} GB/s bus bandwidth)" if "busbw_GBps" in both.columns
                  and pd.notna(nccl_row["busbw_GBps"]) else "")
            lead = (f"At {size}, NCCL with {int(big['world_size'].min())} processes takes {fmt.ms(nccl_row['time_ms'])}"
                    f"{bw}, {fmt.ratio(gloo_row['time_ms'] / nccl_row['time_ms'])} faster than Gloo's "
                    f"{fmt.ms(gloo_row['time_ms'])}: it reduces in GPU memory over NVLink, Gloo through host memory on "
                    "the CPU")
        meta = d.meta("allreduce")
        asked = meta.get("params", {}).get("nproc") or []
        missing = [n for n in asked if n not in set(df.loc[df["backend"] == "nccl", "world_size"])]
        if missing and "nccl" in set(df["backend"]):
            lead += (f"; **not measured: NCCL with {join_words([str(n) for n in missing])} processes** (the machine "
                     f"had {meta.get('num_gpus', '?')} GPUs, and an NCCL rank needs a GPU of its own)")
            more = (f"`python -m cs336_systems.experiments {SECTION_NAME} --full{_edition_flag(d)}` on a node with "
                    f"{max(missing)} GPUs adds the process counts not measured.")
        topo = d.json("topology")
        peak = (topo or {}).get("peak_busbw_GBps") or {}
        nccl = big[big["backend"] == "nccl"] if "busbw_GBps" in big.columns else big.iloc[0:0]
        if isinstance(topo, dict) and topo.get("links") and len(nccl):
            r = nccl.sort_values("world_size").iloc[0]
            top = peak.get(str(int(r["world_size"])))
            link = topo["links"].get("0-1") or sorted(set(topo["links"].values()))[0]  # the first two ranks' link
            if top:  # the handout's reference curve, derived where the answer shows it
                reference = (f"`nvidia-smi topo -m` shows {link} between the GPUs (bonded NVLinks of "
                             f"{fmt.sig(topo.get('gbps_per_link', 0))} GB/s per direction each), so the reference "
                             f"curve is {fmt.sig(top)} GB/s of bus bandwidth, of which {int(r['world_size'])} ranks "
                             f"reach {fmt.pct(r['busbw_GBps'] / top)} at {size}")
        text = Text(lead + ". Small messages are latency bound (their time grows far more slowly than their size), "
                    "large ones bandwidth bound" + _interaction(df) + ".")
        more = (f"All-reducing {size}: " + join_words(parts) + ". Bus bandwidth, which scales the rate by the "
                "$2(n-1)/n$ of the data a ring all-reduce moves per rank, makes process counts comparable. "
                + (more or "")).strip()
    fit = d.frame("allreduce_alpha_beta")
    fit_text = None
    if fit is not None and len(fit) and {"backend", "world_size", "alpha_us", "bandwidth_GBps"} <= set(fit.columns):
        used = fit[(fit["backend"] == "nccl") & (fit["world_size"] == fit["world_size"].min())]
        if len(used) and text is not None:  # the fit later sections cite, where a reader of this answer finds it
            r = used.iloc[0]
            text = Text(text.markdown + " Fitted to $t = 2(p-1)\\,\\alpha + 2\\frac{p-1}{p}\\,\\frac{n}{B}$ (a ring "
                        "all-reduce of $n$ bytes per rank over $p$ ranks: $2(p-1)$ latency steps of $\\alpha$, and "
                        "$2(p-1)/p$ of the data through each rank's link of bandwidth $B$), NCCL "
                        f"with {int(r['world_size'])} processes gives $\\alpha$ = {fmt.sig(r['alpha_us'])} µs per ring "
                        f"step and $B$ = {fmt.sig(r['bandwidth_GBps'])} GB/s"
                        + _per_call(d, int(r["world_size"]))
                        + (f"; {reference}." if reference else "."))
            reference = None  # folded into the fit's sentence: no block of its own
        parts = [f"{r['backend']} with {int(r['world_size'])} processes $\\alpha$ = {fmt.sig(r['alpha_us'])} µs and "
                 f"$B$ = {fmt.sig(r['bandwidth_GBps'])} GB/s (worst at {r.get('worst_size', '?')}, "
                 f"{fmt.pct(r['max_rel_error'])} off)"
                 for _, r in fit.sort_values(["backend", "world_size"]).iterrows()]
        fit_text = Text("A ring all-reduce of $n$ bytes per rank over $p$ ranks takes "
                        "$t = 2(p-1)\\,\\alpha + 2\\frac{p-1}{p}\\,\\frac{n}{B}$ ($2(p-1)$ latency steps; each rank "
                        "sends and receives $2(p-1)/p$ of the data). Fitted to the measured points by least squares "
                        "on the relative error: " + join_words(parts) + ". One $\\alpha$–$B$ pair per process count is a "
                        "coarse model of NCCL, which changes algorithm and protocol with the message size, so the "
                        "misfit of the worst point is part of the answer; the dashed curve keeps the fitted latency "
                        "and takes $B$ from the link specification.")
    return [
        question(d, "distributed_communication_single_node", _prompt(d), [
                     text, Text(reference[0].upper() + reference[1:] + ".") if reference else None,
                     d.table("allreduce", caption="All-reduce time and bandwidth (algorithm bandwidth = bytes per "
                             "rank / time; bus bandwidth = algorithm bandwidth × 2(n−1)/n)."),
                     d.figure("allreduce_bandwidth", caption="All-reduce bus bandwidth by message size, backend and "
                              "process count (dashed: the topology's peak)."),
                 ], what="the all-reduce benchmark"),
        Text("", role=BEYOND_HANDOUT),  # the latency-bandwidth model the DDP sections use: the appendix
        *([question(d, "distributed_communication_single_node", "Bus bandwidth and the links' peak.",
                    [Text(more)])] if more else []),
        *([question(d, "distributed_communication_single_node", "Beyond the handout: a latency–bandwidth model of "
                    "the all-reduce, which the DDP sections use to predict their communication.", [
            fit_text,
            d.table("allreduce_alpha_beta", caption="Latency–bandwidth fit per backend and process count "
                    "(alpha per ring step, B per rank)."),
            d.figure("allreduce_alpha_beta", caption="All-reduce time against the latency–bandwidth model "
                     "fitted per process count (solid) and with the link specification's bandwidth (dashed)."),
        ])] if fit_text is not None else []),
    ]



SECTION = Section(
    name=SECTION_NAME, number="2.1", title="Single-node collective communication",
    problems=("distributed_communication_single_node",), answer=answer, presets=PRESETS, run=run, derive=derive,
    derive_inputs=("allreduce", "topology"), gpus=2,
    editions={"cse599o": {"backends": ["nccl"], "nproc": [2, 4, 8]}},  # its Problem 1: NCCL on 2, 4 and 8 GPUs
    depends=("cs336_systems/benchmarking/allreduce.py", "cs336_systems/distributed/launch.py",
             "cs336_systems/distributed/runner.py"),
)


if __name__ == "__main__":
    from cs336_systems.cli import run_main

    sys.exit(run_main(main, "python -m cs336_systems.experiments.distributed_communication_single_node"))
