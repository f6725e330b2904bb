"""All-reduce benchmark: bandwidth conventions, topology parsing, and a 2-rank gloo run of the CLI."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cs336_systems.experiments import distributed_communication_single_node as allreduce

HGX_H200_4 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tSYS\t0-63\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-63\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t64-127\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t64-127\t1\t\tN/A
NIC0\tSYS\tSYS\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""

DGX1_V100 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tCPU Affinity
GPU0\t X \tNV1\tNV1\tNV2\tSYS\t0-19
GPU1\tNV1\t X \tNV2\tNV1\tSYS\t0-19
GPU2\tNV1\tNV2\t X \tNV2\tSYS\t0-19
GPU3\tNV2\tNV1\tNV2\t X \tSYS\t0-19
GPU4\tSYS\tSYS\tSYS\tSYS\t X \t20-39
"""

A100_4_DIRECT = """\
\tGPU0\tGPU1\tGPU2\tGPU3
GPU0\t X \tNV4\tNV4\tNV4
GPU1\tNV4\t X \tNV4\tNV4
GPU2\tNV4\tNV4\t X \tNV4
GPU3\tNV4\tNV4\tNV4\t X 
"""


def _topology(text: str, gbps: float = 25.0) -> allreduce.Topology:
    return allreduce.Topology(True, text, None, allreduce.parse_topology_matrix(text), gbps, "")


def test_sizes_and_bus_factor() -> None:
    assert [allreduce.parse_size(s) for s in ["1MB", "10MB", "100MB", "1GB"]] == [10**6, 10**7, 10**8, 10**9]
    assert allreduce.parse_size("1MiB") == 2**20
    assert allreduce.size_label(10**9) == "1GB"
    with pytest.raises(ValueError):
        allreduce.parse_size("3 bytes please")
    with pytest.raises(ValueError, match="multiple of 4"):
        allreduce.parse_size("6")
    assert allreduce.bus_bandwidth_factor(2) == 1.0
    assert allreduce.bus_bandwidth_factor(4) == 1.5
    assert allreduce.bus_bandwidth_factor(8) == 1.75


def test_nvswitch_topology_gives_full_link_count() -> None:
    topo = _topology(HGX_H200_4)
    assert topo.links["0-3"] == "NV18" and topo.links["3-2"] == "NV18" and len(topo.links) == 12
    assert topo.nvlinks_per_gpu(2) == topo.nvlinks_per_gpu(4) == 18
    assert topo.peak_busbw_gbps(4) == 450.0  # 18 links x 25 GB/s
    assert topo.peak_algbw_gbps(4) == pytest.approx(300.0)  # 450 / (2 * 3/4)
    assert topo.peak_algbw_gbps(2) == pytest.approx(450.0)


def test_direct_nvlink_meshes_add_links_and_reject_pcie() -> None:
    mesh = _topology(DGX1_V100)
    assert mesh.nvlinks_per_gpu(2) == 1  # GPU0-GPU1 is NV1
    assert mesh.nvlinks_per_gpu(4) == 4  # GPU0: 1 + 1 + 2 (GPU2 and GPU3 have 5)
    assert mesh.nvlinks_per_gpu(5) is None  # GPU4 is only reachable over SYS
    assert _topology(A100_4_DIRECT).nvlinks_per_gpu(4) == 12  # 3 peers x NV4, no switch


def test_missing_nvidia_smi_degrades_gracefully(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allreduce.shutil, "which", lambda name: None)
    topo = allreduce.read_topology()
    assert not topo.available and "not found" in topo.note
    assert topo.peak_busbw_gbps(2) is None
    assert allreduce.theoretical_rows(topo, [2, 4], [10**6]) == []


def test_merge_replaces_remeasured_rows() -> None:
    old = pd.DataFrame({"backend": ["nccl", "nccl"], "world_size": [2, 4], "size_bytes": [1, 1], "time_ms": [1.0, 2.0]})
    new = pd.DataFrame({"backend": ["nccl", "nccl"], "world_size": [4, 8], "size_bytes": [1, 1], "time_ms": [3.0, 4.0]})
    merged = allreduce.merge_rows(old, new)
    assert merged["world_size"].tolist() == [2, 4, 8]
    assert merged["time_ms"].tolist() == [1.0, 3.0, 4.0]


def test_cli_gloo_two_ranks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("CS336_SMOKE", "1")
    assert allreduce.main(["--set", "backends=gloo", "--set", "nproc=2", "--set", "sizes=4KB,400KB"]) == 0
    section = tmp_path / allreduce.SECTION_NAME
    df = pd.read_csv(section / "allreduce.csv")
    assert df["size_bytes"].tolist() == [4000, 400000]
    assert (df["world_size"] == 2).all() and (df["backend"] == "gloo").all()
    assert (df["time_ms"] > 0).all()
    assert df["algbw_GBps"].tolist() == pytest.approx((df["size_bytes"] / df["time_ms"] / 1e6).tolist())
    assert df["busbw_GBps"].tolist() == pytest.approx(df["algbw_GBps"].tolist())  # factor 1 at n=2
    assert (section / "allreduce_bandwidth.png").exists()
    meta = json.loads((section / "allreduce.meta.json").read_text())
    assert meta["params"]["nproc"] == [2] and meta["params"]["preset"] == "smoke"


