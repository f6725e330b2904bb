"""Answers in the form a grader reads them: table labels in the units and names the handout uses, ranges that do
not contradict their own clauses, and sentences that connect one section's constants to another's."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.data import SectionData
from cs336_systems.report.document import Table, Text


def _texts(blocks) -> str:
    out = []
    for b in blocks:
        out += [_texts(b.blocks)] if hasattr(b, "blocks") else [b.plain()] if isinstance(b, Text) else []
    return " ".join(out)


def _tables(blocks) -> list[Table]:
    out: list[Table] = []
    for b in blocks:
        out += _tables(b.blocks) if hasattr(b, "blocks") else [b] if isinstance(b, Table) else []
    return out


def test_bucket_caps_are_labelled_in_mib_and_message_sizes_are_left_alone() -> None:
    from cs336_systems.experiments.ddp_common import mib_labels

    frame = pd.DataFrame({"variant": ["flat", "bucketed (1MB)", "bucketed (0.05MB, bf16 comm)", "bucketed (1000MB)"]})
    assert mib_labels(frame)["variant"].tolist() == ["flat", "bucketed (1 MiB)", "bucketed (0.05 MiB, bf16 comm)",
                                                     "bucketed (1000 MiB)"]
    assert mib_labels(pd.DataFrame({"size": ["1MB"]}))["size"].tolist() == ["1MB"]  # no variant column: untouched


def test_sharding_timing_table_names_its_ratio_and_says_why_the_step_is_longer_than_ddps(tmp_path) -> None:
    from cs336_systems.experiments import optimizer_state_sharding as oss

    folder = tmp_path / "optimizer_state_sharding"
    folder.mkdir()
    pd.DataFrame({"optimizer": ["adamw", "sharded", "zero"], "step_ms": [467.0, 455.0, 456.0],
                  "step_ms_std": [55.0, 0.8, 1.5], "world_size": [2, 2, 2],
                  "slowdown_vs_adamw": [1.0, 0.974, 0.976]}).to_csv(folder / "timing.csv", index=False)
    blocks = oss.answer(SectionData(tmp_path, "optimizer_state_sharding"))
    (timing,) = [t for t in _tables(blocks) if t.source.endswith("timing.csv")]
    assert "time_vs_adamw" in timing.frame.columns and "slowdown_vs_adamw" not in timing.frame.columns
    assert oss.OPTIMIZER_NOTE.strip() in _texts(blocks)
    assert "do not compare with the DDP sections' step times" in oss.OPTIMIZER_NOTE  # a setup fact, no comparison


def test_nsys_range_shows_a_maximum_above_100_percent_as_such() -> None:
    from cs336_systems.experiments.nsys_profile import _share_above_one

    # the clause "above 100% a profiled pass ran slower" needs a maximum that reads above 100%
    assert _share_above_one(1.0043) == "100.4%" and _share_above_one(1.00004) == "100.004%"
    assert _share_above_one(0.483) == "48%" and _share_above_one(1.0) == "100%"


def test_nsys_b_calls_a_leading_step_matmul_the_forward_and_backwards_top(tmp_path) -> None:
    from cs336_systems.experiments import nsys_profile

    folder = tmp_path / "nsys_profile"
    folder.mkdir()
    pd.DataFrame({"size": ["small"], "context_length": [128], "status": ["ok"], "python_forward_ms": [10.0],
                  "python_forward_std_ms": [0.1], "profiled_forward_kernels_ms": [10.043],
                  "profiled_step_kernels_ms": [30.0], "top_forward_kernel": ["gemm_a"],
                  "top_kernel_calls_per_forward": [25], "top_kernel_percent": [40.0],
                  "top_non_matmul_kernel": ["elementwise_kernel<DivFunctor>"], "top_non_matmul_percent": [2.0],
                  "matmul_percent_forward": [80.0], "matmul_percent_train_step": [85.0],
                  "attention_matmul_ms": [1.0], "attention_scale_mask_ms": [0.2], "attention_softmax_ms": [0.5],
                  "softmax_to_matmul_time": [0.5], "softmax_to_matmul_flops": [0.02]}).to_csv(
        folder / "summary.csv", index=False)

    def top(category: str) -> None:
        pd.DataFrame({"size": ["small", "small"], "context_length": [128, 128], "range": ["forward", "step"],
                      "rank": [1, 1], "name": ["gemm_a", "gemm_b"], "calls": [25, 60], "total_ms": [4.0, 12.0],
                      "avg_us": [160.0, 200.0], "percent": [40.0, 30.0], "category": ["matmul", category]}).to_csv(
            folder / "top_kernels.csv", index=False)

    top("matmul")
    text = _texts(nsys_profile.answer(SectionData(tmp_path, "nsys_profile")))
    assert "profiles to 100%–100.4% of the timed pass" in text  # 10.043 ms of kernels in a 10 ms pass
    assert "in forward and backward together (profiled as the training step, whose optimizer runs no matrix " \
           "products) `gemm_b` leads instead" in text
    top("elementwise")  # an optimizer kernel could lead the step: no claim about forward and backward
    text = _texts(nsys_profile.answer(SectionData(tmp_path, "nsys_profile")))
    assert "in the full training step `gemm_b` leads instead" in text and "together" not in text


def test_all_reduce_fit_states_the_per_call_constants_later_sections_quote() -> None:
    """On the committed results: the fit's sentence gives o = 2(p-1)·alpha and w = p/(2(p-1))·B, the two
    constants the DDP sections quote, computed from the fit's own row."""
    from pathlib import Path

    from cs336_systems.experiments import distributed_communication_single_node as dc
    from cs336_systems.experiments.ddp_common import published_fit
    from cs336_systems.report import fmt

    d = SectionData(Path(__file__).resolve().parents[1] / "figures", "distributed_communication_single_node")
    fit = published_fit(d)
    text = _texts(dc.answer(d))
    assert (f"a cost per call $o = 2(p-1)\\,\\alpha$ = {fmt.sig(fit['o'] * 1e6)} µs and a rate "
            f"$w = \\frac{{p}}{{2(p-1)}}B$ = {fmt.sig(fit['w'] / 1e9)} GB/s") in text


