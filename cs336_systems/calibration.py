"""The machine a GPU result was measured on, measured too: calibration at the start and end of every job.

Two results of the same configuration can disagree because one job ran on a slow GPU (a throttled card, a
busy neighbour, a degraded link) and nothing said so. So every GPU job measures its GPUs before it
starts and after it ends, for a few seconds each:

- ``bf16_matmul_tflops``: an 8192³ bf16 matmul (tensor cores, the compute most measurements lean on);
- ``fp32_matmul_tflops``: a 4096³ fp32 matmul at ``"highest"`` precision (the FP32 units);
- ``hbm_copy_tbps``: a 1 GiB device-to-device copy, bytes read plus written per second (HBM bandwidth).

Each is the median of repeated timings with CUDA events, measured in a subprocess of its own so the job
keeps no CUDA context or memory of it, one GPU after another, each after half a second of the same work
(:data:`METHOD`, ``sustained``). Timed after only three calls (``burst``, the records before the method was
recorded), the GPU measured second in a process read 5-11% low in fp32 on 2 × H200, whichever GPU it was;
held for half a second, a bf16 matmul runs at the power limit's clocks, about 15% under its burst
(``docs/benchmarking/NOTES.md``). So a reading is judged against the reference of its own method. The numbers
go into every result's provenance (``calibration: {method, start: [...], end: [...]}``, one entry per GPU), and
:func:`verdict` compares them with the device model's reference (``figures/calibration_reference.json``,
the median of calibrations on machines that behaved): a job whose GPU measured more than
:data:`SUSPECT_BELOW` under the reference at its start or end is *suspect*, which ``writeup status`` and
the writeup say until the result is measured again.

    python -m cs336_systems.benchmarking calibrate              # this machine's GPUs, as JSON
    python -m cs336_systems.benchmarking calibrate --reference  # against the reference, one line per GPU
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cs336_systems.measured_code import REPO_ROOT

#: Metric -> what a reader calls it.
METRICS = {"bf16_matmul_tflops": "bf16 matmul", "fp32_matmul_tflops": "fp32 matmul", "hbm_copy_tbps": "HBM copy"}
#: How a calibration is measured, recorded with it: ``sustained`` (each metric after :data:`_WARM_S` of the same
#: work); records without a method were measured ``burst`` (after three calls), against references of their own.
METHOD, LEGACY_METHOD = "sustained", "burst"
#: A GPU measuring more than this fraction below its reference makes the job's results suspect.
SUSPECT_BELOW = 0.10
REFERENCE_PATH = REPO_ROOT / "figures" / "calibration_reference.json"
_MATMUL_BF16_N, _MATMUL_FP32_N, _COPY_BYTES, _REPEATS, _WARM_S = 8192, 4096, 2**30, 15, 0.5


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


def _median_ms(fn: Any, device: Any, repeats: int = _REPEATS, warm_s: float = _WARM_S) -> float:
    import torch

    # busy the GPU for warm_s first (the module docstring says why): what is timed is the sustained rate
    start_s = time.perf_counter()
    while True:
        for _ in range(5):
            fn()
        torch.cuda.synchronize(device)
        if time.perf_counter() - start_s >= warm_s:
            break
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _matmul_tflops(n: int, dtype: Any, device: Any) -> float:
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (_median_ms(lambda: torch.mm(a, b), device) * 1e-3) / 1e12


def _copy_tbps(nbytes: int, device: Any) -> float:
    import torch

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_median_ms(lambda: dst.copy_(src), device) * 1e-3) / 1e12  # read + write


def measure_gpu(index: int) -> dict[str, Any]:
    """The three metrics of GPU ``index`` (see the module docstring)."""
    import torch

    device = torch.device("cuda", index)
    previous = torch.get_float32_matmul_precision()
    with torch.cuda.device(device):
        bf16 = _matmul_tflops(_MATMUL_BF16_N, torch.bfloat16, device)
        torch.set_float32_matmul_precision("highest")  # the FP32 units, not TF32 tensor cores
        try:
            fp32 = _matmul_tflops(_MATMUL_FP32_N, torch.float32, device)
        finally:
            torch.set_float32_matmul_precision(previous)
        copy = _copy_tbps(_COPY_BYTES, device)
        torch.cuda.empty_cache()
    return {"gpu": index, "device": torch.cuda.get_device_name(index), "bf16_matmul_tflops": round(bf16, 1),
            "fp32_matmul_tflops": round(fp32, 2), "hbm_copy_tbps": round(copy, 3)}


def measure_machine() -> list[dict[str, Any]]:
    """Every visible GPU, one after another (an empty list without GPUs)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [measure_gpu(i) for i in range(torch.cuda.device_count())]


