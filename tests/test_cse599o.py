"""The CSE599-O scripts (``cs336_systems/cse599o/``): their flags, one-line usage errors, and a timed run
on two CPU ranks. Under a real Slurm they run in ``tests/test_slurm.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.cse599o import benchmark_naive_ddp, benchmark_optimized_ddp, sharding_optimizer

SCRIPTS = Path(__file__).resolve().parent.parent / "cs336_systems" / "cse599o"


@pytest.mark.slow
@pytest.mark.parametrize(("script", "argv", "says"), [
    ("benchmark_optimized_ddp.py", ["--mode", "ring"], "argument --mode: invalid choice: 'ring'"),
    ("benchmark_optimized_ddp.py", ["--mode", "bucketed", "--bucket-size-mb", "0"], "--bucket-size-mb must be"),
    ("benchmark_naive_ddp.py", ["--model", "toy", "--nproc", "1"], "--nproc must be at least 2"),
])
def test_a_script_run_as_the_staff_do_refuses_bad_input_in_one_line(script: str, argv: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, script, *argv], check=False, cwd=SCRIPTS,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"{script}: error: ") and says in done.stderr


@pytest.mark.parametrize(("main", "argv", "says"), [
    (benchmark_optimized_ddp.main, ["--mode", "flat", "naive"], "invalid choice: 'naive'"),
    (benchmark_optimized_ddp.main, ["--mode", "bucketed", "--bucket-size-mb", "10", "-1"], "got -1"),
    (benchmark_optimized_ddp.main, ["--bucket-size-mb", "nan"], "got nan"),
    (benchmark_optimized_ddp.main, ["--preset", "enormous"], "unknown model preset 'enormous'"),
    (benchmark_naive_ddp.main, ["--model", "huge"], "invalid choice: 'huge'"),
    (benchmark_naive_ddp.main, ["--model", "transformer", "--steps", "0"], "--steps >= 1"),
    (benchmark_naive_ddp.main, ["--nproc", "0"], "got 0"),
    (sharding_optimizer.main, ["--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (sharding_optimizer.main, ["--autocast", "bf16"], "trains in fp32"),
])
def test_bad_flags_exit_2_with_one_line(main, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.slow
def test_optimized_ddp_times_bucketed_ddp_on_two_cpu_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark_optimized_ddp.main(["--mode", "bucketed", "--bucket-size-mb", "0.05", "1", "--preset", "tiny",
                                         "--nproc", "2", "--backend", "gloo", "--warmup", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny model (d_model 64, d_ff 256, 2 layers, 4 heads), fp32, 2 ranks x 2 sequences of 64 tokens" in out
    lines = re.findall(r"^bucketed DDP \((\S+) MB buckets\): ([\d.]+) ms per iteration, gradient communication "
                       r"not hidden by backward ([\d.]+) ms \(([\d.]+)% of the iteration\)$", out, re.MULTILINE)
    assert [size for size, *_ in lines] == ["0.05", "1"], out
    for _, step, comm, share in lines:
        assert float(step) > 0 and 0 <= float(comm) <= float(step)
        assert float(share) == pytest.approx(100 * float(comm) / float(step), abs=0.1)


@pytest.mark.slow
def test_sharding_script_prints_memory_at_three_points_and_time_per_iteration(capsys) -> None:
    """Problem 10's script: both optimizers on two CPU ranks, a block each (peaks need CUDA: said as n/a)."""
    assert sharding_optimizer.main(["--preset", "tiny", "--nproc", "2", "--backend", "gloo", "--warmup", "1",
                                    "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny model (d_model 64, d_ff 256, 2 layers, 4 heads), fp32, 2 ranks x 2 sequences of 64 tokens" in out
    for name in ("AdamW, replicated state:", "our ShardedOptimizer(AdamW):"):
        block = out.split(name, 1)[1]
        assert block.startswith("\n  peak memory: after initialization n/a, directly before the optimizer step n/a")
        assert re.search(r"rank 0 holds: parameters [\d.]+ MiB, gradients [\d.]+ MiB, optimizer state", block), block
        assert float(re.search(r"time per iteration: ([\d.]+) ms", block).group(1)) > 0
    # Sharding halves rank 0's optimizer state over two ranks (whole tensors per rank: roughly).
    state = [float(x) for x in re.findall(r"optimizer state ([\d.]+) MiB", out)]
    assert len(state) == 2 and 0.3 < state[1] / state[0] < 0.7, out


@pytest.mark.slow
def test_record_keeps_what_the_run_printed_and_the_cse599o_writeup_shows_it(tmp_path, monkeypatch,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from cs336_systems.writeup.build import build_document
    from cs336_systems.report.document import Console, Missing

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    assert benchmark_naive_ddp.main(["--model", "toy", "--nproc", "2", "--backend", "gloo", "--record",
                                     "naive_toy"]) == 0
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "cse599o" / "naive_toy.json").read_text())
    assert record["command"] == "benchmark_naive_ddp.py --model toy --nproc 2 --backend gloo"
    assert record["lines"][-1] == "Naive DDP matches baseline!" and "\n".join(record["lines"]) in printed
    meta = json.loads((tmp_path / "cse599o" / "naive_toy.meta.json").read_text())
    assert meta["smoke"] is True  # CPU ranks: not GPU numbers, and marked so

    doc = build_document(tmp_path, edition="cse599o")
    blocks = list(doc.section("2.3").walk())
    (console,) = [b for b in blocks if isinstance(b, Console)]
    assert console.lines == record["lines"] and console.source.endswith("cse599o/naive_toy.json")
    # the transformer run was not recorded: the section says which command records it
    assert any(isinstance(b, Missing) and "--record naive_transformer" in b.command for b in blocks)
    assert not any(s.folder == "cse599o" for s in build_document(tmp_path).unclaimed)  # not an orphan folder


def test_the_cse599o_writeup_heads_each_problem_with_its_handout_number(tmp_path) -> None:
    """CSE599-O numbers its problems ("Problem-6 (ddp_overlap_individual_parameters_benchmarking)"): its writeup's
    section headers and contents table say them so; the CS336 editions, which do not number them, keep the names."""
    from cs336_systems.report import editions
    from cs336_systems.report.html import document_html
    from cs336_systems.writeup.build import build_document

    assert editions.numbered("cse599o", "ddp_bucketed_benchmarking") == "Problem-8 (ddp_bucketed_benchmarking)"
    assert editions.numbered("2026", "ddp_bucketed_benchmarking") == "ddp_bucketed_benchmarking"
    doc = build_document(tmp_path, edition="cse599o")
    section = doc.section("2.4.2")
    assert section.problem_names == ("Problem-5 (ddp_overlap_individual_parameters)",
                                     "Problem-6 (ddp_overlap_individual_parameters_benchmarking)")
    page = document_html(doc)
    assert "Problem-6 (ddp_overlap_individual_parameters_benchmarking)" in page
    assert page.count("Problem-10 (optimizer_state_sharding_accounting)") >= 2  # the contents table and §3.1