def test_a_table_from_some_of_a_hosts_gpus_says_how_many_it_used() -> None:
    from cs336_systems.report.data import short_device

    meta = {"device": "NVIDIA H200", "device_type": "cuda", "num_gpus": 4}
    assert short_device({**meta, "params": {"world_size": 2, "nproc": [2, 4]}}) == "2 of 4×H200"
    assert short_device({**meta, "params": {"nproc": [2, 4]}}) == "4×H200"  # the run used every GPU
    assert short_device({**meta, "params": {"nproc": 2}}) == "2 of 4×H200"
    assert short_device({**meta, "num_gpus": 1, "params": {"size": "xl"}}) == "H200"
    assert short_device({**meta, "params": "not a record"}) == "4×H200"


def test_the_peak_memory_caption_glosses_only_the_columns_it_shows() -> None:
    from cs336_systems.experiments.memory_profiling import _peak_caption

    both = pd.DataFrame({"context_length": [128], "inference_peak_GiB": [1.0], "train_peak_GiB": [3.0]})
    assert _peak_caption(both) == ": the forward pass (inference, no autograd); the full training step."
    assert "autograd on" in _peak_caption(both.assign(forward_peak_GiB=[2.0]))
    assert _peak_caption(None) == "."


def test_a_widely_varying_overlap_row_gives_its_spread_and_median() -> None:
    from cs336_systems.experiments.ddp_overlap_individual import _spread_note

    varied = pd.Series({"step_ms": 220.2, "step_ms_std": 10.7, "step_ms_median": 222.0})
    assert _spread_note(varied) == " (its steps vary by ±10.7 ms around a median of 222 ms)"
    assert _spread_note(pd.Series({**varied, "step_ms_std": 1.7})) == ""  # steady steps: one number describes them
    assert _spread_note(pd.Series({"step_ms": 220.0, "step_ms_std": 20.0, "step_ms_median": 209.0})) == ""  # slow steps: the outlier note's case


