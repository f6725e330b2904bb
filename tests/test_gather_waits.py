"""FSDP all-gather waits (``profiling.gather_waits``) on a synthetic forward timeline."""

from __future__ import annotations

import pandas as pd
import pytest

from cs336_systems.profiling.gather_waits import gather_summary, gather_waits

COLUMNS = ["variant", "lane", "kind", "name", "start_ms", "dur_ms"]


def _timeline() -> pd.DataFrame:
    """Forward from 0 to 10 ms. Compute runs [0, 2), [2.5, 5) and [5.01+0.99=6.0, 10). Gathers:
    g0 ends at 1.5 while compute runs (in time); g1 ends at 5.99 and compute, idle since 5.0, resumes
    10 µs later (it waited 0.99 ms); g2 ends at 2.3, inside a 0.5 ms gap after which compute resumes only
    200 µs later (idle for another reason: in time); a gather starting after the forward is not counted."""
    rows = [("v", "phase", "phase", "forward", 0.0, 10.0), ("v", "phase", "phase", "backward", 10.0, 5.0)]
    rows += [("v", "cuda:7", "compute", "3 kernels", s, d) for s, d in ((0.0, 2.0), (2.5, 2.5), (6.0, 4.0))]
    rows += [("v", "cuda:19", "comm", "ncclDevKernel_AllGather_RING_LL", s, d)
             for s, d in ((0.5, 1.0), (3.0, 2.99), (1.8, 0.5), (11.0, 1.0))]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_a_gather_is_late_only_when_compute_resumes_as_it_ends() -> None:
    w = gather_waits(_timeline()).set_index("start_ms")
    assert list(w.index) == [0.5, 1.8, 3.0]  # the backward's gather is outside the phase
    assert w.loc[0.5, "compute_busy_at_end"] and not w.loc[0.5, "late"]
    assert not w.loc[1.8, "late"] and w.loc[1.8, "waited_ms"] == 0  # compute resumed 200 µs later
    assert w.loc[3.0, "late"] and w.loc[3.0, "waited_ms"] == pytest.approx(0.99)
    loose = gather_waits(_timeline(), resume_us=300).set_index("start_ms")
    assert loose.loc[1.8, "late"] and loose.loc[1.8, "waited_ms"] == pytest.approx(0.3)


def test_summary_adds_up_the_gathers() -> None:
    s = gather_summary(_timeline()).iloc[0]
    assert (s["gathers"], s["late_gathers"]) == (3, 1)
    assert s["span_ms"] == 10.0 and s["compute_ms"] == pytest.approx(8.5)
    assert s["gather_ms"] == pytest.approx(1.0 + 2.99 + 0.5)
    # beside compute: g0 fully (1.0), g2 over [1.8, 2.0) (0.2), g1 over [3.0, 5.0) (2.0)
    assert s["gather_beside_compute_ms"] == pytest.approx(3.2)
    assert s["wait_ms"] == pytest.approx(0.99) and s["max_wait_ms"] == pytest.approx(0.99)


def test_no_phase_no_rows_and_bad_input_is_refused() -> None:
    tl = _timeline()
    assert gather_waits(tl, phase="optimizer").empty and gather_summary(tl, phase="optimizer").empty
    with pytest.raises(ValueError, match="not a timeline"):
        gather_waits(tl.drop(columns=["lane"]))
    with pytest.raises(ValueError, match="resume_us"):
        gather_waits(tl, resume_us=-1)


def _two_ranks(skew_ms: float = 3.0) -> pd.DataFrame:
    """Two ranks' forwards on clocks ``skew_ms`` apart. Gather 0: rank 0 starts at 1.0 and spins until rank 1
    starts at 1.6; both end at 2.0. Gather 1: rank 1 starts first (4.0) and waits for rank 0 (4.3); both end at
    4.5. Rank 1's rows count from its own start, ``skew_ms`` later."""
    rows = []
    for v, shift, gathers in (("r0", 0.0, ((1.0, 1.0), (4.3, 0.2))), ("r1", -skew_ms, ((1.6, 0.4), (4.0, 0.5)))):
        rows.append((v, "phase", "phase", "forward", 0.0 + shift, 6.0))
        rows.append((v, "cuda:7", "compute", "4 kernels", 0.0 + shift, 0.9))
        rows += [(v, "cuda:17", "comm", "ncclDevKernel_AllGather_RING_LL", s + shift, d) for s, d in gathers]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_ranks_are_put_on_one_clock_by_their_gathers_ends() -> None:
    from cs336_systems.profiling.gather_waits import align_ranks

    moved, clocks = align_ranks(_two_ranks())
    assert clocks.set_index("variant")["offset_ms"].to_dict() == pytest.approx({"r0": 0.0, "r1": 3.0})
    assert clocks["residual_us"].max() == pytest.approx(0.0, abs=1e-6)
    r1 = moved[(moved["variant"] == "r1") & (moved["kind"] == "comm")]["start_ms"].tolist()
    assert r1 == pytest.approx([1.6, 4.0])
    uneven = _two_ranks().iloc[:-1]  # rank 1 lost a gather: the ranks cannot be paired
    with pytest.raises(ValueError, match="different numbers of all-gathers"):
        align_ranks(uneven)