def test_topology_header_with_ansi_underline_is_parsed() -> None:
    """nvidia-smi underlines the header with ANSI escapes even into a pipe (seen on 4x H200)."""
    from cs336_systems.experiments.distributed_communication_single_node import Topology, parse_topology_matrix

    text = (
        "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tNV18\tNV18\t0-63\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tNV18\tNV18\t0-63\t0\t\tN/A\n"
        "GPU2\tNV18\tNV18\t X \tNV18\t0-63\t0\t\tN/A\n"
        "GPU3\tNV18\tNV18\tNV18\t X \t0-63\t0\t\tN/A\n"
    )
    links = parse_topology_matrix(text)
    assert len(links) == 12 and links["0-1"] == "NV18" and links["3-2"] == "NV18"
    topo = Topology(True, text, "NVIDIA H200", links, 25.0, "")
    assert topo.peak_busbw_gbps(2) == topo.peak_busbw_gbps(4) == 18 * 25.0


def test_alpha_beta_fit_recovers_a_ring_model_and_draws_it() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from cs336_systems.experiments.distributed_communication_single_node import fit_alpha_beta, plot_alpha_beta, ring_allreduce_seconds

    rows = []
    for p, alpha, bw in ((2, 15e-6, 300e9), (4, 8e-6, 400e9)):
        for n in (1e6, 1e7, 1e8, 1e9):
            rows.append({"backend": "nccl", "world_size": p, "size_bytes": n,
                         "time_ms": ring_allreduce_seconds(n, p, alpha, bw) * 1e3})
    df = pd.DataFrame(rows)
    fit = fit_alpha_beta(df).set_index("world_size")
    assert fit.loc[2, "alpha_us"] == pytest.approx(15, rel=1e-6) and fit.loc[2, "bandwidth_GBps"] == pytest.approx(300)
    assert fit.loc[4, "alpha_us"] == pytest.approx(8, rel=1e-6) and fit.loc[4, "bandwidth_GBps"] == pytest.approx(400)
    assert (fit["max_rel_error"] < 1e-9).all()
    # 1 MB over 2 ranks: one latency step each way plus half the data each way at 300 GB/s.
    assert ring_allreduce_seconds(1e6, 2, 15e-6, 300e9) == pytest.approx(2 * 15e-6 + 1e6 / 300e9)
    theory = pd.DataFrame({"world_size": [2, 4], "peak_algbw_GBps": [450.0, 300.0]})
    fig = plot_alpha_beta(df, fit.reset_index(), theory)
    assert len(fig.axes) == 2
    plt.close(fig)


def test_answer_says_how_process_count_interacts_with_message_size() -> None:
    def row(backend: str, ranks: int, size: str, size_bytes: int, ms: float, busbw: float) -> dict:
        return {"backend": backend, "world_size": ranks, "size": size, "size_bytes": size_bytes, "time_ms": ms,
                "busbw_GBps": busbw}

    df = pd.DataFrame([row("nccl", 2, "1MB", 10**6, 0.040, 25.0), row("nccl", 4, "1MB", 10**6, 0.050, 30.0),
                       row("nccl", 2, "1GB", 10**9, 3.0, 320.0), row("nccl", 4, "1GB", 10**9, 4.2, 350.0),
                       row("gloo", 2, "1GB", 10**9, 380.0, 2.6), row("gloo", 4, "1GB", 10**9, 590.0, 2.5),
                       row("gloo", 6, "1GB", 10**9, 740.0, 2.3)])
    assert allreduce._interaction(df) == (
        ", and the process count interacts with the message size: for NCCL, 4 ranks are slower than 2 at 1MB (50.0 "
        "µs against 40.0 µs), while at 1GB they reach more bus bandwidth (350 GB/s against 320 GB/s); Gloo's bus "
        "bandwidth at 1GB falls from 2.60 GB/s with 2 ranks to 2.30 GB/s with 6")
    flipped = df.assign(time_ms=[0.050, 0.040, 3.0, 4.2, 380.0, 590.0, 740.0],
                        busbw_GBps=[25.0, 30.0, 350.0, 320.0, 2.3, 2.6, 2.5])
    text = allreduce._interaction(flipped)  # the words follow the data, not the usual direction
    assert "4 ranks are faster than 2 at 1MB" in text and "they reach less bus bandwidth" in text
    assert "goes, not monotonically, from 2.30 GB/s with 2 ranks to 2.50 GB/s with 6" in text
    assert allreduce._interaction(df[df["world_size"] == 2]) == ""  # one process count: nothing to compare