def test_a_varying_overlap_row_is_set_beside_the_handout_scripts_printed_step(tmp_path) -> None:
    """CSE599-O records what its script printed; where the table's row varies widely, the answer compares the two."""
    import json

    from cs336_systems.experiments.ddp_common import printed_step_ms
    from cs336_systems.experiments.ddp_overlap_individual import _printed_alone

    folder = tmp_path / "ddp_overlap_individual" / "cse599o"
    folder.mkdir(parents=True)
    (tmp_path / "cse599o").mkdir()
    lines = ["large model (...), fp32, 2 ranks", "individual DDP: 207.42 ms per iteration, gradient communication not "
             "hidden by backward 0.21 ms (0.1% of the iteration)"]
    (tmp_path / "cse599o" / "individual.json").write_text(json.dumps({"command": "x", "lines": lines}))
    d = SectionData(tmp_path, "ddp_overlap_individual/cse599o", edition="cse599o")
    assert printed_step_ms(d, "individual") == 207.42 and printed_step_ms(d, "bucketed") is None
    row = pd.Series({"step_ms": 220.2, "step_ms_std": 10.7, "step_ms_median": 222.0})
    assert "printed 207 ms (its output opens this section), outside that spread" in _printed_alone(d, row)
    assert _printed_alone(d, pd.Series({**row, "step_ms_median": 210.0})).endswith("within that spread.")
    assert "is the faster of the two" in _printed_alone(d, pd.Series({**row, "step_ms_median": 190.0}))
    # an edition that shows no printed output (2025) gets no clause
    assert _printed_alone(SectionData(tmp_path, "ddp_overlap_individual", edition="2025"), row) == ""
    # several printed step times (the bucket sweep) name no single step
    (tmp_path / "cse599o" / "individual.json").write_text(json.dumps({"lines": [lines[1], lines[1]]}))
    assert printed_step_ms(d, "individual") is None


def test_an_edition_shows_a_sections_parts_under_its_own_problem_names() -> None:
    """CSE599-O calls CS336's naive_ddp parts toymodel_naive_ddp and transformer_naive_ddp_benchmarking."""
    from pathlib import Path

    from cs336_systems.report.document import Question
    from cs336_systems.writeup.build import build_document

    doc = build_document(Path(__file__).resolve().parents[1] / "figures", edition="cse599o")
    (naive,) = [s for s in doc.sections if s.number == "2.3"]
    labels = [b.label for b in naive.blocks if isinstance(b, Question)]
    assert labels[:2] == ["toymodel_naive_ddp", "transformer_naive_ddp_benchmarking"] and "naive_ddp" not in labels


def test_flash_sweep_names_every_cell_where_one_pass_alone_loses_to_pytorch() -> None:
    """The forward + backward verdict can hide a backward slower than PyTorch's in more cells; the answer gives
    each pass's losing cells, and a head dim whose losers skip a length lists them instead of a range."""
    import pandas as pd

    from cs336_systems.experiments.flash_benchmarking.answers import _cells_by_head, _passes_alone

    rows = []
    for d in (64, 128):
        for t in (512, 1024, 2048, 4096):
            for phase, speedup in (("forward", 2.0), ("backward", 0.9 if (d == 128 or t in (512, 2048)) else 1.5),
                                   ("forward+backward", 1.2)):
                rows.append(dict(dtype="float32", head_dim=d, seq_len=t, speedup_vs_naive=speedup, **{"pass": phase}))
    sp = pd.DataFrame(rows)
    assert _passes_alone(sp, "float32") == ("in float32 our backward is slower in 6 of 8 cells "
                                            "(d = 64 at 512 and 2,048 tokens, d = 128 at 512–4,096 tokens)")
    assert _passes_alone(sp, "bfloat16") == ""
    assert _cells_by_head(sp[sp["seq_len"] > 1024].drop_duplicates(["head_dim", "seq_len"])) == \
        "d = 64 at 2,048–4,096 tokens, d = 128 at 2,048–4,096 tokens"


