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