def measure_in_subprocess(timeout_s: float = 180.0) -> list[dict[str, Any]] | None:
    """:func:`measure_machine` in a fresh process (the caller keeps no CUDA context or memory of it);
    ``None`` if it failed, with the reason on stderr: a calibration must never fail the job it describes."""
    cmd = [sys.executable, "-m", "cs336_systems.benchmarking", "calibrate"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except (subprocess.TimeoutExpired, OSError) as exc:
        print(f"calibration: no result ({exc})", file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"calibration: failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: a library may print before it
    except (ValueError, IndexError):
        print(f"calibration: unreadable output {proc.stdout[-200:]!r}", file=sys.stderr)
        return None


# --------------------------------------------------------------------------------------------------
# The job's record
# --------------------------------------------------------------------------------------------------


class JobCalibration:
    """This process's calibration: measured at :meth:`begin` (the job's start), again at :meth:`finish`,
    when every result sidecar written in between (:meth:`note_written`) gets both."""

    def __init__(self) -> None:
        self.start: list[dict[str, Any]] | None = None
        self.active = False
        self.written: list[Path] = []

    @staticmethod
    def wanted(smoke: bool) -> bool:
        """GPU jobs only, once per machine (rank 0 of a torchrun job; the parent of spawned ranks), and not
        where ``CS336_CALIBRATE=0`` (tests)."""
        if smoke or os.environ.get("CS336_CALIBRATE", "1") == "0" or os.environ.get("RANK", "0") != "0":
            return False
        import torch

        return torch.cuda.is_available()

    def begin(self, smoke: bool) -> None:
        """Measure the machine now, as a GPU job starts (a no-op when not wanted or already begun). At exit
        :meth:`finish` runs if nobody called it."""
        if self.active or not self.wanted(smoke):
            return
        self.active, self.written = True, []
        self.start = measure_in_subprocess()
        atexit.register(self.finish)

    def record(self) -> dict[str, Any] | None:
        """What a sidecar written now records (the start; the end comes at :meth:`finish`)."""
        return {"method": METHOD, "start": self.start} if self.active and self.start is not None else None

    def note_written(self, meta_path: Path) -> None:
        if self.active and meta_path not in self.written:
            self.written.append(meta_path)

    def finish(self) -> None:
        """Measure again and give every sidecar this job wrote both readings. Never raises: a calibration
        must not fail (or change the exit status of) the job it describes."""
        if not self.active:
            return
        start, written = self.start, self.written
        self.active, self.start, self.written = False, None, []
        atexit.unregister(self.finish)
        record = {"method": METHOD, "start": start, "end": measure_in_subprocess()}
        for path in written:
            try:
                meta = json.loads(path.read_text())
                held = meta.get("calibration") or {}
                if held.get("start") is not None and not same_job(held, record):
                    # Another job rewrote the table since (jobs side by side): its record stays on top. Where it
                    # merged this job's rows, this job's entry gets its end; where it replaced them, nothing here
                    # is this job's any more.
                    merged = held.get("merged") or []
                    if not any(same_job(m, record) for m in merged):
                        continue
                    held["merged"] = [{**m, "end": record["end"]} if same_job(m, record) else m for m in merged]
                    meta["calibration"] = held
                else:
                    merged = held.get("merged")
                    meta["calibration"] = record if merged is None else {**record, "merged": merged}
                path.write_text(json.dumps(meta, indent=2) + "\n")
            except (OSError, ValueError) as exc:
                print(f"calibration: could not record it in {path}: {exc}", file=sys.stderr)


JOB = JobCalibration()


def merged_records(record: dict[str, Any] | None, current: dict[str, Any] | None = None) -> list[dict[str, Any] | None]:
    """The calibrations behind a table that a job merges its rows into: the table's own record (None where its job
    was not calibrated) and the records that table had merged before, flattened. ``current``: this job's record
    (:meth:`JobCalibration.record`); a table this same job wrote before (a section that rewrites its table after
    every row) adds only what it had merged, not this job again."""
    if record is None:
        return [None]
    own = without_merged(record)
    earlier = list(record.get("merged") or [])
    if current is not None and same_job(own, current):
        return earlier
    return [own, *earlier]


def add_merged(merged: list[dict[str, Any] | None], record: dict[str, Any] | None,
               current: dict[str, Any] | None = None) -> None:
    """Append to ``merged`` the calibrations behind ``record`` (:func:`merged_records`) that it lacks, each job
    once: the one list a table that merges several jobs' rows keeps of their machines."""
    for earlier in merged_records(record, current):
        if not any(r == earlier or same_job(r, earlier) for r in merged):
            merged.append(earlier)


def same_job(record: dict[str, Any] | None, other: dict[str, Any] | None) -> bool:
    """Whether two records are one job's: the same method and the same start readings (the end comes later)."""
    return (record is not None and other is not None and record.get("start") is not None
            and (record.get("method"), record.get("start")) == (other.get("method"), other.get("start")))


def without_merged(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """``record`` without the earlier jobs it merged: the one job's own readings."""
    return None if record is None else {k: v for k, v in record.items() if k != "merged"}


# --------------------------------------------------------------------------------------------------
# Judging
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """``state``: ``calibrated``, ``suspect``, ``uncalibrated`` (measured before jobs calibrated, or the
    calibration failed), ``unreferenced`` (no reference for the device) or ``n/a`` (CPU, smoke);
    ``reason``: one line for people."""

    state: str
    reason: str = ""

    @property
    def suspect(self) -> bool:
        return self.state == "suspect"


def load_references(path: Path = REFERENCE_PATH) -> dict[str, dict[str, dict[str, float]]]:
    """Calibration method -> device name -> metric -> reference value (empty without the file)."""
    if not Path(path).is_file():
        return {}
    methods = json.loads(Path(path).read_text())["methods"]
    return {method: {name: entry["reference"] for name, entry in table["devices"].items()}
            for method, table in methods.items()}


def shortfalls(gpus: list[dict[str, Any]], references: dict[str, dict[str, float]]) -> list[str]:
    """Every GPU metric more than :data:`SUSPECT_BELOW` under its reference, in words."""
    out = []
    for gpu in gpus:
        reference = references.get(gpu.get("device", ""))
        for metric, label in METRICS.items():
            if reference and metric in reference and gpu.get(metric) is not None:
                ratio = gpu[metric] / reference[metric]
                if ratio < 1 - SUSPECT_BELOW:
                    out.append(f"GPU {gpu.get('gpu', '?')} {label} at {ratio:.0%} of its reference")
    return out


def verdict(meta: dict[str, Any], references: dict[str, dict[str, dict[str, float]]] | None = None) -> Verdict:
    """Whether the machine behind a result was measured, and how it compared with the reference of the record's
    own method (``references`` as :func:`load_references` returns them; by default the committed ones)."""
    if meta.get("smoke") or meta.get("device_type") != "cuda":
        return Verdict("n/a")
    record = meta.get("calibration")
    if not record or not record.get("start"):
        return Verdict("uncalibrated", "the machine was not calibrated")
    merged = record.get("merged") or []
    all_references = load_references() if references is None else references
    problems, unreferenced = [], None
    # A slow machine is said first, whatever else is true of the other jobs: it is what the reader must know.
    for job, one in enumerate([record, *merged]):  # this job, then the jobs whose rows it merged
        if not one or not one.get("start"):
            continue
        method = one.get("method", LEGACY_METHOD)
        references_now = all_references.get(method, {})
        measured = [gpu for phase in ("start", "end") for gpu in (one.get(phase) or [])]
        if not any(gpu.get("device") in references_now for gpu in measured):
            unreferenced = unreferenced or f"no {method} calibration reference for {meta.get('device')}"
            continue
        which = "the job's" if job == 0 else "a merged job's"
        for phase in ("start", "end"):
            problems += [f"{p} at {which} {phase}" for p in shortfalls(one.get(phase) or [], references_now)]
    if not problems and unreferenced:
        return Verdict("unreferenced", unreferenced)
    if not problems and any(not one or not one.get("start") for one in merged):
        return Verdict("uncalibrated", "an earlier job whose rows this table merges was not calibrated")
    if problems:
        return Verdict("suspect", "; ".join(problems[:2]) + (f" (+{len(problems) - 2} more)" if len(problems) > 2 else ""))
    return Verdict("calibrated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This tool's options: ``python -m cs336_systems.benchmarking calibrate --help``."""
    parser.add_argument("--reference", action="store_true",
                        help="compare with the device's reference, one line per GPU (default: the readings as JSON)")


def run_command(args: argparse.Namespace) -> int:
    gpus = measure_machine()
    if not args.reference:
        print(json.dumps(gpus))
        return 0
    if not gpus:
        print("no CUDA GPU here: nothing to calibrate")
        return 0
    references = load_references().get(METHOD, {})
    for gpu in gpus:
        reference = references.get(gpu["device"], {})
        cells = [f"{label} {gpu[m]:g}" + (f" ({gpu[m] / reference[m]:.0%} of reference)" if m in reference else "")
                 for m, label in METRICS.items()]
        print(f"GPU {gpu['gpu']} {gpu['device']}: " + ", ".join(cells))
    problems = shortfalls(gpus, references)
    print("suspect: " + "; ".join(problems) if problems else f"every GPU within {SUSPECT_BELOW:.0%} of its reference")
    return 1 if problems else 0