def test_flash_answer_names_the_sweep_rows_the_gluon_forward_ran(tmp_path) -> None:
    """On a Hopper GPU with Gluon on, the rows of the bf16 sweep whose forward ran the Gluon kernel follow from the
    recorded options (keys x d / 2 >= gluon_min_key_work, causal), and those whose backward did from
    gluon_backward_min_keys where recorded; elsewhere the answer says nothing about them."""
    import json

    from cs336_systems.experiments.flash_benchmarking.answers import _gluon_rows

    folder = tmp_path / "flash_benchmarking"
    folder.mkdir()
    (folder / "sweep_bfloat16.csv").write_text("impl\ntriton\n")

    def meta(device: str, gluon: bool = True, head_dims: tuple = (16, 64, 128), backward: dict | None = None
             ) -> None:
        (folder / "sweep_bfloat16.meta.json").write_text(json.dumps({"device": device, "params": {
            "sweep": {"seq_lens": [512, 1024, 2048, 4096, 8192], "head_dims": list(head_dims)},
            "kernel_options": {"gluon": gluon, "gluon_min_key_work": 98304, **(
                {"gluon_backward": True, "gluon_backward_min_keys": backward} if backward else {})}}}))

    meta("NVIDIA H200")  # options recorded before the backward was routed: nothing said of it
    said = _gluon_rows(SectionData(tmp_path, "flash_benchmarking"))
    assert "forward runs at d = 64 from 4,096 and d = 128 from 2,048 tokens;" in said and "backward" not in said
    meta("NVIDIA H200", backward={"64": 16384, "128": 2048})  # as JSON records it: head dims as strings
    said = _gluon_rows(SectionData(tmp_path, "flash_benchmarking"))
    assert "2,048 tokens, the Gluon backward at d = 128 from 2,048 tokens;" in said  # d = 64 rows end at 8,192
    meta("NVIDIA H200", head_dims=[32, 128])  # a grid without 64 says nothing of it
    assert _gluon_rows(SectionData(tmp_path, "flash_benchmarking")).startswith(
        " In the bf16 sweep below the Gluon forward runs at d = 128 from 2,048 tokens;")
    meta("NVIDIA H200", gluon=False)
    assert _gluon_rows(SectionData(tmp_path, "flash_benchmarking")) == ""
    meta("NVIDIA A100-SXM4-80GB")
    assert _gluon_rows(SectionData(tmp_path, "flash_benchmarking")) == ""


def test_nsys_answers_every_profile_in_one_table(tmp_path) -> None:
    """The handout asks (a)-(e) for each profile: besides the sentences on one configuration, one table gives the
    numbers of (a), (b) and (e) for every configuration that ran, and none for those out of memory."""
    import json

    from cs336_systems.experiments import nsys_profile

    folder = tmp_path / "nsys_profile"
    folder.mkdir()
    ok = dict(status="ok", python_forward_std_ms=0.1, profiled_step_kernels_ms=30.0,
              top_non_matmul_kernel="void at::native::elementwise_kernel<DivFunctor>(int)", top_non_matmul_percent=3.0,
              matmul_percent_forward=70.0, matmul_percent_train_step=60.0, attention_matmul_ms=0.4,
              attention_scale_mask_ms=0.4, attention_softmax_ms=0.5, softmax_to_matmul_time=1.2,
              softmax_to_matmul_flops=0.0195)
    rows = pd.DataFrame([
        dict(size="small", context_length=256, python_forward_ms=12.4, profiled_forward_kernels_ms=8.9,
             top_forward_kernel="void sm80_xmma_gemm_f32f32_tn_kernel(int)", top_kernel_calls_per_forward=72.0,
             top_kernel_percent=54.8, **ok),
        dict(size="small", context_length=512, python_forward_ms=19.3, profiled_forward_kernels_ms=18.1,
             top_forward_kernel="void sm80_xmma_gemm_f32f32_nn_kernel(int)", top_kernel_calls_per_forward=61.0,
             top_kernel_percent=36.6, **ok),
        dict(size="large", context_length=256, status="OOM"),
    ])
    rows.to_csv(folder / "summary.csv", index=False)
    (folder / "summary.meta.json").write_text(json.dumps({"device": "NVIDIA H200", "device_type": "cuda"}))
    tables = [t for t in _tables(nsys_profile.answer(SectionData(tmp_path, "nsys_profile")))
              if t.caption.startswith("Every profile")]
    assert len(tables) == 1
    table = tables[0]
    assert all(f"({part})" in table.caption for part in "abe")
    assert list(table.frame["context_length"]) == [256, 512]  # the profiles that ran
    assert {"python_forward_ms", "top_kernel_calls_per_forward", "softmax_to_matmul_flops"} <= set(table.frame.columns)
    assert not table.frame["top_forward_kernel"].str.startswith("void").any()  # short kernel names


def test_an_answer_with_marked_results_opens_with_one_plain_caveat() -> None:
    from cs336_systems.report.answers import marked_results

    frame = pd.DataFrame({"ms": [1.0]})
    stale = Table(frame=frame, caption="t", source="s.csv", meta={"stale": True})
    slow = Table(frame=frame, caption="t", source="s.csv", meta={"machine": {"state": "suspect"}})
    fine = Table(frame=frame, caption="t", source="s.csv", meta={"machine": {"state": "calibrated"}})
    assert marked_results([fine]) == ""
    said = marked_results([stale, slow, fine])
    assert said.startswith("Caveat: some numbers in this answer were measured on older code (STALE) and measured "
                           "on a GPU that ran more than 10% below its reference speed (SUSPECT);")