def test_peer_waits_split_each_gather_into_waiting_and_transfer() -> None:
    from cs336_systems.profiling.gather_waits import align_ranks, peer_summary, peer_waits

    moved, _ = align_ranks(_two_ranks())
    w = peer_waits(moved).set_index(["variant", "gather"])
    assert w.loc[("r0", 0), "peer_wait_ms"] == pytest.approx(0.6) and w.loc[("r1", 0), "last"]
    assert w.loc[("r1", 1), "peer_wait_ms"] == pytest.approx(0.3) and w.loc[("r0", 1), "last"]
    assert w.loc[("r0", 0), "transfer_ms"] == pytest.approx(0.4)  # the latecomer's kernel
    s = peer_summary(moved).set_index("variant")
    assert s.loc["r0", "peer_wait_ms"] == pytest.approx(0.6) and s.loc["r1", "peer_wait_ms"] == pytest.approx(0.3)
    assert s["arrived_last"].tolist() == [1, 1] and s["transfer_ms"].tolist() == pytest.approx([0.6, 0.6])
    # on unaligned clocks rank 1 seems to start every gather 3 ms early, and rank 0 would wait for nothing
    assert peer_summary(_two_ranks())["peer_wait_ms"].iloc[0] == 0.0


def test_gathers_are_paired_by_their_number_in_the_step_not_within_each_ranks_window() -> None:
    """Rank 1's forward window ends before its second forward gather starts, and a backward gather of rank 0
    would fall inside rank 0's window if windows were per rank: both ranks' gathers are numbered over the step
    and the phase's are rank 0's, so gather 1 of rank 0 meets gather 1 of rank 1, not a backward one."""
    from cs336_systems.profiling.gather_waits import peer_waits

    rows = [("r0", "phase", "phase", "forward", 0.0, 6.0), ("r1", "phase", "phase", "forward", 0.0, 4.2)]
    gathers = {"r0": ((1.0, 1.0), (4.3, 0.2), (7.0, 0.5)), "r1": ((1.6, 0.4), (4.4, 0.1), (7.2, 0.3))}
    for v, gs in gathers.items():
        rows += [(v, "cuda:17", "comm", "ncclDevKernel_AllGather_RING_LL", s, d) for s, d in gs]
        rows.append((v, "cuda:7", "compute", "4 kernels", 0.0, 0.9))
    w = peer_waits(pd.DataFrame(rows, columns=COLUMNS)).set_index(["variant", "gather"])
    assert sorted({g for _, g in w.index}) == [0, 1]  # rank 0's two forward gathers
    assert w.loc[("r1", 1), "start_ms"] == 4.4 and w.loc[("r0", 1), "peer_wait_ms"] == pytest.approx(0.1)


def test_the_zoom_window_spans_the_middle_gathers_of_the_first_ranks_forward() -> None:
    """Twenty forward gathers, one per ms (0.2 ms each), and one in the backward: fourteen from the middle are
    gathers 3 to 16, from 3.0 to 16.2 ms, widened by a tenth of that on each side; fewer gathers give no window."""
    from cs336_systems.profiling.gather_waits import zoom_window

    rows = [("r0", "phase", "phase", "forward", 0.0, 20.0), ("r0", "phase", "phase", "backward", 20.0, 10.0)]
    rows += [("r0", "cuda:7", "compute", "k", float(i) + 0.2, 0.8) for i in range(20)]
    rows += [("r0", "cuda:19", "comm", "ncclDevKernel_AllGather_RING_LL", float(i), 0.2) for i in range(20)]
    rows += [("r0", "cuda:19", "comm", "ncclDevKernel_AllGather_RING_LL", 25.0, 0.2)]
    rows += [("r1", "phase", "phase", "forward", 0.0, 20.0)]  # the second rank's forward: its gathers are not counted
    rows += [("r1", "cuda:19", "comm", "ncclDevKernel_AllGather_RING_LL", 10.0 + 0.5 * i, 0.1) for i in range(20)]
    lo, hi = zoom_window(pd.DataFrame(rows, columns=COLUMNS))
    assert (lo, hi) == (pytest.approx(3.0 - 1.32), pytest.approx(16.2 + 1.32))
    assert zoom_window(pd.DataFrame(rows, columns=COLUMNS), gathers=21) is None
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"^zoom_window: gathers must be an integer >= 1"):
            zoom_window(pd.DataFrame(rows, columns=COLUMNS), gathers=bad)