def test_ddp_setup_is_said_in_full_once_and_briefly_after() -> None:
    from cs336_systems.experiments.ddp_common import setup

    df = pd.DataFrame({"preset": ["xl"], "autocast": ["fp32"], "batch_per_rank": [2], "context_length": [512],
                       "world_size": [2], "steps": [10]})
    full, brief = setup(df, "2025").plain(), setup(df, "2025", first=False).plain()
    assert "every variant starts from the same weights" in full and "sharding section" in full
    assert brief.startswith("Setup: the xl model, fp32, 2 sequences of 512 tokens per rank, 2 GPUs, fused AdamW")
    assert len(brief) < len(full) and setup(None) is None


def test_a_traced_all_reduce_longer_than_the_timed_wait_is_explained() -> None:
    from cs336_systems.experiments.ddp_overlap_individual import _kernel_over_wait

    ov = pd.DataFrame({"variant": ["flat", "individual"], "comm_ms": [25.84, 24.3]})
    rows = {"flat": pd.Series({"sync_ms": 16.87}), "individual": pd.Series({"sync_ms": 7.0})}
    said = _kernel_over_wait(ov, rows)
    assert "(flat's 25.8 ms against its 16.9 ms wait)" in said and "individual" not in said
    assert _kernel_over_wait(ov, {"flat": pd.Series({"sync_ms": 24.0})}) == ""  # within a fifth: nothing to explain


def test_flat_ddp_accounts_for_its_wait_with_the_transfer_and_the_copies() -> None:
    """Flat DDP's wait against the fit's transfer plus two copies of every gradient at the calibrated copy rate."""
    from cs336_systems.experiments.ddp_flat import _copies

    flat = pd.Series({"sync_ms": 17.4})
    said = _copies(flat, 12.2, 3.88e9, 4.16)  # 4 x 3.88 GB (read and written, into and back) at 4.16 TB/s
    assert "move 15.5 GB through memory, 3.73 ms" in said and "1.47 ms the two do not account for" in said
    assert said.endswith("do not account for.")
    over = _copies(pd.Series({"sync_ms": 15.0}), 12.2, 3.88e9, 4.16)  # 15.9 ms estimated for a 15.0 ms wait
    assert "0.931 ms more than flat's 15.0 ms wait: the two account for all of it" in over
    assert _copies(flat, 12.2, 3.88e9, None) == ""  # no calibration: no copy time to state


def test_individual_ddp_answer_gives_its_verdict_against_both_earlier_variants() -> None:
    """(a) asks for a comparison: the answer says faster, slower or level against naive and flat DDP, judged by the
    rows' summed step-to-step spread."""
    from cs336_systems.experiments.ddp_overlap_individual import _verdict

    row = lambda ms, std: {"step_ms": ms, "step_ms_std": std}  # noqa: E731
    level = _verdict({"overlap": row(220.2, 10.7), "naive": row(223.4, 1.66), "flat": row(220.2, 1.66)})
    assert "level with naive (±12.4 ms) and level with flat (±12.4 ms)" in level
    split = _verdict({"overlap": row(405.0, 1.0), "naive": row(430.0, 1.0), "flat": row(404.0, 1.0)})
    assert "faster than naive and level with flat" in split
    assert _verdict({"overlap": row(405.0, 1.0)}) == ""


def test_naive_ddp_near_the_fit_names_what_can_still_move_it() -> None:
    """Near the microbenchmark's prediction, the answer still gives the handout's "potential causes for any
    differences": the calls' timing, tensors below the fit's smallest message, and another host where so."""
    import types

    import pandas as pd

    from cs336_systems.experiments.naive_ddp import _close_to_fit

    fit_run = types.SimpleNamespace(frame=lambda name: pd.DataFrame({"size_bytes": [1_000_000, 10_000_000]}),
                                    meta=lambda name: {"num_gpus": 4, "device": "NVIDIA H200"})
    text = _close_to_fit(fit_run, {"num_gpus": 2, "device": "NVIDIA H200"}, 327, 3.88e9)
    assert "the fit covers messages of 1.00 MB and up" in text and "327 tensors average 11.9 MB" in text
    assert "the fit ran on a 4-GPU NVIDIA H200 host, this step on a 2-GPU NVIDIA H200 host" in text
    same_host = _close_to_fit(fit_run, {"num_gpus": 4, "device": "NVIDIA H200"}, 327, 3.88e9)
    assert "the fit ran on" not in same_host
