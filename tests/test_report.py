"""The writeup builder: document model from a fixture results folder, HTML rendering (no browser),
and the manifest that proves the committed ``writeup.pdf`` is not older than its results."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import pytest

from cs336_systems.report import editions, fmt
from cs336_systems.report import manifest as mf
from cs336_systems.writeup.__main__ import main as report_main
from cs336_systems.writeup.build import build_document
from cs336_systems.report.data import provenance_line
from cs336_systems.report.document import BEYOND_HANDOUT, Figure, Missing, Table, Text
from cs336_systems.report.html import document_html, markdown_to_html, render_math
from cs336_systems.experiments import SECTIONS as _SECTIONS
from cs336_systems.results import ResultWriter

SECTIONS = list(_SECTIONS.values())

EXPECTED_SECTIONS = ["1.1.2", "1.1.3", "1.1.4", "1.1.5", "1.1.6", "1.1.7", "1.2.1", "1.3", "1.3.2", "1.3.5", "1.4", "1.5", "2.1", "2.2", "2.3.1",
                     "2.3.2", "2.3.3", "2.4", "2.5", "3", "3.1", "4"]


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty results root that ResultWriter writes into (as a measured, non-smoke run)."""
    root = tmp_path / "figures"
    monkeypatch.setenv("CS336_FIGURES_DIR", str(root))
    monkeypatch.setenv("CS336_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    return root


def _write_benchmarking(root: Path) -> pd.DataFrame:
    df = pd.DataFrame({
        "size": ["small", "medium"],
        "forward_mean_ms": [12.3456, 45.678],
        "forward_std_ms": [0.1, 0.2],
        "backward_mean_ms": [25.01, 98.76],
        "backward_std_ms": [0.3, 0.4],
    })
    ResultWriter("benchmarking", params={"warmup": 5, "steps": 10}, smoke=False).table(df, "timings")
    return df


def _whole(sections: list) -> list:
    """The sections without the appendix's continuations (``1.3.2+``: a section's answers beyond the handout)."""
    return [s for s in sections if not s.number.endswith("+")]


def test_every_section_present_and_says_what_is_missing(results: Path) -> None:
    doc = build_document(results, strict=True)
    doc.sections = _whole(doc.sections)
    doc.appendix_from = sum(not editions.in_appendix("2025", s.folder) for s in doc.sections)
    # The handout's answers in the workbook's order, then the appendix's sections in the same order.
    beyond = {s.number for s in doc.sections[doc.appendix_from :]}
    assert [s.number for s in doc.sections] == [n for n in EXPECTED_SECTIONS if n not in beyond] + \
        [n for n in EXPECTED_SECTIONS if n in beyond]
    specs = sorted(SECTIONS, key=lambda spec: spec.number in beyond)  # stable: the same two-part order
    assert [s.folder for s in doc.sections] == [spec.name for spec in specs]
    for section, spec in zip(doc.sections, specs):
        missing = [b for b in section.walk() if isinstance(b, Missing)]
        assert missing, f"§{section.number} has no data but does not say so"
        assert missing[0].command == spec.refresh_command
        assert not [b for b in section.walk() if isinstance(b, (Table, Figure))], "invented a table without data"
    assert doc.inputs == []


def test_the_2026_writeup_follows_its_handout(results: Path) -> None:
    """The 2026 document: the 2026 handout's numbers and problem names in its order, each backed by a workbook
    section (or saying that none measures it yet), every 2026 problem present once, notes at the top."""
    from cs336_systems.report.editions import EDITION_2026, entries

    _write_benchmarking(results)
    doc = build_document(results, strict=True, edition="2026")
    numbers = [s.number for s in _whole(doc.sections)]
    beyond = {s.number for s in _whole(doc.sections[doc.appendix_from :])}
    assert numbers == [e.number for e in EDITION_2026 if e.number not in beyond] + \
        [e.number for e in EDITION_2026 if e.number in beyond]
    problems = [p for s in doc.sections for p in s.problems]
    for name in ("benchmarking_script", "nsys_profile", "memory_profiling", "gradient_checkpointing",
                 "pytorch_attention", "torch_compile", "flash_benchmarking", "distributed_communication_single_node",
                 "naive_ddp", "minimal_ddp_flat_benchmarking", "ddp_overlap_individual_parameters",
                 "optimizer_state_sharding", "fsdp", "fsdp_accounting", "alternate_ring_all_reduce", "tp_calcs",
                 "fsdp_tp_calcs", "leaderboard"):
        assert problems.count(name) == 1, name
    assert {e.section for e in EDITION_2026} - {None} <= {spec.name for spec in SECTIONS}
    bench = doc.section("2.1.3")
    assert any(isinstance(b, Table) for b in bench.walk())  # the same results as the workbook's §1.1.3
    assert doc.section("2.1.4").blocks[0].markdown.startswith("**Note.**")  # an edition note
    leaderboard = doc.section("9")
    assert any(isinstance(b, Missing) for b in leaderboard.walk())
    assert "§2.1.3 | benchmarking_script | §1.1.3 End-to-end benchmarking" in doc.preamble[-1].markdown
    assert doc.title.endswith("(CS336 2026 edition)") and entries("2025") is None
    with pytest.raises(ValueError, match="unknown edition '2027'"):
        build_document(results, edition="2027")


def test_an_edition_grid_answers_its_edition_and_stays_out_of_the_other(results: Path) -> None:
    """Results of nsys_profile's 2026 grid (figures/nsys_profile/2026/) answer the 2026 writeup's §2.1.4 in
    place of the workbook's grid, whose note then goes; the 2025 writeup keeps its own grid and lists the
    2026 one among the further results of the index only."""
    committed = pd.read_csv(Path(__file__).parents[1] / "figures" / "nsys_profile" / "summary.csv")
    own = committed.head(2)
    grid = committed.head(3).assign(size=["small", "large", "large"], context_length=[4096, 1024, 2048],
                                    status=["ok", "ok", "OOM"])
    ResultWriter("nsys_profile", params={"sizes": ["small"]}, smoke=False).table(own, "summary")
    ResultWriter("nsys_profile/2026", params={"edition": "2026"}, smoke=False).table(grid, "summary")
    doc26 = build_document(results, edition="2026")
    section = doc26.section("2.1.4")
    # measured on its own grid: the note about the other grid's results goes, and no banner replaces it
    assert not any(isinstance(b, Text) and b.markdown.startswith("**Note.**")
                   for b in section.blocks)
    # The per-configuration tables continue in the appendix (2.1.4+): every one from the 2026 grid.
    sources = {b.source for s in (section, doc26.section("2.1.4+")) for b in s.walk() if isinstance(b, Table)}
    assert sources and all("/nsys_profile/2026/" in src for src in sources), sources
    text = " ".join(b.markdown for s in (section, doc26.section("2.1.4+")) for b in s.walk() if isinstance(b, Text))
    assert "large up to 1,024 (2,048: out of memory)" in text  # the longest contexts: the appendix
    doc25 = build_document(results)
    mine = doc25.section("1.1.4")
    assert all("/nsys_profile/summary.csv" in b.source for s in (mine, doc25.section("1.1.4+"))
               for b in s.walk() if isinstance(b, Table))
    further = [b.source for b in mine.further if isinstance(b, Table)]
    assert len(further) == 1 and further[0].endswith("/nsys_profile/2026/summary.csv")


def test_numbers_and_provenance_come_from_the_results(results: Path) -> None:
    _write_benchmarking(results)
    doc = build_document(results, strict=True)
    sec = doc.section("1.1.3")
    tables = [b for b in sec.walk() if isinstance(b, Table)]
    assert len(tables) == 1 and tables[0].source.endswith("benchmarking/timings.csv")
    text = sec.plain()
    assert "12.3 ms" in text and "45.7 ms" in text and "98.8 ms" in text  # formatted from the CSV
    assert not [b for b in sec.blocks if isinstance(b, Missing) and "no results" in b.what]
    line = provenance_line(tables[0].meta)
    assert "torch" in line and "commit 012345678" in line and tables[0].meta["date"][:10] in line
    # Sections without data are unaffected.
    assert any(isinstance(b, Missing) for b in doc.section("2.2").walk())
    assert {p.name for p in doc.inputs} == {"timings.csv", "timings.md", "timings.meta.json"}


@pytest.mark.slow
def test_uncited_results_go_to_the_index_not_the_writeup(results: Path) -> None:
    out = ResultWriter("benchmarking", smoke=True)
    out.table(pd.DataFrame({"x": [1, 2]}), "extra_table")
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    out.figure(fig, "extra_plot")
    plt.close(fig)
    ResultWriter("brand_new_notebook", smoke=True).json({"answer": 42, "unit": "ms"}, "summary")
    doc = build_document(results, strict=True)
    bench = doc.section("1.1.3")
    # The writeup says they exist and where; the index shows them in full.
    assert not any(isinstance(b, (Table, Figure)) and "extra" in b.source for b in bench.walk())
    # (after the answers: where the section continues beyond the handout, in its appendix part)
    said = "\n".join(s.plain() for s in doc.sections if s.number in ("1.1.3", "1.1.3+"))
    assert "2 further tables and figures" in said and "figures/index.html" in said
    assert any(isinstance(b, Table) and b.source.endswith("extra_table.csv") for b in bench.further)
    assert any(isinstance(b, Figure) and b.source.endswith("extra_plot.png") for b in bench.further)
    assert [s.folder for s in doc.sections if s.number.startswith("A.")] == []
    (appendix,) = doc.unclaimed
    assert appendix.folder == "brand_new_notebook" and appendix.number == "A.1"
    (table,) = [b for b in appendix.further if isinstance(b, Table)]
    assert table.frame.set_index("quantity")["value"]["answer"] == 42
    line = provenance_line(table.meta)  # its commit (0123456789abcdef…) is unknown here: stale as well
    assert line.startswith("STALE") and "SMOKE RUN, not a GPU measurement" in line

    from cs336_systems.writeup.build import write_html, write_index

    page = write_html(doc, results.parent / "writeup.html").read_text()
    assert "extra_plot" not in page and 'src="figures/benchmarking/' not in page  # nothing cited has a figure
    index = write_index(doc, results, results.parent / "writeup.html").read_text()
    assert 'src="benchmarking/extra_plot.png"' in index  # linked relative to the index, not embedded
    assert 'id="brand_new_notebook"' in index and "42" in index
    assert 'href="../writeup.html#sec-1-1-3"' in index and "data:image/png" not in index


def test_html_writeup_links_its_figures(results: Path, tmp_path: Path) -> None:
    out = ResultWriter("model_sizes", smoke=True)
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    out.figure(fig, "anything")
    plt.close(fig)
    doc = build_document(results)
    figures = [b for s in doc.sections for b in [*s.walk(), *s.further] if isinstance(b, Figure)]
    assert figures
    from cs336_systems.report.html import figure_html

    linked = figure_html(figures[0], 1, link_from=results.parent)
    assert 'src="figures/model_sizes/anything.png"' in linked
    assert "data:image/png;base64," in figure_html(figures[0], 1)


def test_html_typesets_math_and_embeds_everything(results: Path) -> None:
    _write_benchmarking(results)
    page = document_html(build_document(results, strict=True))
    assert page.count('<img class="math"') > 10  # derivations are typeset, not printed as TeX
    assert "$" not in page.replace("\\$", "")
    # Under a table the writeup says where and when (device · date · commit); the full record, run parameters
    # included, is in the results index.
    assert "<b>Table 1.</b>" in page and "Run parameters" not in page
    from cs336_systems.report.index import index_html

    assert "run parameters: warmup=5, steps=10" in index_html(build_document(results, strict=True), results)
    assert "file://" not in page  # self-contained: figures and math are data URIs
    for spec in SECTIONS:
        assert f"§{spec.number}" in page


def test_markdown_math_and_bad_formula() -> None:
    html = markdown_to_html(r"cost $o + s/(n_b w)$ with a literal \$5 and `code_with_underscores`")
    assert html.count('class="math"') == 1 and "$5" in html and "code_with_underscores" in html
    with pytest.raises(ValueError, match="cannot typeset"):
        render_math(r"\notacommand{x}")
    with pytest.raises(ValueError, match="cannot typeset"):
        markdown_to_html(r"see $\notacommand{x}$")
    assert "<code>\\notacommand{x}</code>" in markdown_to_html(r"see $\notacommand{x}$", lenient=True)


def test_number_formatting() -> None:
    assert fmt.sig(12.3456) == "12.3"
    assert fmt.sig(1234567) == "1,234,567"
    assert fmt.sig(0.012345) == "0.0123"
    assert fmt.ms(45.678) == "45.7 ms"
    assert fmt.pct(0.1234) == "12.3%"
    assert fmt.mib(2**20 * 10) == "10.0 MiB"
    assert fmt.cell(float("nan")) == "—" and fmt.cell(3.0) == "3" and fmt.cell(1 / 3) == "0.3333"


def test_manifest_detects_every_kind_of_staleness(results: Path, tmp_path: Path) -> None:
    _write_benchmarking(results)
    pdf, manifest = tmp_path / "writeup.pdf", results / mf.MANIFEST_NAME
    pdf.write_bytes(b"%PDF-1.4 fixture")
    mf.write_manifest(pdf, results, manifest)
    assert mf.check_manifest(pdf, results, manifest) == []
    assert report_main(["check", "--figures", str(results), "--pdf", str(pdf), "--manifest", str(manifest)]) == 0

    (results / "benchmarking" / "timings.csv").write_text("size\nchanged\n")
    (results / "benchmarking" / "late.csv").write_text("a\n1\n")
    pdf.write_bytes(b"%PDF-1.4 another")
    problems = "\n".join(mf.check_manifest(pdf, results, manifest))
    assert "changed since the last build: benchmarking/timings.csv" in problems
    assert "added since the last build: benchmarking/late.csv" in problems
    assert "not the PDF the manifest was written for" in problems
    assert report_main(["check", "--figures", str(results), "--pdf", str(pdf), "--manifest", str(manifest)]) == 1

    shutil.rmtree(results / "benchmarking")
    assert any("removed" in p for p in mf.check_manifest(pdf, results, manifest))
    assert mf.check_manifest(pdf, results, tmp_path / "nope.json") == ["no manifest at " + str(tmp_path / "nope.json")]


def test_committed_writeup_is_up_to_date() -> None:
    """``writeup.pdf`` was built from exactly the committed results and builder source."""
    problems = mf.check_manifest()
    assert not problems, "writeup.pdf is stale; rebuild with `{}`:\n{}".format(mf.REBUILD_COMMAND,
                                                                             "\n".join(problems))
    recorded = json.loads(mf.DEFAULT_MANIFEST.read_text())
    assert recorded["pdf"]["path"] == "writeup.pdf"
    assert mf.DEFAULT_PDF.read_bytes().startswith(b"%PDF")
    # The answers have their own budget (below); with the appendix's full tables the whole stays bounded, and
    # exploratory results live in the index beside it. (The workbook's own writeup carries every edition's
    # problems; 62 since its appendix holds the 2026 leaderboard's two-GPU step and the 4-GPU results, 64 since
    # each section's account of how it was measured moved there from the answers, which shrank by three pages; 65
    # since answers longer than their deliverable left their detail there and bucketed DDP gained its
    # communication table; 66 since fsdp_accounting (b) draws both ranks' timelines and the overlap traces draw
    # naive DDP beside flat and overlapped, as the handouts compare; 67 since it also zooms that profile to two
    # blocks, the view the handout's Nsight screenshot would give.)
    assert recorded["pdf"]["pages"] <= 67, f"writeup.pdf has {recorded['pdf']['pages']} pages"
    assert set(recorded["outputs"]) == {"writeup.html", "figures/index.html", "writeup-2026.pdf", "writeup-2026.html",
                                        "writeup-cse599o.pdf", "writeup-cse599o.html"}
    # The answers before the appendix are counted for each edition, and are shorter than the whole.
    assert set(recorded["main_pages"]) == {"writeup.pdf", "writeup-2026.pdf", "writeup-cse599o.pdf"}
    assert 0 < recorded["main_pages"]["writeup.pdf"] < recorded["pdf"]["pages"]


def test_each_edition_answers_the_handout_within_the_page_budget() -> None:
    recorded = json.loads(mf.DEFAULT_MANIFEST.read_text())["main_pages"]
    assert all(pages <= mf.MAIN_PAGES_BUDGET for pages in recorded.values()), recorded


def test_sections_beyond_the_handout_follow_the_answers_under_appendix(results: Path) -> None:
    """Each edition: the handout's problems first, in its order; then one Appendix with what goes beyond it."""
    from cs336_systems.report.html import APPENDIX_HEADING

    for edition in editions.EDITIONS:
        doc = build_document(results, edition=edition)
        main, appendix = doc.sections[: doc.appendix_from], doc.sections[doc.appendix_from :]
        assert appendix and all(editions.in_appendix(edition, s.folder, s.problems) for s in appendix)
        continued = [s for s in appendix if s.number.endswith("+")]  # answers that continue beyond the handout
        # flash's model step and grids (where the handout asks flash); bucketed DDP's captured steps and
        # scaling only where results exist
        asks_flash = edition == "2025" or editions.asks(edition, "flash_benchmarking")
        assert ("flash_benchmarking" in [s.folder for s in continued]) == asks_flash
        assert all(s.problems == ("beyond the handout",) for s in continued)
        assert not any(editions.in_appendix(edition, s.folder, s.problems) for s in main)
        page = document_html(doc)
        assert page.count(APPENDIX_HEADING) == 1
        assert page.index(APPENDIX_HEADING) > page.index(f'id="{main[-1].anchor}"')
        assert page.index(APPENDIX_HEADING) < page.index(f'id="{appendix[0].anchor}"')
    assert [s.folder for s in _whole(build_document(results).sections[build_document(results).appendix_from :])] == \
        ["gradient_checkpointing", "flash_accuracy", "training_step", "leaderboard", "parallelism_strategies",
         "fsdp", "course_tests"]


def test_ddp_answers_and_bucket_size_come_from_the_measurements(results: Path) -> None:
    steps = pd.DataFrame({
        "variant": ["single", "naive", "flat"], "mode": ["single", "naive", "flat"],
        "step_ms": [100.0, 180.0, 150.0], "sync_ms": [float("nan"), 72.0, 45.0], "fwd_bwd_ms": [90.0, 95.0, 95.0],
        "optimizer_ms": [10.0, 10.0, 10.0], "world_size": [1, 2, 2], "preset": "xl", "autocast": "fp32",
        "context_length": 512, "batch_per_rank": 2, "steps": 10,
    })
    ResultWriter("naive_ddp", smoke=False).table(steps, "steps_xl_fp32")
    sizes = [2**20, 10 * 2**20, 100 * 2**20, 2**30]
    o, w = 50e-6, 100e9  # 50 µs per call, 100 GB/s: times follow t = o + size / w exactly
    allreduce = pd.DataFrame({"backend": "nccl", "world_size": 2, "size_bytes": sizes, "size": ["1MiB", "10MiB",
                              "100MiB", "1GiB"], "time_ms": [(o + s / w) * 1e3 for s in sizes]})
    ResultWriter("distributed_communication_single_node", smoke=False).table(allreduce, "allreduce")
    doc = build_document(results, strict=True)
    naive = doc.section("2.2").plain()
    assert "180 ms per step" in naive and "72.0 ms (40.0%)" in naive and "100 ms" in naive
    bucket = doc.section("2.3.3").plain()
    assert "o = 50.0" in bucket and "w = 100" in bucket
    from cs336_systems.configs import param_counts

    expected = (4 * param_counts("xl")["total"] * w * o) ** 0.5 / 2**20
    assert fmt.tex_sig(expected) + r"\,\mathrm{MiB}" in bucket


def test_a_section_that_cannot_read_its_data_says_so_and_keeps_the_rest(results: Path) -> None:
    bad = pd.DataFrame({"size": ["small"], "forward_mean_ms": ["fast"], "forward_std_ms": ["?"],
                        "backward_mean_ms": ["slow"], "backward_std_ms": ["?"]})
    ResultWriter("benchmarking", smoke=False).table(bad, "timings")
    with pytest.raises(TypeError):
        build_document(results, strict=True)
    doc = build_document(results)
    sec = doc.section("1.1.3")
    assert "could not be formatted" in sec.plain()
    assert any(isinstance(b, Table) and b.source.endswith("timings.csv") for b in sec.walk())
    assert len(_whole(doc.sections)) == len(EXPECTED_SECTIONS)


def test_sections_open_with_their_notebooks_commentary(results: Path, tmp_path: Path) -> None:
    import nbformat

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# §2.2 Naive DDP\n\nEvery rank all-reduces each gradient.\n\n"
                                              "The section's code, parameters and answer text: `naive_ddp.py`."),
                nbformat.v4.new_code_cell("print(1)")]
    nbformat.write(nb, notebooks / "naive_ddp.ipynb")
    doc = build_document(results, strict=True, notebooks=notebooks)
    text = doc.section("2.2+").plain()  # how it was measured opens the section's part of the appendix
    assert "Every rank all-reduces each gradient." in text and "# §2.2" not in text
    assert "Every rank all-reduces each gradient." not in doc.section("2.2").plain()
    assert "naive_ddp.py" not in text  # the notebook's pointer to its code is for the notebook's reader
    assert "notebooks/" not in doc.section("2.3.1").plain()

    pdf, manifest = tmp_path / "w.pdf", tmp_path / "m.json"
    pdf.write_bytes(b"%PDF")
    mf.write_manifest(pdf, results, manifest, notebooks)
    assert mf.check_manifest(pdf, results, manifest, notebooks) == []
    nb.cells[1].source = "print(2)"  # code is not quoted: still fresh
    nbformat.write(nb, notebooks / "naive_ddp.ipynb")
    assert mf.check_manifest(pdf, results, manifest, notebooks) == []
    nb.cells[0].source = nb.cells[0].source.replace("gradient.", "gradient. Edited.")
    nbformat.write(nb, notebooks / "naive_ddp.ipynb")
    assert mf.check_manifest(pdf, results, manifest, notebooks) == [
        "notebook file changed since the last build: " + str((notebooks / "naive_ddp.ipynb").resolve())]


def test_tables_fold_mean_and_std_and_turn_wide_short_tables() -> None:
    from cs336_systems.report.tables import for_print

    df = pd.DataFrame({"size": ["small", "xl"], "status": ["ok", "ok"], "forward_mean_ms": [12.34, 98.7],
                       "forward_std_ms": [0.12, 1.5], "forward_min_ms": [12.0, 97.0], "forward_max_ms": [13.0, 99.0]})
    out, notes = for_print(df)
    assert list(out.columns) == ["size", "forward_ms"]  # std/min/max folded, all-ok status dropped
    assert out["forward_ms"].tolist() == ["12.34 ± 0.12", "98.70 ± 1.5"] and notes
    wide = pd.DataFrame({"config": ["a", "b"], **{f"throughput_{i}": [123456.5, 2.5] for i in range(24)}})
    out, notes = for_print(wide)
    assert list(out.columns) == ["config", "a", "b"] and len(out) == 24 and "transposed to fit the page" in notes
    assert out.iloc[0].tolist() == ["throughput_0", "123,456", "2.500"]


def _have_browser() -> bool:
    from cs336_systems.report.pdf import find_browser

    try:
        find_browser()
    except RuntimeError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _have_browser(), reason="needs a headless Chromium (apt-get install chromium)")
def test_pdf_renders_end_to_end(results: Path, tmp_path: Path) -> None:
    from cs336_systems.writeup.build import build

    _write_benchmarking(results)
    pdf, html_path, index, pdf26, html26, pdf_cse, html_cse, _ = build(tmp_path / "w.pdf", results,
                                                                      manifest=tmp_path / "m.json", strict=True)
    assert html_path == tmp_path / "w.html" and index == results / "index.html"
    assert (pdf26, html26) == (tmp_path / "w-2026.pdf", tmp_path / "w-2026.html")
    assert pdf26.read_bytes().startswith(b"%PDF") and "CS336 2026 edition" in html26.read_text()
    assert (pdf_cse, html_cse) == (tmp_path / "w-cse599o.pdf", tmp_path / "w-cse599o.html")
    assert pdf_cse.read_bytes().startswith(b"%PDF") and "CSE599-O edition" in html_cse.read_text()
    data = pdf.read_bytes()
    import re

    pages = len(re.findall(rb"/Type\s*/Page(?!s)", data))
    assert data.startswith(b"%PDF") and pages >= 5  # title, 15 sections of prompts and derivations
    assert mf.check_manifest(pdf, results, tmp_path / "m.json") == []
    assert json.loads((tmp_path / "m.json").read_text())["pdf"]["pages"] == pages
    assert "45.7 ms" in html_path.read_text()
    index.write_text(index.read_text() + " ")
    assert mf.check_manifest(pdf, results, tmp_path / "m.json") == [f"{index} is not the one built with the PDF"]
    again = build(tmp_path / "again.pdf", results, manifest=None, strict=True)[0]
    assert again.read_bytes() == data, "an unchanged writeup must rebuild byte for byte the same"


def test_structure_ids_are_renumbered_in_order() -> None:
    from cs336_systems.report.pdf import renumber_structure_ids

    pdf = b"/ID (node00000174)>> /ID (node00000009)>> [(node00000009) 5 0 R (node00000174) 6 0 R]"
    assert renumber_structure_ids(pdf) == (b"/ID (node00000002)>> /ID (node00000001)>> "
                                           b"[(node00000001) 5 0 R (node00000002) 6 0 R]")
    assert len(renumber_structure_ids(pdf)) == len(pdf)


def test_pdf_dates_come_from_the_inputs_not_the_clock() -> None:
    from cs336_systems.report.pdf import stamp_dates

    pdf = b"%PDF\n/CreationDate (D:20261123180021+00'00')\n/ModDate (D:20261123180021+00'00')>>\n"
    stamped = stamp_dates(pdf, "2026-11-21T16:20:16+00:00")
    assert stamped == pdf.replace(b"20261123180021", b"20261121162016")
    assert len(stamp_dates(pdf, None)) == len(pdf) and b"19700101000000" in stamp_dates(pdf, None)


def test_manifest_dates_the_inputs(tmp_path) -> None:
    from cs336_systems.report.manifest import inputs_date

    for i, date in enumerate(["2026-01-02T00:00:00+00:00", "2026-03-04T05:06:07+00:00"]):
        (tmp_path / f"r{i}.meta.json").write_text(json.dumps({"date": date}))
    (tmp_path / "broken.meta.json").write_text("{}")
    assert inputs_date(tmp_path) == "2026-03-04T05:06:07+00:00"
    assert inputs_date(tmp_path / "empty") is None


def test_course_suite_results_are_shown_with_their_failures(results: Path) -> None:
    out = ResultWriter("course_tests", params={"edition": "2026", "course_version": "26.1.1"}, smoke=False)
    out.json({"counts": {"passed": 13, "failed": 1}, "failures": {"tests/test_fsdp.py::t[fp32]": "AssertionError: x"}},
             "2026")
    section = build_document(results, strict=True).section("4")
    tables = [b for b in section.walk() if isinstance(b, Table)]
    assert len(tables) == 1 and tables[0].frame.iloc[0].to_dict() == {"passed": 13, "failed": 1, "skipped": 0, "error": 0}
    assert "course version 26.1.1" in tables[0].caption
    assert any("Failed in the 2026 suite: `tests/test_fsdp.py::t[fp32]`: AssertionError: x" in b.plain()
               for b in section.walk())


def test_readme_maps_every_writeup_section() -> None:
    """The README's section map names every section of the writeup with its results folder."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "`figures/" in line]
    for spec in SECTIONS:
        row = next((r for r in rows if r.startswith(f"| {spec.number} |")), None)
        assert row is not None, f"§{spec.number} missing from the README's section map"
        assert f"`figures/{spec.name}/`" in row, spec.name


def test_results_cited_by_another_section_are_not_listed_again() -> None:
    from cs336_systems.writeup.build import _drop_cited

    def table(src: str) -> Table:
        return Table(pd.DataFrame({"x": [1]}), src, src, {})

    further = [Text("Further results in `a/`:", role="further"), table("a/x.csv"), table("a/y.csv"),
               Text("Further results in `b/`:", role="further"), table("b/z.csv")]
    kept = _drop_cited(further, {"a/x.csv", "b/z.csv"})
    assert [getattr(b, "source", b.plain()) for b in kept] == ["Further results in `a/`:", "a/y.csv"]


_GATHERS_EXTRA = {"model": "xl@2026", "compute_dtype": "bf16"}


def _write_one_rank_gathers_profile() -> ResultWriter:
    """fsdp_accounting (b)'s profile tables for one rank: a 10-ms forward whose compute runs 8.6 ms and whose
    first gather ends as compute resumes at 1.0 ms (late), the second while compute runs."""
    from cs336_systems.profiling.gather_waits import gather_summary, gather_waits

    rows = [("v", "phase", "phase", "forward", 0.0, 10.0)]
    rows += [("v", "cuda:7", "compute", "k", s, d) for s, d in ((0.0, 0.1), (1.0, 4.0), (5.5, 4.5))]
    rows += [("v", "cuda:19", "comm", "ncclDevKernel_AllGather_RING_LL", s, d) for s, d in ((0.05, 0.95), (2.0, 1.0))]
    tl = pd.DataFrame(rows, columns=["variant", "lane", "kind", "name", "start_ms", "dur_ms"])
    out = ResultWriter("fsdp", params={"nproc": [2], "global_batch": 4, "context_length": 512}, smoke=False)
    out.table(gather_summary(tl), "gathers_summary", extra=_GATHERS_EXTRA)
    out.table(gather_waits(tl), "gathers_forward", extra=_GATHERS_EXTRA)
    out.table(tl, "gathers_timeline", extra=_GATHERS_EXTRA)
    return out


def test_fsdp_gather_answer_reads_the_profile(results: Path) -> None:
    """fsdp_accounting (b): the verdict follows the measured waits (one late gather, the first one)."""
    _write_one_rank_gathers_profile()
    text = build_document(results, strict=False).section("3.1").plain()
    assert "2.7B (3.41 B parameters)" in text and "with 2 all-gathers, one per sharded weight matrix" in " ".join(text.split())  # 2026's xl, as 2025 names it
    assert "Yes, except the first gather, which no compute precedes to hide it." in text
    assert "compute waited for 1 of them, 0.900 ms in all" in " ".join(text.split())
    # why late when the link could carry it: compute's share of the forward and how often the host issued a kernel
    flat = " ".join(text.split())
    assert "Compute ran only" not in flat and "forward is paced by its host" not in flat  # compute fills 86% of it
    from cs336_systems.experiments.fsdp_gathers import _lanes_named
    from cs336_systems.report.data import SectionData

    assert _lanes_named(SectionData(results, "fsdp", edition="2026")) == (
        " Rows: cuda:7 (stream 7) is the compute stream, cuda:19 (stream 19) is NCCL's stream; the title's xl@2026 "
        "is this handout's xl.")


@pytest.mark.parametrize("forward_gpu_ms, forward_host_ms, verdict", [
    (20.0, 19.0, "paced by the host's launches too"),  # the GPU's forward lasts as long as its host issued it
    (9.5, 2.0, "the late gathers above were the profiler's host time"),  # within 1.5x of compute: GPU kept busy
    (30.0, 2.0, "the GPU waited for the gathers"),  # the host ran ahead, and still the forward is long
])
def test_fsdp_gather_answer_reads_the_unprofiled_steps(results: Path, forward_gpu_ms: float, forward_host_ms: float,
                                                       verdict: str) -> None:
    """fsdp_accounting (b): the unprofiled steps say whether an ordinary forward is paced by its host, against the
    profiled step's compute kernel time (8.6 ms here)."""
    from cs336_systems.report import fmt

    out = _write_one_rank_gathers_profile()
    steps = pd.DataFrame([{"variant": "v", "rank": 0, "forward_host_ms": forward_host_ms,
                           "forward_gpu_ms": forward_gpu_ms, "step_ms": 40.0}])
    out.table(steps, "gathers_unprofiled", extra={**_GATHERS_EXTRA, "statistic": "median of 10 unprofiled steps per rank"})
    flat = " ".join(build_document(results, strict=False).section("3.1").plain().split())
    assert (f"Without the profiler (median of 10 unprofiled steps per rank): on rank 0, the forward ran "
            f"{fmt.ms(forward_gpu_ms)} on the GPU") in flat
    assert verdict in flat
    assert "8.60 ms of compute kernels" in flat


@pytest.mark.parametrize("fsdp2_gpu_ms, verdict", [(10.0, "Ours takes 1.82× FSDP2's: both are paced by their hosts, so the extra host time is our wrapper's"),
                                                   (18.0, "Ours is within 5.26% of FSDP2's")])
def test_fsdp_unprofiled_forward_is_set_beside_torchs(fsdp2_gpu_ms: float, verdict: str) -> None:
    """The unprofiled forward of our FSDP beside torch's FSDP2 and DDP, the slower rank's: whose host paces it."""
    from cs336_systems.experiments.fsdp_gathers import _against_torch

    rows = [{"strategy": s, "rank": r, "forward_gpu_ms": g + r, "forward_host_ms": g - 1}
            for s, g in (("fsdp", 19.0), ("fsdp2", fsdp2_gpu_ms), ("ddp", 8.0)) for r in (0, 1)]
    table = pd.DataFrame(rows)
    text = " ".join(_against_torch(table, table[table["strategy"] == "fsdp"], "bf16").split())
    assert "under torch's FSDP2 (one all-gather per Transformer block), " in text
    assert "under torch DDP (no gathers: the unsharded model under bf16 autocast), 9.00 ms on the GPU, issued in 7.00 ms" in text
    assert verdict in text
    assert _against_torch(table.drop(columns="strategy"), table) == ""


@pytest.mark.parametrize("ours_range, verdict", [((95.0, 140.0), "inside the rounds' spread"),
                                                  ((125.0, 140.0), "the extra host time is our wrapper's")])
def test_fsdp_against_fsdp2_weighs_the_rounds_spread(ours_range: tuple, verdict: str) -> None:
    """Ours 1.25x FSDP2's median is a difference only where the rounds' medians do not overlap."""
    from cs336_systems.experiments.fsdp_gathers import _against_torch
    from cs336_systems.report import fmt

    lo, hi = ours_range
    table = pd.DataFrame([
        {"strategy": "fsdp", "forward_gpu_ms": 125.0, "forward_host_ms": 120.0, "forward_gpu_ms_round_lo": lo,
         "forward_gpu_ms_round_hi": hi},
        {"strategy": "fsdp2", "forward_gpu_ms": 100.0, "forward_host_ms": 90.0, "forward_gpu_ms_round_lo": 98.0,
         "forward_gpu_ms_round_hi": 110.0}])
    text = " ".join(_against_torch(table, table[table["strategy"] == "fsdp"]).split())
    assert verdict in text and f"round medians {fmt.sig(lo)}-{fmt.ms(hi)} against 98.0-110 ms" in text


def test_fsdp_captured_step_is_set_beside_the_eager_one() -> None:
    """The captured step's replays against the eager step of ours, the slower rank's each, with the rounds' range."""
    from cs336_systems.experiments.fsdp_gathers import _captured

    table = pd.DataFrame([
        {"strategy": "fsdp", "rank": 0, "step_ms": 300.0, "step_ms_round_lo": 280.0, "step_ms_round_hi": 360.0},
        {"strategy": "fsdp", "rank": 1, "step_ms": 310.0, "step_ms_round_lo": 290.0, "step_ms_round_hi": 370.0},
        {"strategy": "fsdp_graph", "rank": 0, "step_ms": 150.0, "step_ms_round_lo": 148.0, "step_ms_round_hi": 151.0},
        {"strategy": "fsdp_graph", "rank": 1, "step_ms": 149.0, "step_ms_round_lo": 147.0, "step_ms_round_hi": 150.0}])
    text = " ".join(_captured(table, table[table["strategy"] == "fsdp"]).split())
    assert ("the whole step takes 150 ms against the eager step's 310 ms (round medians 148-151 ms against "
            "290-370 ms), 2.07× faster") in text
    assert _captured(table[table["strategy"] == "fsdp"], table[table["strategy"] == "fsdp"]) == ""
    fused = table[table["strategy"] == "fsdp"].assign(strategy="fsdp_fused", step_ms=[250.0, 260.0],
                                                       step_ms_round_lo=240.0, step_ms_round_hi=270.0)
    text = " ".join(_captured(pd.concat([table, fused]), table[table["strategy"] == "fsdp"]).split())
    assert ("the whole step takes 150 ms against the eager step's 260 ms with the same optimizer (round medians "
            "148-151 ms against 240-270 ms), 1.73× faster; with our AdamW the eager step takes 310 ms") in text


@pytest.mark.parametrize("fsdp2_ranges, verdict", [
    (((18.0, 21.0), (60.0, 55.0, 62.0)), "FSDP2's take 20.0 ms and 60.0 ms, neither apart from ours beyond the "
                                         "rounds' spread (round medians 19.0-21.0 ms against 18.0-21.0 ms; "
                                         "58.0-61.0 ms against 55.0-62.0 ms)"),
    (((18.0, 21.0), (52.0, 50.0, 55.0)), "FSDP2's forward 20.0 ms (level within the rounds' spread) and step 52.0 ms "
                                   "(ours 1.15× it, beyond the spread)")])
def test_fsdp_per_block_gathers_are_set_beside_ours_and_fsdp2(fsdp2_ranges: tuple, verdict: str) -> None:
    """Ours with one gather per block against ours per layer (faster beyond the spread: the ratio) and FSDP2,
    level or not by the rounds' ranges of each of forward and step."""
    from cs336_systems.experiments.fsdp_gathers import _per_block

    (flo, fhi), (step, slo, shi) = fsdp2_ranges
    row = lambda s, f, lo, hi, st, st_lo, st_hi: {  # noqa: E731
        "strategy": s, "forward_gpu_ms": f, "forward_host_ms": f - 1, "forward_gpu_ms_round_lo": lo,
        "forward_gpu_ms_round_hi": hi, "step_ms": st, "step_ms_round_lo": st_lo, "step_ms_round_hi": st_hi}
    table = pd.DataFrame([row("fsdp", 30.0, 28.0, 33.0, 80.0, 75.0, 85.0),
                          row("fsdp_block", 20.0, 19.0, 21.0, 60.0, 58.0, 61.0),
                          row("fsdp2", 20.0, flo, fhi, step, slo, shi)])
    text = " ".join(_per_block(table, table[table["strategy"] == "fsdp"]).split())
    assert "our forward takes 20.0 ms on the GPU, issued in 19.0 ms (round medians 19.0-21.0 ms against 28.0-33.0 ms)" \
           ", 0.667× of the per-layer forward, and the step 60.0 ms against 80.0 ms" in text
    assert verdict in text
    assert _per_block(table[table["strategy"] != "fsdp_block"], table[table["strategy"] == "fsdp"]) == ""
    unranged = table.drop(columns=["step_ms_round_lo", "step_ms_round_hi"])  # no spread: no verdict on the step
    assert "step 52.0 ms (ours 1.15× it)." in " ".join(_per_block(unranged, unranged[unranged["strategy"] == "fsdp"]
                                                                  ).split()) or step != 52.0


def test_fsdp_waiting_rank_is_explained_by_its_peer_waits() -> None:
    """The rank whose compute waited for every gather is said to have waited for rank 0 when its gathers' peer
    wait covers most of it; a rank that arrived last is said to have waited for none; else nothing is claimed."""
    from cs336_systems.experiments.fsdp_gathers import _why_rank_waited

    waited = pd.Series({"late_gathers": 226, "wait_ms": 162.1, "peer_wait_ms": 174.5})
    assert _why_rank_waited(waited, 0, 226, "rank 0") == (
        " (compute stalled 162 ms), because its gathers spent 174 ms waiting for rank 0 to issue the same gathers")
    last = pd.Series({"late_gathers": 0, "wait_ms": 0.0, "peer_wait_ms": 0.0})
    assert _why_rank_waited(last, 226, 226, "rank 0") == ", since that rank reached every gather last"
    assert _why_rank_waited(waited, 226, 226, "rank 0").startswith(" (compute stalled 162 ms)")  # arriving last explains no wait
    assert _why_rank_waited(waited.replace(174.5, 10.0), 0, 226, "rank 0") == ""  # its own compute, not the peer


def test_fsdp_main_answer_states_the_unprofiled_and_captured_steps_in_one_sentence(results: Path) -> None:
    from cs336_systems.experiments.fsdp_gathers import unprofiled_in_brief
    from cs336_systems.report.data import SectionData

    out = _write_one_rank_gathers_profile()  # 8.60 ms of compute
    steps = pd.DataFrame([
        {"strategy": "fsdp", "variant": "v", "rank": 0, "forward_host_ms": 25.0, "forward_gpu_ms": 26.0,
         "step_ms": 80.0},
        {"strategy": "fsdp_graph", "variant": "v", "rank": 0, "step_ms": 30.0}])
    out.table(steps, "gathers_unprofiled", extra=_GATHERS_EXTRA)
    text = " ".join(unprofiled_in_brief(SectionData(results, "fsdp", edition="2026")).plain().split())
    assert text.startswith("Without the profiler the slower rank's forward still takes 26.0 ms on the GPU, about its "
                           "host's issue time (25.0 ms) and 3.02× the profiled compute, so the hosts set the pace. "
                           "Replaying the per-weight step captured in a CUDA graph cuts it from 80.0 ms to 30.0 ms")
    # with the same fused optimizer timed eagerly, the graph is weighed against that step; a per-block forward
    # faster beyond the rounds' spread is named as the fix of our wrapper's share
    ranged = {"forward_gpu_ms_round_lo": 25.0, "forward_gpu_ms_round_hi": 27.0}
    more = pd.DataFrame([
        {"strategy": "fsdp_fused", "variant": "v", "rank": 0, "forward_host_ms": 25.0, "forward_gpu_ms": 26.0,
         "step_ms": 70.0},
        {"strategy": "fsdp_block", "variant": "v", "rank": 0, "forward_host_ms": 18.0, "forward_gpu_ms": 19.0,
         "step_ms": 60.0, "forward_gpu_ms_round_lo": 18.0, "forward_gpu_ms_round_hi": 20.0}])
    out.table(pd.concat([steps.assign(**ranged), more]), "gathers_unprofiled", extra=_GATHERS_EXTRA)
    text = " ".join(unprofiled_in_brief(SectionData(results, "fsdp", edition="2026")).plain().split())
    assert ("Gathering each Transformer block's weights in one all-gather instead of each weight's (`gather_units`) "
            "shrinks the host time our wrapper adds beyond FSDP2's: the forward then takes 19.0 ms and the step 60.0 ms "
            "(80.0 ms with a gather per weight).") in text
    assert "cuts it from 70.0 ms (eager, with torch's fused AdamW, which the graph uses) to 30.0 ms" in text
    slow_block = more.assign(forward_gpu_ms_round_lo=19.0, forward_gpu_ms_round_hi=26.0)  # inside ours' spread
    out.table(pd.concat([steps.assign(**ranged), slow_block]), "gathers_unprofiled", extra=_GATHERS_EXTRA)
    assert "gather_units" not in unprofiled_in_brief(SectionData(results, "fsdp", edition="2026")).plain()
    out.table(steps.assign(forward_host_ms=5.0), "gathers_unprofiled", extra=_GATHERS_EXTRA)  # the host ran ahead
    assert unprofiled_in_brief(SectionData(results, "fsdp", edition="2026")) is None


def test_bucketed_answer_separates_eager_and_captured_steps(results: Path) -> None:
    base = {"preset": "xl", "autocast": "bf16", "context_length": 512, "batch_per_rank": 2, "steps": 10,
            "world_size": 2, "step_ms_std": 1.0, "step_ms_median": 0.0}
    rows = []
    for graph in (False, True):
        tag = ", CUDA graph" if graph else ""
        single = 100.0 if not graph else 60.0
        rows += [
            {"variant": "single" + (" (CUDA graph)" if graph else ""), "mode": "single", "step_ms": single},
            {"variant": "torch" + (" (CUDA graph)" if graph else ""), "mode": "torch", "step_ms": single + 20,
             "comm_dtype": "fp32"},
            {"variant": f"bucketed (1MB{tag})", "mode": "bucketed", "bucket_size_mb": 1.0, "comm_dtype": "fp32",
             "step_ms": single + 10},
            {"variant": f"bucketed (1MB, bf16 comm{tag})", "mode": "bucketed", "bucket_size_mb": 1.0,
             "comm_dtype": "bf16", "step_ms": single + 30},
        ]
        for r in rows[-4:]:
            r["cuda_graph"] = graph
    steps = pd.DataFrame(rows).assign(**base)
    steps["step_ms_median"] = steps["step_ms"]
    steps["overhead_ms"] = steps["step_ms"] - steps["cuda_graph"].map({False: 100.0, True: 60.0})
    steps["vs_single"] = steps["step_ms"] / steps["cuda_graph"].map({False: 100.0, True: 60.0})
    ResultWriter("ddp_bucketed", smoke=False).table(steps, "steps_xl_bf16")
    doc = build_document(results, strict=False)
    assert "Step time by bucket size: 1.00 MiB 110 ms; the best" in doc.section("2.3.3").plain()  # eager, fp32 wire
    # The handout's answers in the main body; the notebook's account of the method opens the appendix's part.
    main = doc.section("2.3.3").plain()
    assert "Step time by bucket size" in main and "How it was measured" not in main
    text = doc.section("2.3.3+").plain()  # the captured steps: beyond the handout, in the appendix
    assert text.index("How it was measured (from `notebooks/ddp_bucketed") < text.index("Under bf16 autocast")
    assert "Under bf16 autocast, captured: one GPU 60.0 ms, torch DDP 80.0 ms, ours 70.0 ms–70.0 ms" in text
    assert "0.875×–0.875× torch's step time, faster at 1 of 1 bucket sizes" in text
    assert "(eager, in the same run: 0.917×–0.917×" in text


def test_run_parameters_show_what_differs_from_the_preset() -> None:
    """A record of a section's run prints only the values that differ from its preset (what repeating it needs);
    a parameter that defaults to None ("auto") prints as resolved; a record of no section prints every value."""
    from cs336_systems.report.data import params_line, preset_defaults

    full = preset_defaults("flash_benchmarking", "full")
    assert full is not None and full["parts"] != ["shapes"] and full["poly_exp2"] is None
    meta = {"section": "flash_benchmarking", "params": {**full, "preset": "full"}}
    assert params_line(meta) == "--full (the preset's values)"
    meta["params"].update(parts=["shapes"], poly_exp2="dkdv+tuned", kernel_options={"autotune": True})
    assert params_line(meta) == "--full, with parts=[shapes] (resolved: poly_exp2=dkdv+tuned)"
    grid = preset_defaults("memory_profiling", "full", "2026")
    assert grid is not None and grid != preset_defaults("memory_profiling", "full")
    assert params_line({"section": "memory_profiling/2026", "params": {**grid, "preset": "full", "edition": "2026"}}
                       ) == "--full --edition 2026 (the preset's values)"
    assert params_line({"section": "lab_runs", "params": {"steps": 3, "preset": "xl"}}) == "steps=3, preset=xl"
    assert preset_defaults("flash_benchmarking", "nonsense") is None


def test_landscape_figures_go_to_the_end_of_their_section_two_to_a_page(tmp_path: Path) -> None:
    """A figure too wide for a portrait page is placed after the rest of its section (where it was cited, a
    note with its number), so the portrait text before it fills its page; two or more share landscape pages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cs336_systems.report.document import Figure, Question, Section
    from cs336_systems.report.html import _Counter, section_html

    def png(name: str, size: tuple[float, float]) -> Figure:
        fig = plt.figure(figsize=size, dpi=150)
        fig.savefig(tmp_path / name)
        plt.close(fig)
        return Figure(tmp_path / name, f"caption {name}", name, {})

    wide, narrow = png("wide.png", (14, 4)), png("narrow.png", (6, 4))
    one = Section("9", "One", "one", (), [Question("a", "first", [wide, Text("after the wide figure")]), narrow])
    page = section_html(one, _Counter())
    assert "(Figure 1: on a landscape page at the end of this section.)" in page
    assert page.index("after the wide figure") < page.index("<b>Figure 2.</b>") < page.index("<b>Figure 1.</b>")
    assert 'class="landscape"' in page and "shared" not in page
    two = Section("9", "Two", "two", (), [wide, Text("between"), png("wide2.png", (14, 4)),
                                          Text("3 further tables", role="further")])
    page = section_html(two, _Counter())
    assert page.count('class="landscape shared"') == 2 and page.index("between") < page.index("<b>Figure 1.</b>")
    # the closing note follows the landscape pages, so it never fills a portrait page of its own before them
    assert page.index("<b>Figure 2.</b>") < page.index("3 further tables")


def test_step_mfu_counts_one_gpus_share_of_the_batch() -> None:
    """MFU of a timed step: the model's FLOPs of the rows' batch (one rank's share) over the step, against the
    data-sheet peak of the run's device in the row's precision; recomputation is not counted."""
    from cs336_systems.configs import step_flops
    from cs336_systems.report.answers import step_mfu

    h100 = {"device": "NVIDIA H100 80GB HBM3", "float32_matmul_precision": "highest"}
    rows = pd.DataFrame({"preset": ["small", "small"], "batch_per_rank": [2, 2], "context_length": [512, 512],
                         "step_ms": [100.0, float("nan")], "autocast": ["bf16", "bf16"]})
    out = step_mfu(rows, h100)
    tflops = step_flops("small", 2, 512, "train") / 0.1 / 1e12
    assert out.loc[0, "TFLOP_per_s"] == pytest.approx(tflops)
    assert out.loc[0, "MFU_pct"] == pytest.approx(100 * tflops / 989.4, rel=1e-3)  # H100 SXM bf16 dense
    assert math.isnan(out.loc[1, "MFU_pct"])
    fp32 = step_mfu(rows.drop(columns="autocast"), h100)  # no precision column: fp32 at "highest"
    assert fp32.loc[0, "MFU_pct"] == pytest.approx(100 * tflops / 66.9, rel=1e-3)
    assert step_mfu(rows.drop(columns="preset"), h100) is not None and "MFU_pct" not in step_mfu(
        rows.drop(columns="preset"), h100)  # nothing to count the FLOPs of: unchanged
    from cs336_systems.benchmarking.leaderboard_8b import LeaderboardShape

    shape = LeaderboardShape(num_layers=4, context_length=8192)
    one = step_mfu(pd.DataFrame({"step_ms": [466.5]}), h100, model=shape.config(), batch=2, context=8192,
                   precision="bf16")
    assert one.loc[0, "TFLOP_per_s"] == pytest.approx(step_flops(shape.config(), 2, 8192) / 0.4665 / 1e12)


def test_short_single_word_text_cells_never_wrap_and_long_ones_may() -> None:
    from cs336_systems.report.html import table_html

    frame = pd.DataFrame({"preset": ["medium", "10B@2026"], "note": ["a long note with spaces in it", "x" * 40],
                          "ms": [1.5, 2.5]})
    out = table_html(Table(frame, "t", "figures/x/t.csv", {}), 1)
    assert '<td class="txt word">medium</td>' in out and '<td class="txt word">10B@2026</td>' in out
    assert '<td class="txt">a long note with spaces in it</td>' in out and f'<td class="txt">{"x" * 40}</td>' in out
    from cs336_systems.report.html import CSS

    assert "td.txt.word { white-space: nowrap; }" in CSS


def test_the_runs_preset_and_a_sections_own_preset_parameter_are_told_apart(tmp_path, monkeypatch) -> None:
    """Records keep the run's preset under run_preset, and a section's own "preset" parameter (a model) under
    "preset"; older records, where the run's preset overwrote that parameter, lose the model rather than
    pass the run's preset off as it."""
    from cs336_systems.experiments import get
    from cs336_systems.experiments.__main__ import writer
    from cs336_systems.report.data import params_line, preset_defaults, run_params

    monkeypatch.setenv("CS336_FIGURES_DIR", str(tmp_path))
    section = get("gradient_checkpointing")
    params = section.params("full", {"preset": "2.7B"})
    recorded = writer(section, params, "full", publish=False).params
    assert recorded["run_preset"] == "full" and recorded["preset"] == "2.7B"
    assert params_line({"section": "gradient_checkpointing", "params": recorded}) == "--full, with preset=2.7B"
    old = {**{k: v for k, v in recorded.items() if k != "run_preset"}, "preset": "full"}  # as older runs wrote it
    assert "preset" not in run_params("gradient_checkpointing", old)
    assert params_line({"section": "gradient_checkpointing", "params": old}) == "--full (the preset's values)"
    # a section without such a parameter keeps "preset" as the run's preset, old record or new
    flash = get("flash_benchmarking")
    recorded = writer(flash, flash.params("full", {}), "full", publish=False).params
    assert recorded["preset"] == recorded["run_preset"] == "full"
    full = preset_defaults("flash_benchmarking", "full")
    assert run_params("flash_benchmarking", {**full, "preset": "full"})["preset"] == "full"
    assert params_line({"section": "flash_benchmarking", "params": recorded}) == "--full (the preset's values)"


def test_ddp_overhead_fit_names_its_model_from_the_runs_step_table(tmp_path) -> None:
    from cs336_systems.experiments.ddp_common import _model_column
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "ddp_bucketed"
    folder.mkdir()
    pd.DataFrame({"preset": ["xl", "xl"], "ms": [1.0, 2.0]}).to_csv(folder / "steps_xl_fp32.csv", index=False)
    d = SectionData(tmp_path, "ddp_bucketed")
    assert _model_column(d, "overhead_model_xl_fp32", "overhead_model") == "xl"
    assert _model_column(d, "overhead_model_large_fp32", "overhead_model") is None  # no such step table
    assert _model_column(d, "other_xl_fp32", "overhead_model") is None


def test_memory_answer_names_the_tensors_not_file_and_line() -> None:
    """memory_profiling (e): each large allocation is named by the tensor its line assigns, with its shape."""
    from cs336_systems.experiments import memory_profiling as mp
    from cs336_systems.report.data import SectionData
    from cs336_systems.results import FIGURES_DIR

    data = SectionData(FIGURES_DIR, "memory_profiling")
    text = mp._largest_text(data.frame("largest_allocations"), data.meta("largest_allocations")).markdown
    assert "are 128 MiB, each a batch × heads × seq × seq tensor (4 × 32 × 512 × 512, fp32), made at 5 lines: " in text
    assert "`scores` = `Q @ K.transpose(-2, -1) / math.sqrt(d)` in `scaled_dot_product_attention` (×64, twice per " \
           "layer)" in text  # the product and its scaled copy: counted, and said per layer
    assert "model.py:" not in text
    assert mp._per_layer(64, 32) == "twice per layer" and mp._per_layer(33, 32) == "33 over 32 layers"


def test_bucketed_ddp_answer_says_what_was_expected_whether_it_held_and_what_setup_would_show_it() -> None:
    """ddp_bucketed_benchmarking (a) asks three things beyond the timings; each is answered from the data."""
    from cs336_systems.experiments import ddp_bucketed
    from cs336_systems.report.data import SectionData
    from cs336_systems.results import FIGURES_DIR

    question = next(q for q in ddp_bucketed.answer(SectionData(FIGURES_DIR, "ddp_bucketed")) if q.label == "a")
    text = " ".join(b.markdown for b in question.blocks if hasattr(b, "markdown"))
    assert "**Expected:** a U in bucket size" in text
    assert "**No U:**" in text  # the committed sweep: 1 MB best, every larger size slower
    assert ", and by median step the best size (" in text
    assert ") beats" in text or ") does not beat" in text  # against flat and per-parameter overlap
    assert "**A setup that would show the U:** a slower link" in text


def test_bucketed_ddp_shape_reads_medians_and_names_the_per_tensor_degenerate_case() -> None:
    from cs336_systems.experiments.ddp_bucketed import _expectations

    def rows(times, medians, buckets):
        return pd.DataFrame({"bucket_size_mb": [1.0, 10.0, 100.0, 1000.0], "step_ms": times, "step_ms_median": medians,
                             "step_ms_std": [0.5] * 4, "num_buckets": buckets})

    individual = pd.Series({"step_ms": 219.0, "step_ms_median": 209.0, "step_ms_std": 20.0, "num_buckets": 327.0})
    flat = pd.Series({"step_ms": 220.0, "step_ms_median": 219.5, "step_ms_std": 1.7, "num_buckets": 1.0})
    rising = _expectations(rows([207, 208, 212, 213], [206, 207.5, 211, 212], [327, 40, 8, 4]), flat, individual)
    assert "**No U:**" in rising and "every bucket holds one tensor, 327 buckets" in rising
    # The best size is the per-parameter scheme: against its own run the gap is between runs, not schemes.
    assert "beats flat (220 ms)." in rising and "not per-parameter overlap" not in rising
    assert "its gap to the per-parameter run (209 ms) is one between runs, not between schemes" in rising  # medians
    # a best size of several tensors per bucket is compared with both, each pair by its own spread
    several = _expectations(rows([209, 205, 212, 213], [208, 204, 211, 212], [327, 40, 8, 4]), flat, individual)
    assert "beats flat (220 ms) but not per-parameter overlap (209 ms) beyond the spread" in several
    u_shape = _expectations(rows([215, 200, 205, 213], [215, 200, 205, 213], [300, 40, 8, 4]), flat,
                            pd.Series({"step_ms": 230.0, "step_ms_std": 1.0, "num_buckets": 327.0}))
    assert " A U: " in u_shape and "beats flat (220 ms) and per-parameter overlap (230 ms)." in u_shape
    # a variant from another run is compared at this run's speed: scaled by the two runs' single-GPU steps
    slower_host = pd.Series({**flat, "_from": "§2.3.1", "_single": 220.0})
    single = pd.Series({"step_ms": 200.0, "step_ms_median": 200.0})
    scaled = _expectations(rows([207, 208, 212, 213], [206, 207.5, 211, 212], [327, 40, 8, 4]), slower_host,
                           pd.Series({**individual, "step_ms_median": 200.0}), single)
    # 219.5 ms on a host whose single step is 220 ms is 199.5 ms at this run's 200 ms: no longer beaten
    assert "flat (220 ms in §2.3.1's run, 200 ms scaled to this run by the ratio of the two runs' single-GPU steps)" in scaled
    assert "does not beat flat" in scaled


def test_bucketed_ddp_states_its_step_time_against_torch_ddp_and_calls_a_difference_within_the_spread_none(
        tmp_path) -> None:
    from cs336_systems.experiments.ddp_common import torch_parity
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "ddp_bucketed"
    folder.mkdir()
    for autocast, (eager_ours, graph_ours) in {"fp32": (110.0, 99.5), "bf16": (90.0, 101.2)}.items():
        rows = []
        for graph, ours in ((False, eager_ours), (True, graph_ours)):
            tag = " (CUDA graph)" if graph else ""
            rows += [{"variant": "single" + tag, "mode": "single", "step_ms": 95.0, "cuda_graph": graph},
                     {"variant": "torch" + tag, "mode": "torch", "step_ms": 100.0, "cuda_graph": graph},
                     {"variant": "bucketed (25MB)" + tag, "mode": "bucketed", "bucket_size_mb": 25.0,
                      "step_ms": ours, "cuda_graph": graph},
                     {"variant": "bucketed (1MB)" + tag, "mode": "bucketed", "bucket_size_mb": 1.0,
                      "step_ms": 50.0, "cuda_graph": graph}]
        steps = pd.DataFrame(rows).assign(autocast=autocast, world_size=2, comm_dtype="fp32", step_ms_std=0.5)
        steps["step_ms_median"] = steps["step_ms"]
        steps.to_csv(folder / f"steps_xl_{autocast}.csv", index=False)
        if autocast == "fp32":  # a second world size's run (--set nproc=2,4): ours 0.8× torch's, eager and captured
            four = steps.assign(world_size=4)
            four.loc[four["bucket_size_mb"] == 25.0, "step_ms"] = 80.0
            four.assign(step_ms_median=four["step_ms"]).to_csv(folder / "np4_xl_fp32.csv", index=False)
    text = torch_parity(SectionData(tmp_path, "ddp_bucketed")).markdown
    assert "both with 25 MiB buckets" in text
    # 1 ms of spread per pair: 110 vs 100 is slower, 99.5 no difference, 90 faster, 101.2 slower; the 1 MB rows are not the bar.
    assert ("on 2 GPUs in fp32 eager 1.10× (slower), captured 0.995× (within the steps' spread of ±1.00 ms: no "
            "difference); under bf16 autocast eager 0.900× (faster), captured 1.01× (slower); "
            "on 4 GPUs in fp32 eager 0.800× (faster), captured 0.800× (faster).") in text
    assert torch_parity(SectionData(tmp_path, "nothing_here")) is None


def test_step_verdict_calls_a_small_gap_inside_the_spread_no_difference_and_refuses_a_noisy_pair() -> None:
    from cs336_systems.report.answers import step_verdict

    assert step_verdict(99.0, 100.0, 0.5) == "faster" and step_verdict(101.0, 100.0, 0.5) == "slower"
    assert step_verdict(101.0, 100.0, 2.0) == "within the steps' spread of ±2.00 ms: no difference"
    # an 18% gap beside a 29% spread is not a tie: the run was too noisy to say anything
    assert step_verdict(416.0, 352.0, 119.0).startswith("the steps varied by ±119 ms, 34% of the step: too noisy")
    assert step_verdict(200.0, 100.0, 15.0) == "slower"  # twice as long is a result, however noisy the steps


def test_scaling_efficiency_holds_a_captured_step_to_the_captured_single_gpu_step(tmp_path) -> None:
    """A CUDA-graph step compared with the eager single-GPU step would credit the graph's saved launches to
    scaling; each row must be held to the single-GPU step of its own run and timing mode."""
    from cs336_systems.experiments.ddp_common import scaling_blocks
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "ddp_bucketed"
    folder.mkdir()
    scaling = []
    for name, world, eager, graph in (("steps_xl_bf16", 2, 200.0, 125.0), ("np4_xl_bf16", 4, 210.0, 130.0)):
        rows = pd.DataFrame([
            {"variant": "single", "mode": "single", "cuda_graph": False, "step_ms": 160.0, "world_size": 1},
            {"variant": "single (CUDA graph)", "mode": "single", "cuda_graph": True, "step_ms": 110.0, "world_size": 1},
            {"variant": "bucketed (1MB)", "mode": "bucketed", "cuda_graph": False, "step_ms": eager, "world_size": world},
            {"variant": "bucketed (1MB, CUDA graph)", "mode": "bucketed", "cuda_graph": True, "step_ms": graph,
             "world_size": world}]).assign(autocast="bf16")
        rows.to_csv(folder / f"{name}.csv", index=False)
        for r in rows[rows["mode"] != "single"].itertuples():
            # what the measuring run wrote: every row against the eager single-GPU step
            scaling.append({"autocast": "bf16", "variant": r.variant, "world_size": world, "step_ms": r.step_ms,
                            "sequences_per_s": world * 2e3 / r.step_ms, "scaling_efficiency": 160.0 / r.step_ms})
    pd.DataFrame(scaling).to_csv(folder / "scaling.csv", index=False)
    marker, question = scaling_blocks(SectionData(tmp_path, "ddp_bucketed"))
    assert marker.role == BEYOND_HANDOUT  # beyond the handout: the appendix, whichever section shows it
    text, table = question.blocks[:2]
    shown = table.frame.set_index(["variant", "world_size"])["scaling_efficiency"]
    # the bucket caps as printed are MiB (``mib_labels``)
    assert shown[("bucketed (1 MiB, CUDA graph)", 4)] == pytest.approx(110.0 / 130.0)
    assert shown[("bucketed (1 MiB, CUDA graph)", 2)] == pytest.approx(110.0 / 125.0)
    assert shown[("bucketed (1 MiB)", 2)] == pytest.approx(160.0 / 200.0)
    assert "4 GPUs 61.5 sequences/s with bucketed (1 MiB, CUDA graph) (bf16, 84.6% of" in text.markdown


def test_fsdp_accounting_b_finds_the_gpu_idle_between_kernels_of_the_profiled_forward(tmp_path) -> None:
    from cs336_systems.experiments.fsdp_gathers import _idle_text
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "fsdp"
    folder.mkdir()
    rows = [("phase", "forward", 0.0, 10.0), ("phase", "backward", 10.0, 5.0),
            ("compute", "gemm", 0.0, 1.0), ("comm", "ncclDevKernel_AllGather", 0.5, 1.0), ("compute", "gemm", 2.0, 1.0),
            ("compute", "gemm", 6.0, 1.0), ("compute", "gemm", 11.0, 1.0)]  # the last one is backward's
    pd.DataFrame(rows, columns=["kind", "name", "start_ms", "dur_ms"]).assign(variant="v", lane="cuda:7").to_csv(
        folder / "gathers_timeline.csv", index=False)
    pd.DataFrame([{"span_ms": 10.0, "gathers": 1, "gather_ms": 1.0, "gather_beside_compute_ms": 0.5,
                   "late_gathers": 0, "wait_ms": 0.0, "max_wait_ms": 0.0}]).to_csv(folder / "gathers_summary.csv",
                                                                                   index=False)
    (folder / "gathers_summary.meta.json").write_text(json.dumps({"extra": {"model": "small"}}))
    text = _idle_text(SectionData(tmp_path, "fsdp")).markdown
    # busy 0–1.5, 2–3, 6–7 inside the 10 ms forward: idle 0.5 + 3 + 3 = 6.5 ms in 2 gaps and the tail
    assert "the GPU is idle for 6.50 ms (65.0%), in 2 gaps between kernels (median 1,750 µs)" in text
    assert "issued 3 compute kernels and 1 all-gathers, one every 2,500 µs" in text
    assert "only 0.500 ms of their 1.00 ms overlaps a compute kernel" in text
    assert _idle_text(SectionData(tmp_path, "nothing")) is None


def test_an_edition_writeup_cites_its_own_section_numbers() -> None:
    from cs336_systems.writeup.build import _renumbered
    from cs336_systems.report.document import Figure, Question, Text

    numbers = {"2.1": "5.1", "2.3.2": "5.3.2"}
    text = _renumbered(Text("the fit of §2.1 and the profile in §2.3.2; §1.4 is not here"), numbers).markdown
    assert text == "the fit of §5.1 and the profile in §5.3.2; `writeup.pdf` §1.4 is not here"
    assert _renumbered(Text("run `notes §2.1` as in §2.1"), numbers).markdown == "run `notes §2.1` as in §5.1"
    q = _renumbered(Question("a", "as in §2.1", [Figure(Path("x.png"), "see §2.3.2", "", {})]), numbers)
    assert q.prompt == "as in §5.1" and q.blocks[0].caption == "see §5.3.2"


def test_memory_b_says_which_moment_sets_the_training_peak_at_each_context() -> None:
    from cs336_systems.experiments.memory_profiling import _train_peak_breakdown

    rows = [("forward", 128, 12.0, 10.0), ("forward", 512, 25.0, 10.0),  # 2 and 15 GiB of activations
            ("train", 128, 40.5, 30.0), ("train", 512, 45.2, 30.0)]      # state: weights + two moments
    peaks = pd.DataFrame(rows, columns=["mode", "context_length", "peak_GiB", "allocated_before_GiB"]).assign(
        precision="fp32", status="ok")
    text = _train_peak_breakdown(peaks)
    assert "Context 128: 2.00 GiB of activations, so the optimizer step (40.0 GiB predicted, 40.5 GiB measured)" in text
    assert "context 512: 15.0 GiB of activations, so the end of the forward (45.0 GiB predicted" in text
    assert "(3.0 copies of the weights" in text and "once the activations outgrow one copy" in text
    assert _train_peak_breakdown(None) == ""


def test_memory_b_answers_inference_and_the_training_step_per_context_and_names_what_autograd_keeps(tmp_path) -> None:
    """The handout's forward pass is inference only: (b) gives its peak and the training step's per context;
    an inference cell that fits where the autograd forward ran out of memory still answers."""
    import json

    from cs336_systems.experiments import memory_profiling as mp
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "memory_profiling"
    folder.mkdir()
    rows = [("inference", 128, 14.0, "ok"), ("forward", 128, 16.0, "ok"), ("train", 128, 52.0, "ok"),
            ("inference", 2048, 20.0, "ok"), ("forward", 2048, None, "OOM"), ("train", 2048, None, "OOM")]
    pd.DataFrame(rows, columns=["mode", "context_length", "peak_GiB", "status"]).assign(
        precision="fp32", allocated_before_GiB=12.75).to_csv(folder / "peak_memory.csv", index=False)
    (folder / "peak_memory.meta.json").write_text(json.dumps({"params": {"size": "xl@2026"}, "device": "H100"}))
    blocks = mp.answer(SectionData(tmp_path, "memory_profiling"))
    b = next(q for q in blocks if getattr(q, "label", None) == "b")
    text = " ".join(getattr(x, "markdown", "") for x in b.blocks)
    assert ("in fp32: at context 128, inference forward 14.0 GiB, forward with autograd 16.0 GiB, training step "
            "52.0 GiB; at context 2048, inference forward 20.0 GiB.") in text
    assert "Ran out of memory: fp32 forward with autograd and fp32 training step at context 2048." in text
    skipped = mp._failed_cells(pd.DataFrame(rows, columns=["mode", "context_length", "peak_GiB", "status"]).assign(
        precision="fp32", status=["ok"] * 4 + ["OOM", "skipped (time budget)"]))
    assert skipped == (" Ran out of memory: fp32 forward with autograd at context 2048. Not run: fp32 training step "
                       "at context 2048 (skipped (time budget)).")
    assert "out of memory" in text and "raises the forward's peak" not in text  # (b) asks for a table
    appendix = [q for q in blocks if getattr(q, "label", None) == "b" and q is not b]
    assert any("raises the forward's peak from 14.0 GiB to 16.0 GiB" in getattr(x, "markdown", "")
               for q in appendix for x in q.blocks)
    table = next(x for x in b.blocks if hasattr(x, "frame"))
    # the handout's two passes first, under its names; the autograd forward last
    assert list(table.frame.columns) == ["context_length", "forward_pass_GiB", "training_step_GiB",
                                         "forward_with_autograd_GiB"]


def test_memory_d_derives_the_residual_stream_at_the_reference_shape_and_names_the_measured_one(tmp_path) -> None:
    """The handout's reference hyperparameters are batch 4 and context 512; a run that measured the tensor at its
    longest context gives that size beside it."""
    import json

    from cs336_systems.experiments import memory_profiling as mp
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "memory_profiling"
    folder.mkdir()
    (folder / "residual_stream.json").write_text(json.dumps({"shape": [4, 2048, 2560], "dtype": "torch.float32",
                                                             "measured_bytes": 83886080, "predicted_bytes": 83886080}))
    (folder / "residual_stream.meta.json").write_text(json.dumps({"params": {"size": "xl@2026"}}))
    d = next(q for q in mp.answer(SectionData(tmp_path, "memory_profiling")) if getattr(q, "label", None) == "d")
    text = " ".join(getattr(x, "markdown", "") for x in d.blocks)
    assert "At the reference batch size 4 and context length 512 one residual-stream tensor is 20.00 MiB; at " \
           "context 2048, where the run measured it, 80.00 MiB." in text


def test_ddp_verdicts_follow_the_numbers_and_survive_missing_spreads() -> None:
    from cs336_systems.experiments.ddp_flat import _verdict
    from cs336_systems.experiments.optimizer_state_sharding import _sharding_verdict

    naive = pd.Series({"step_ms": 100.0, "step_ms_std": float("nan"), "num_buckets": 435.0, "grad_bytes": 8e9})
    assert _verdict(naive, pd.Series({"step_ms": 68.0, "step_ms_std": None})).startswith(
        "One all-reduce of the flattened gradients takes the step from 100 ms (naive DDP, timed in this run beside "
        "it) to 68.0 ms, 32.0 ms shorter, more than the two rows' summed spread (±0 ms): batching pays.")
    assert "10.0 ms longer, more than the two rows' summed spread (±0 ms): flat DDP is slower." in \
        _verdict(naive, pd.Series({"step_ms": 110.0}))
    assert ("to 101 ms, 1.00 ms (1.00%) longer, within the two rows' summed step-to-step spread (±5.00 ms): a "
            "difference this run cannot resolve." in _verdict(naive, pd.Series({"step_ms": 101.0, "step_ms_std": 5.0})))
    assert "to 97.0 ms, 3.00 ms (3.00%) shorter, within" in _verdict(naive, pd.Series({"step_ms": 97.0, "step_ms_std": 5.0}))
    # With §2.1's fit the reason is the measured split: 435 calls × 20 µs = 8.7 ms fixed, 8 GB / 400 GB/s = 20 ms.
    why = _verdict(naive, pd.Series({"step_ms": 101.0, "step_ms_std": 5.0}), {"o": 20e-6, "w": 400e9})
    assert "435 calls' fixed cost is 8.70 ms against 20.0 ms to move 8.00 GB" in why
    assert "so flattening can remove at most the fixed cost" in why and "overlap" not in why  # no wait recorded
    # naive waited 20 ms for 28.7 ms of calls one at a time: back-to-back calls overlapped
    fast = _verdict(pd.Series({**naive, "sync_ms": 20.0}), pd.Series({"step_ms": 101.0, "step_ms_std": 5.0}),
                    {"o": 20e-6, "w": 400e9})
    assert "naive's wait (20.0 ms) is less than their sum: calls launched back to back overlap" in fast
    slow = _verdict(pd.Series({**naive, "sync_ms": 28.0}), pd.Series({"step_ms": 101.0, "step_ms_std": 5.0}),
                    {"o": 20e-6, "w": 400e9})
    assert "overlap" not in slow and "at most the fixed cost" in slow

    def timing(adamw: float, sharded: float, std: float) -> pd.DataFrame:
        return pd.DataFrame({"optimizer": ["adamw", "sharded"], "step_ms": [adamw, sharded], "step_ms_std": [std, 1.0]})

    assert "here the difference (-19.0 ms) is within the steps' spread" in _sharding_verdict(timing(475.0, 456.0, 73.0))
    assert "4.00 ms per step net here" in _sharding_verdict(timing(627.0, 631.0, 0.5))
    assert "saves more than the broadcast costs, 20.0 ms" in _sharding_verdict(timing(476.0, 456.0, float("nan")))


def test_mixed_precision_noise_note_reads_only_rows_that_ran() -> None:
    from cs336_systems.experiments.mixed_precision import _noise_note

    def rows(*cells):
        return pd.DataFrame(cells, columns=["size", "precision", "status", "forward_mean_ms", "forward_std_ms",
                                            "forward_min_ms"])

    assert _noise_note(rows(("small", "fp32", "ok", 20.0, 1.0, 19.0))) == ""  # no bf16 rows
    noisy = rows(("small", "fp32", "ok", 20.0, 1.0, 19.0), ("small", "bf16", "ok", 30.0, 12.0, 10.0),
                 ("xl", "fp32", "ok", 200.0, 1.0, 199.0), ("xl", "bf16", "OOM", None, None, None))
    text = _noise_note(noisy)
    assert "standard deviation up to 40% of the mean, small" in text and "speed-up is small 1.90×" in text
    assert "xl" not in text  # its bf16 cell did not run
    assert _noise_note(rows(("small", "fp32", "ok", 20.0, 1.0, 19.0), ("small", "bf16", "ok", 10.0, 0.1, 9.9))) == ""


def test_mixed_precision_speedups_use_the_fastest_steps_where_the_means_are_noisy() -> None:
    from cs336_systems.experiments.mixed_precision import _not_run, _robust

    cols = ["size", "precision", "status", "forward_mean_ms", "forward_std_ms", "forward_min_ms", "backward_mean_ms",
            "backward_std_ms", "backward_min_ms"]
    timings = pd.DataFrame([("small", "fp32", "ok", 20.0, 1.0, 19.0, 40.0, 1.0, 39.0),
                            ("small", "bf16", "ok", 25.0, 10.0, 10.0, 30.0, 0.5, 29.0),
                            ("xl", "fp32", "ok", 200.0, 1.0, 198.0, 400.0, 1.0, 399.0),
                            ("xl", "bf16", "ok", 60.0, 1.0, 55.0, 100.0, 1.0, 99.0)], columns=cols)
    speed = pd.DataFrame({"size": ["small", "xl"], "forward_bf16_ms": [25.0, 60.0], "backward_bf16_ms": [30.0, 100.0],
                          "forward_speedup": [0.8, 200 / 60], "backward_speedup": [40 / 30, 4.0]})
    shown, phases, why = _robust(speed, timings)
    assert phases == ["forward", "backward"]  # one basis: the steady backward is read by its fastest steps too
    assert why == (" by each run's fastest step in both passes, since the means are noisy (standard deviation up "
                   "to 40% of the mean, small bf16 forward)")
    assert shown["forward_speedup"].tolist() == [1.9, 198 / 55] and shown["forward_bf16_ms"].tolist() == [10.0, 55.0]
    assert shown["backward_speedup"].tolist() == [39 / 29, 399 / 99]
    assert shown.attrs["noisy"] == ["forward"]  # the backward is only rebased: its means are not blamed on noise
    one = _robust(speed, timings.drop(columns="backward_min_ms"))
    assert one[1] == ["forward"] and one[2].startswith(" by each run's fastest step in the forward pass,")
    assert _robust(speed, timings.assign(forward_std_ms=1.0)) == (speed, [], "")  # steady: the means as they are
    assert _robust(speed, None)[2] == ""
    # The 2026 handout's 10B: named where no row has it, with its status where its run failed.
    assert _not_run(speed, timings, "2026") == (" The handout's medium, large and 10B (this run's sizes leave it "
                                                "out; its fp32 weights and gradients alone take 95.6 GiB) were not "
                                                "run.")
    failed = pd.concat([timings, pd.DataFrame([("10B", "fp32", "OOM")], columns=cols[:3])])
    assert _not_run(speed.assign(size=["small", "xl"]), failed, "2026").endswith("10B (OOM) were not run.")
    assert _not_run(pd.DataFrame({"size": ["small", "medium", "large", "xl", "2.7B"]}), timings, "2025") == ""


def test_mixed_precision_answer_quotes_the_fastest_steps_and_explains_the_means_slowdown(tmp_path) -> None:
    from cs336_systems.experiments.mixed_precision import SECTION
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "mixed_precision"
    folder.mkdir()
    timings = pd.DataFrame([("small", "fp32", "ok", 23.0, 7.4, 20.3, 43.3, 9.6, 40.1),
                            ("small", "bf16", "ok", 25.0, 9.3, 12.9, 37.3, 10.8, 29.9),
                            ("2.7B", "fp32", "ok", 334.5, 0.5, 334.2, 707.3, 3.0, 706.0),
                            ("2.7B", "bf16", "ok", 85.4, 30.3, 71.2, 140.9, 0.9, 140.3)],
                           columns=["size", "precision", "status", "forward_mean_ms", "forward_std_ms",
                                    "forward_min_ms", "backward_mean_ms", "backward_std_ms", "backward_min_ms"])
    timings.to_csv(folder / "precision_timings.csv", index=False)
    wide = timings.pivot(index="size", columns="precision", values=["forward_mean_ms", "backward_mean_ms"])
    speed = pd.DataFrame({"size": ["small", "2.7B"]})
    for phase in ("forward", "backward"):
        for p in ("fp32", "bf16"):
            speed[f"{phase}_{p}_ms"] = wide.loc[speed["size"], (f"{phase}_mean_ms", p)].to_numpy()
        speed[f"{phase}_speedup"] = speed[f"{phase}_fp32_ms"] / speed[f"{phase}_bf16_ms"]
    speed.to_csv(folder / "bf16_speedup.csv", index=False)

    def part_c(edition: str) -> tuple[str, list[str]]:
        (c, *_) = [q for q in SECTION.answer(SectionData(tmp_path, "mixed_precision", edition=edition))
                   if getattr(q, "label", None) == "c"]
        table = next(b for b in c.blocks if getattr(b, "frame", None) is not None)
        return " ".join(b.plain() for b in c.blocks if hasattr(b, "plain")), list(table.frame.columns)

    text, columns = part_c("2025")
    assert ("(fp32 time / bf16 time) by each run's fastest step in both passes, since the means are noisy (standard deviation up "
            "to 37% of the mean, small bf16 forward): the forward pass 1.57× for small and 4.69× for 2.7B; the "
            "backward pass 1.34× and 5.03×. By the means, bf16 is slower in small forward 0.920×: a few slow bf16 "
            "steps (the spread above), not the precision, since the same runs' fastest steps are faster in bf16.") \
        in text  # the table's mean columns, explained
    assert text.count("The handout's medium, large and xl were not run.") == 1  # last, after the reasons
    assert columns[-2:] == ["forward_fastest_speedup", "backward_fastest_speedup"]
    text, _ = part_c("2026")
    assert "4.69× for xl;" in text and "The handout's medium, large and 10B (this run's sizes leave it out" in text


def test_fsdp_answer_discloses_the_course_fsdp_tests_that_fail(tmp_path) -> None:
    from cs336_systems.experiments.fsdp import _course_test_failures
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "course_tests"
    folder.mkdir()
    (folder / "2026.json").write_text(json.dumps({"failures": ["tests/test_fsdp.py::test_fsdp_correctness[fp32]",
                                                               "tests/test_ddp.py::test_other"]}))
    (folder / "2025.json").write_text(json.dumps({"failures": {}}))
    text = _course_test_failures(SectionData(tmp_path, "fsdp")).markdown
    assert text.startswith("The course's own suite fails `test_fsdp_correctness[fp32]`:") and "test_other" not in text
    (folder / "2026.json").write_text(json.dumps({"failures": {
        "tests/test_fsdp.py::test_fsdp_correctness[fp32]":
            "AssertionError: Step 0: Parameter embedding.weight mismatch. Max diff: 2.9802322387695312e-08"}}))
    text = _course_test_failures(SectionData(tmp_path, "fsdp")).markdown
    assert "the parameters differ (at step 0, `embedding.weight` by 2.98e-08 on the GPU);" in text
    (folder / "2026.json").write_text(json.dumps({"failures": []}))
    assert _course_test_failures(SectionData(tmp_path, "fsdp")) is None


def test_edition_grids_read_their_own_edition_of_other_sections(tmp_path) -> None:
    """An edition grid's answers compare with the same edition's all-reduce fit (one cost model per writeup):
    §2.1's alpha per ring step becomes a call's latency 2(p-1)·alpha and its bandwidth B·p/(2(p-1))."""
    from cs336_systems.experiments.ddp_common import published_fit
    from cs336_systems.report.data import SectionData

    for folder, alpha in (("distributed_communication_single_node", 20.0),
                          ("distributed_communication_single_node/cse599o", 13.5)):
        (tmp_path / folder).mkdir(parents=True)
        pd.DataFrame({"backend": ["nccl"], "world_size": [2], "alpha_us": [alpha], "bandwidth_GBps": [330.0],
                      "points": [4]}).to_csv(tmp_path / folder / "allreduce_alpha_beta.csv", index=False)
    (tmp_path / "naive_ddp" / "cse599o").mkdir(parents=True)
    grid = SectionData(tmp_path, "naive_ddp/cse599o").sibling("distributed_communication_single_node")
    assert grid.folder == "distributed_communication_single_node/cse599o"
    fit = published_fit(grid)
    assert fit["o"] == pytest.approx(27e-6) and fit["w"] == pytest.approx(330e9)
    assert SectionData(tmp_path, "naive_ddp").sibling("distributed_communication_single_node").folder == \
        "distributed_communication_single_node"
    assert SectionData(tmp_path, "ddp_flat/2026").sibling("distributed_communication_single_node").folder == \
        "distributed_communication_single_node"  # no 2026 grid of it: the workbook's own


def test_a_slow_step_that_inflates_a_mean_is_named_with_the_median() -> None:
    from cs336_systems.experiments.ddp_common import outlier_note

    assert "the median step is 209 ms" in outlier_note(pd.Series({"step_ms": 219.3, "step_ms_std": 20.0,
                                                                  "step_ms_median": 209.0}))
    assert outlier_note(pd.Series({"step_ms": 220.0, "step_ms_std": 1.7, "step_ms_median": 219.4})) == ""
    assert outlier_note(pd.Series({"step_ms": 220.0, "step_ms_std": 30.0})) == ""  # no median recorded


def test_a_code_problem_names_its_implementation_and_the_course_tests_outcome(tmp_path) -> None:
    from cs336_systems.report.answers import implemented
    from cs336_systems.report.data import SectionData

    (tmp_path / "course_tests").mkdir()
    (tmp_path / "course_tests" / "2025.json").write_text(json.dumps({"tests": {
        "tests/test_ddp.py::test_DistributedDataParallel[ToyModel]": "passed",
        "tests/test_ddp.py::test_DistributedDataParallel[Tied]": "failed",
        "tests/test_attention.py::test_flash": "passed"}}))
    text = implemented(SectionData(tmp_path, "ddp_bucketed"), "`DDPBucketed`", "cs336_systems/distributed/ddp_bucketed.py",
                       "tests/test_ddp_strategies.py", "test_ddp.py").markdown
    assert "`uv run pytest tests/test_ddp_strategies.py` checks it against single-process training" in text
    assert "The course's `test_ddp.py`: 1 of 2 passed on the GPU (§4)." in text
    none = implemented(SectionData(tmp_path, "x"), "X", "x.py", "tests/t.py", "test_missing.py").markdown
    assert "runs through `tests/adapters.py`" in none


def test_the_all_reduce_question_is_the_grids_own(tmp_path) -> None:
    """CSE599-O asks NCCL on 2, 4 and 8 GPUs; what the machine could not run is said with the command."""
    from cs336_systems.experiments import distributed_communication_single_node as ar
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "distributed_communication_single_node" / "cse599o"
    folder.mkdir(parents=True)
    pd.DataFrame({"backend": ["nccl", "nccl"], "world_size": [2, 2], "size_bytes": [1e6, 1e9], "size": ["1MB", "1GB"],
                  "time_ms": [0.03, 3.0], "busbw_GBps": [33.0, 330.0]}).to_csv(folder / "allreduce.csv", index=False)
    (folder / "allreduce.meta.json").write_text(json.dumps({"num_gpus": 2, "params": {"backends": ["nccl"],
                                                                                      "nproc": [2, 4, 8]}}))
    (folder / "topology.json").write_text(json.dumps({"links": {"0-1": "NV18"}, "gbps_per_link": 25.0,
                                                      "peak_busbw_GBps": {"2": 450.0}}))
    blocks = ar.answer(SectionData(tmp_path, "distributed_communication_single_node/cse599o"))
    q = blocks[0]
    assert q.prompt == "All-reduce latency for NCCL (GPU), 1 MB–1 GB of float32, 2, 4 and 8 processes."
    text = q.blocks[0].markdown
    assert "; **not measured: NCCL with 4 and 8 processes** (the machine had 2 GPUs" in text
    more = blocks[2].blocks[0].markdown  # the appendix: the command for the missing counts
    assert ("`python -m cs336_systems.experiments distributed_communication_single_node --full --edition cse599o` "
            "on a node with 8 GPUs") in more
    reference = q.blocks[1].markdown  # the handout's reference curve, derived in the answer itself
    assert reference.startswith("`nvidia-smi topo -m` shows NV18") and "so the reference curve is" in reference
    assert "of which 2 ranks reach 73.3% at 1GB" in reference


def test_sharding_memory_names_ddp_buckets_when_the_allocator_holds_more_than_the_parameters() -> None:
    from cs336_systems.experiments.optimizer_state_sharding import _buckets_note

    rank0 = pd.DataFrame({"optimizer": ["adamw", "sharded"], "after_init_allocated": [7.33, 7.39]})
    st = pd.DataFrame({"adamw measured": [3.61, 3.61]}, index=["parameters", "gradients"])
    assert "the allocator holds 3.72 GiB more" in _buckets_note(rank0, st)
    assert _buckets_note(rank0.assign(after_init_allocated=[3.7, 3.7]), st) == ""  # nothing unexplained


def test_published_fit_converts_the_ring_model_at_any_world_size(tmp_path) -> None:
    """t = 2(p-1)·alpha + 2(p-1)/p · n/B is o + n/w with o = 2(p-1)·alpha and w = B·p/(2(p-1)): at 4 ranks a call
    costs 6 alpha and moves data at 2/3 of B."""
    from cs336_systems.experiments.ddp_common import published_fit
    from cs336_systems.report.data import SectionData

    (tmp_path / "ar").mkdir()
    pd.DataFrame({"backend": ["nccl"], "world_size": [4], "alpha_us": [10.0], "bandwidth_GBps": [300.0]}).to_csv(
        tmp_path / "ar" / "allreduce_alpha_beta.csv", index=False)
    fit = published_fit(SectionData(tmp_path, "ar"), world_size=4)
    assert fit["o"] == pytest.approx(60e-6) and fit["w"] == pytest.approx(200e9)
    assert published_fit(SectionData(tmp_path, "ar"), world_size=2) is None  # no row, no raw times


def test_overlap_reason_follows_the_measured_share() -> None:
    from cs336_systems.experiments.ddp_overlap_individual import _why

    rows = {"flat": pd.Series({"fwd_bwd_ms": 195.0}), "overlap": pd.Series({"fwd_bwd_ms": 200.0, "step_ms": 209.0})}
    hidden = _why(pd.DataFrame({"variant": ["individual"], "comm_ms": [32.0], "comm_during_backward_ms": [31.7]}), rows)
    assert "so almost none of it is exposed, but the backward slows (200 ms forward and backward, against flat's" \
        " 195 ms)" in hidden
    partly = _why(pd.DataFrame({"variant": ["individual"], "comm_ms": [30.0], "comm_during_backward_ms": [6.0]}), rows)
    assert "so 80.0% of it still runs after backward, and the backward slows" in partly


def test_sharding_memory_explains_a_saving_after_the_step_larger_than_the_state() -> None:
    from cs336_systems.experiments.optimizer_state_sharding import _step_saving, _step_temporaries

    rank0 = pd.DataFrame({"optimizer": ["adamw", "sharded"], "after_step_peak": [22.15, 16.56],
                          "after_step_allocated": [18.54, 14.75]})
    text = _step_temporaries(rank0)
    assert "by 3.61 GiB replicated and 1.81 GiB sharded" in text and "(5.59 GiB)" in text
    assert _step_saving(rank0).startswith("; the peak after the step falls by more (5.59 GiB)")  # (a)'s clause
    assert _step_saving(rank0, 3.61) and _step_saving(rank0, 6.0) == ""  # "more" only beyond the state's saving
    assert _step_temporaries(rank0.assign(after_step_allocated=[22.15, 16.56])) == ""  # no transient at all
    assert _step_saving(rank0.assign(after_step_allocated=[22.15, 16.56])) == ""


def test_fsdp_expected_saving_from_the_accounting_beside_the_measured_one() -> None:
    """2026's fsdp_accounting (a), for the largest model at the first world size, named as each handout names it."""
    from cs336_systems.experiments.fsdp import _expected_saving, _model_label

    rows = []
    for model, scale in (("xl", 1.0), ("2.7B", 1.7)):
        for strategy, share, peak in (("ddp", 1.0, 76.5), ("fsdp", 0.5, 33.4)):
            rows.append({"model": model, "world_size": 2, "strategy": strategy, "status": "ok",
                         "parameters": 12.7 * share * scale, "gradients": 12.7 * share * scale,
                         "optimizer_state": 25.4 * share * scale, "predicted_total": (63.3 if share == 1 else 38.2) * scale,
                         "before_step_peak": peak * scale - 1, "after_step_peak": peak * scale})
    text = _expected_saving(pd.DataFrame(rows), "2025").markdown
    assert "for 2.7B (2560/10240/32/32)" in text
    assert "a saving of 43.2 GiB, ignoring the all-gather buffers" in text and "more than expected" in text
    assert "(the accounting with them: 108 → 64.9 GiB per GPU). **Measured:** 130 → 56.8 GiB, 73.3 GiB saved" in text
    assert "for xl (2560/10240/32/32)" in _expected_saving(pd.DataFrame(rows), "2026").markdown
    assert _model_label("xl", "2025") == "xl (1600/6400/48/25)"
    assert _model_label("xl", "2026") == "CS336 2025's xl (1600/6400/48/25)"
    assert _expected_saving(pd.DataFrame(rows[:1]), "2025") is None  # no FSDP row


def test_overlap_answer_says_when_the_other_precision_reverses_it(tmp_path) -> None:
    from cs336_systems.experiments.ddp_overlap_individual import _other_precision
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "ddp_overlap_individual"
    folder.mkdir()
    for dtype, mine in (("fp32", 560.0), ("bf16", 217.0)):
        pd.DataFrame({"variant": ["naive", "flat", "individual"], "mode": ["naive", "flat", "individual"],
                      "step_ms": [609.0 if dtype == "fp32" else 190.0, 610.0 if dtype == "fp32" else 192.0, mine]}
                     ).to_csv(folder / f"steps_xl_{dtype}.csv", index=False)
    d = SectionData(tmp_path, "ddp_overlap_individual")
    text = _other_precision(d, "steps_xl_fp32")
    assert "**Under bf16 autocast it is the other way round:** 217 ms against naive 190 ms and flat 192 ms" in text
    assert _other_precision(d, "steps_xl_bf16") == ""  # fp32's overlap wins: nothing to add


def test_fsdp_gathers_are_compared_with_the_all_reduce_fit(tmp_path) -> None:
    """Ring all-gather of S bytes over p ranks: (p-1)·alpha per call + (p-1)/p·S/B."""
    from cs336_systems.configs import param_counts
    from cs336_systems import accounting
    from cs336_systems.experiments.fsdp_gathers import _gather_model
    from cs336_systems.report import fmt
    from cs336_systems.report.data import SectionData

    (tmp_path / "distributed_communication_single_node").mkdir()
    pd.DataFrame({"backend": ["nccl"], "world_size": [2], "alpha_us": [10.0], "bandwidth_GBps": [250.0]}).to_csv(
        tmp_path / "distributed_communication_single_node" / "allreduce_alpha_beta.csv", index=False)
    d = SectionData(tmp_path, "fsdp")
    psi = param_counts(accounting.ladder_config("tiny"))["total"]
    predicted = 100 * 10e-3 + 0.5 * psi * 2 / 250e9 * 1e3  # ms: 100 calls of alpha, half the bf16 bytes at B
    slow = _gather_model(d, "tiny", 2, "bf16", pd.Series({"gathers": 100, "gather_ms": 500.0}))
    assert f"predicts {fmt.ms(predicted)} for these gathers" in slow and "an upper bound on the transfer" in slow
    near = _gather_model(d, "tiny", 2, "bf16", pd.Series({"gathers": 100, "gather_ms": predicted}))
    assert "close to what their kernels took" in near
    assert _gather_model(d, "tiny", 2, "int8", pd.Series({"gathers": 100, "gather_ms": 1.0})) == ""


def test_answers_report_the_other_precision_flattening_memory_and_the_sharding_expectation(tmp_path) -> None:
    from cs336_systems.experiments.ddp_flat import _memory
    from cs336_systems.experiments.naive_ddp import _other_precision
    from cs336_systems.experiments.optimizer_state_sharding import _activations_note, _expectation
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "naive_ddp"
    folder.mkdir()
    for dtype, step, sync in (("fp32", 609.0, 52.3), ("bf16", 189.0, 53.0)):
        pd.DataFrame({"variant": ["naive"], "mode": ["naive"], "step_ms": [step], "sync_ms": [sync]}).to_csv(
            folder / f"steps_xl_{dtype}.csv", index=False)
    data = SectionData(tmp_path, "naive_ddp")
    text = _other_precision(data, "steps_xl_fp32", pd.Series({"sync_ms": 52.3}))
    assert text == (" Under bf16 autocast: 189 ms per step, 53.0 ms communicating (28.0%). The gradients stay fp32 "
                    "under autocast, so the bytes all-reduced are the same; the share changes with the step's length.")
    # the same bytes taking 1.5x as long is not called "the same bytes in a shorter step"
    slower = _other_precision(data, "steps_xl_fp32", pd.Series({"sync_ms": 35.0}))
    assert slower.endswith("yet they took 53.0 ms here against 35.0 ms: not more traffic, but a collective's time "
                           "on one rank also counts its wait for the other ranks to reach the call, which differs "
                           "from run to run.")
    assert "raises the peak from 52.5 to 65.0 GiB" in _memory(pd.Series({"peak_mem_gib": 52.5}),
                                                            pd.Series({"peak_mem_gib": 65.0}))
    assert _memory(pd.Series({"peak_mem_gib": 52.5}), pd.Series({"peak_mem_gib": 52.6})) == ""
    st = pd.DataFrame({"adamw measured": [25.4, 13.61], "sharded measured": [12.7, 13.6],
                       "adamw predicted": [25.4, 12.53], "sharded predicted": [12.7, 12.53]},
                      index=["optimizer_state", "activations"])
    said = _expectation(st)
    assert "goes from 25.4 to 12.7 GiB, as predicted," in said and said.startswith(" As expected")  # not twice
    assert said.endswith("do not change.") and _expectation(st, "; more").endswith("do not change; more.")
    assert "8.62% above the accounting's per-block estimate" in _activations_note(st)  # the appendix's
    close = _expectation(st.assign(**{"sharded measured": [12.9, 13.6]}))  # within 5%, but reads differently
    assert "goes from 25.4 to 12.9 GiB, as predicted (25.4 → 12.7)," in close
    assert "goes from 25.4 to 20.0 GiB, against a prediction of 25.4 → 12.7 GiB," in _expectation(
        st.assign(**{"sharded measured": [20.0, 13.6]}))


def test_sharding_answer_says_torchs_zero_communicates_as_ours_and_zero1_is_analytic(tmp_path) -> None:
    from cs336_systems.experiments.optimizer_state_sharding import _zero_note
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "optimizer_state_sharding"
    folder.mkdir()
    pd.DataFrame({"strategy": ["ddp", "sharded_optimizer", "zero1"], "GB_sent_per_rank": [8.0, 12.0, 8.0]}).to_csv(
        folder / "zero1_comparison.csv", index=False)
    data = SectionData(tmp_path, "optimizer_state_sharding")
    assert _zero_note(data) == ""  # no ZeroRedundancyOptimizer measured: nothing to tell apart
    pd.DataFrame({"optimizer": ["adamw", "sharded", "zero"], "step_ms": [467.0, 455.0, 456.0]}).to_csv(
        folder / "timing.csv", index=False)
    note = _zero_note(SectionData(tmp_path, "optimizer_state_sharding"))
    assert "PyTorch's, which keeps DDP's full all-reduce and then broadcasts each parameter from its owner, our " \
           "communication pattern; the table's `zero1` row is the analytic reduce-scatter/all-gather scheme" in note


def test_an_edition_moves_a_question_its_handout_answers_elsewhere_to_the_appendix() -> None:
    """2026's FlashAttention section must not answer 2026's leaderboard with 2025's kernel timing: the question
    goes past the beyond-the-handout marker; questions of its own problems, and labels the handout does not
    use, stay where they are."""
    from cs336_systems.report.document import BEYOND_HANDOUT, Question, Text
    from cs336_systems.writeup.build import _foreign_to_appendix, _problem_ids

    ids = _problem_ids("2026")
    assert "leaderboard" in ids and "flash_benchmarking" in ids
    own = ("flash_forward", "flash_backward", "flash_benchmarking")
    bench, board, extra = Question("flash_benchmarking", "p"), Question("leaderboard", "p"), Question("model", "p")
    marker = Text("", role=BEYOND_HANDOUT)
    assert _foreign_to_appendix([bench, board, marker, extra], own, ids) == [bench, marker, board, extra]
    assert _foreign_to_appendix([bench, board], own, ids)[:1] == [bench]
    assert _foreign_to_appendix([bench, board], own, ids)[2:] == [board]
    assert _foreign_to_appendix([bench, extra], own, ids) == [bench, extra]
    # CSE599-O names its naive-DDP problems differently; the workbook's labels are not another of its problems
    assert "naive_ddp" not in _problem_ids("cse599o")


def test_sharding_breakdown_says_why_its_components_exceed_the_peak() -> None:
    from cs336_systems.experiments.optimizer_state_sharding import _not_all_at_once

    rank0 = pd.DataFrame({"optimizer": ["adamw"], "before_step_peak": [23.58], "after_init_allocated": [7.33]})
    st = pd.DataFrame({"adamw measured": [3.61, 3.61, 7.22, 8.56]},
                      index=["parameters", "gradients", "optimizer_state", "activations"])
    text = _not_all_at_once(rank0, st)
    assert text.startswith(" Added up, these come to 26.7 GiB against a peak of 23.6 GiB before the step")
    assert "frees each block's saved activations" in text
    assert _not_all_at_once(rank0.assign(before_step_peak=30.0), st) == ""  # they fit under the peak: nothing to say


def test_warmup_answer_names_slow_steps_that_more_warmup_did_not_remove() -> None:
    from cs336_systems.experiments.benchmarking import _late_outliers

    rows = [("small", 0, "OOM", None, None), ("small", 1, "ok", 20.6, 20.9), ("small", 5, "ok", 20.1, 35.6),
            ("large", 1, "ok", 121.7, 123.2), ("large", 5, "ok", 121.9, 125.8)]
    study = pd.DataFrame(rows, columns=["size", "warmup", "status", "forward_min_ms", "forward_max_ms"])
    text = _late_outliers(study)
    assert "1 of 4 cells have a forward step more than 1.3× slower than their fastest, small after 5 (35.6 ms " \
           "against 20.1 ms), while the same sizes were steady after 1 warm-up step" in text
    assert _late_outliers(study[study["size"] == "large"]).startswith(" Here no cell with warm-up")
    assert _late_outliers(None) == ""


def test_sharding_timing_states_its_setup() -> None:
    from cs336_systems.experiments.optimizer_state_sharding import _setup

    meta = {"params": {"model": "xl@2026", "global_batch": 4, "context_length": 512, "warmup": 3, "steps": 10,
                       "nproc": [2, 4], "world_size": 2}}
    assert _setup(meta, "2026") == ("xl, fp32, 4 sequences of 512 tokens per step over 2 GPUs, torch DDP for the "
                                    "gradients, torch's default (multi-tensor) AdamW, mean of 10 steps after 3 warm-up "
                                    "steps")
    assert _setup(meta).startswith("2.7B, fp32")  # the 2025 handout's name for the same model
    assert _setup({"params": {"model": "xl"}}) == ""


def test_compile_answer_compares_its_eager_times_with_the_attention_table() -> None:
    from cs336_systems.experiments.torch_compile import _against_eager_table

    att = pd.DataFrame({"d_model": [16, 64], "seq_len": [256, 4096], "forward_eager_ms": [0.30, 10.3]})
    eager = pd.DataFrame({"d_model": [16, 64, 64], "seq_len": [256, 4096, 4096], "status": ["ok", "ok", "ok"],
                          "forward_mean_ms": [0.38, 10.0, 5.0], "backward_mean_ms": [1.0, 20.0, 9.0],
                          "compiled": [False, False, True]})
    text = _against_eager_table(att, eager)
    assert "at the same 2 shapes" in text and "(farthest at d = 16, 256 tokens: 0.300 ms against 0.380 ms)" in text
    assert "the shapes whose forward takes 1 ms or more agree within 3.00%" in text  # the compiled row is not eager
    assert _against_eager_table(att, None) == ""
    from cs336_systems.experiments.torch_compile import _long_cells_gap  # the main text's figure, the same one

    assert _long_cells_gap(att, eager) == pytest.approx(0.03) and _long_cells_gap(att.iloc[:1], eager) is None


def test_compile_answer_sets_the_sections_gap_against_the_spread_between_processes() -> None:
    from cs336_systems.experiments.torch_compile import _between_processes

    def processes(pytorch: list[float], compiled: list[float]) -> pd.DataFrame:
        return pd.DataFrame([{"round": r, "section": section, "d_model": 128, "seq_len": 256, "phase": "forward",
                              "ms": ms} for section, times in (("pytorch_attention", pytorch), ("torch_compile", compiled))
                             for r, ms in enumerate(times)])

    text, table = _between_processes(processes([0.22, 0.16, 0.35], [0.16, 0.24, 0.15]))
    assert "Timed again in 3 fresh processes per section" in text and "cells at 256 tokens" in text
    assert "no larger than between one process and the next" in text and len(table) == 1
    steady, _ = _between_processes(processes([0.30, 0.31, 0.30], [0.16, 0.17, 0.16]))
    assert "a steady gap, beyond the processes' spread" in steady
    once, _ = _between_processes(processes([0.3], [0.2]))
    assert "one process each" in once
    assert _between_processes(None) == ("", None)


def test_2026_answers_memory_profiling_f_in_its_own_section_with_the_residuals_measured_in_3() -> None:
    """The handout asks (f) under memory profiling; the workbook measures it with the checkpointing section.
    The edition shows it where the handout asks it, once."""
    from cs336_systems.report.document import Question, Text
    from cs336_systems.writeup.build import _with_borrowed, build_document

    doc = build_document(edition="2026")
    labels = {s.number: [b.label for b in s.blocks if isinstance(b, Question)] for s in doc.sections}
    assert labels["2.1.6"][-1] == "f" and "residuals" not in labels["3"] and "f" not in labels["3"]
    method = Text("how", role="method")
    assert _with_borrowed([Question("a", "p"), method], [Question("f", "q")])[1].label == "f"


def test_implemented_reads_each_suite_s_own_file_for_a_problem(tmp_path) -> None:
    """2026's test_ddp.py tests per-parameter overlap, 2025's tests bucketed DDP: each section counts the file its
    problem has in each suite."""
    import json

    from cs336_systems.report.answers import implemented
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "course_tests"
    folder.mkdir()
    runs = {"2025": {"tests/test_ddp.py::b[1]": "passed", "tests/test_ddp_individual_parameters.py::a": "passed"},
            "2026-cpu": {"tests/test_ddp.py::a[1]": "passed", "tests/test_ddp.py::a[2]": "failed"}}
    for name, tests in runs.items():
        (folder / f"{name}.json").write_text(json.dumps({"tests": tests}))
        (folder / f"{name}.meta.json").write_text("{}")
    d = SectionData(tmp_path, "ddp_overlap_individual")
    files = {"2025": "test_ddp_individual_parameters.py", "2026": "test_ddp.py"}
    overlap = implemented(d, "x", "y.py", "t.py", files)
    assert ("The course's `test_ddp_individual_parameters.py`: 1 of 1 passed on the GPU (§4).") in overlap.markdown
    assert "test_ddp.py" not in overlap.markdown  # the 2025 writeup cites the 2025 suite's runs, and names its file
    twenty_six = implemented(SectionData(tmp_path, "ddp_overlap_individual", edition="2026"), "x", "y.py", "t.py", files)
    assert "1 of 2 passed on CPU (§4)." in twenty_six.markdown and "on the GPU" not in twenty_six.markdown
    bucketed = implemented(d, "x", "y.py", "t.py", {"2025": "test_ddp.py"})
    assert "1 of 1 passed on the GPU (§4)." in bucketed.markdown and "2026" not in bucketed.markdown
    # an edition grid cites the runs its own §4 shows: CSE599-O's, which run the 2025 suite's files
    (tmp_path / "ddp_overlap_individual" / "cse599o").mkdir(parents=True)
    (folder / "cse599o").mkdir()
    (folder / "cse599o" / "cse599o-cpu.json").write_text(json.dumps({"tests": runs["2025"]}))
    (folder / "cse599o" / "cse599o-cpu.meta.json").write_text("{}")
    grid = implemented(SectionData(tmp_path, "ddp_overlap_individual/cse599o"), "x", "y.py", "t.py",
                       {"2025": "test_ddp_individual_parameters.py", "2026": "test_ddp.py"}).markdown
    assert grid.endswith(": 1 of 1 passed in the cse599o suite on CPU (§4).") and "on the GPU" not in grid
    assert "`test_ddp_individual_parameters.py`: " in grid and "test_ddp.py" not in grid  # the file that ran, alone


def test_nsys_answers_sum_up_every_profile() -> None:
    from cs336_systems.experiments.nsys_profile import _across, _softmax_across

    summary = pd.DataFrame({"status": ["ok", "ok", "OOM"], "top_non_matmul_kernel": ["add_kernel", "add_kernel", None],
                            "top_non_matmul_percent": [2.0, 5.5, None], "softmax_to_matmul_time": [0.5, 0.8, None],
                            "softmax_to_matmul_flops": [0.02, 0.02, None]})
    assert _across(summary, "top_non_matmul_kernel", "top_non_matmul_percent", "the largest non-matmul kernel") == (
        " Across all 2 profiles the largest non-matmul kernel is `add_kernel` in 2, with 2.00%–5.50% of the forward "
        "kernel time.")
    assert " for 0.0200× their FLOPs, 25.0–40.0 times the time per FLOP." in _softmax_across(summary)
    assert _across(summary.iloc[:1], "top_non_matmul_kernel", "top_non_matmul_percent", "x") == ""
    from cs336_systems.experiments.nsys_profile import _matmul_shares

    shares = summary.assign(matmul_percent_forward=[90.0, 60.0, None], matmul_percent_train_step=[80.0, 55.0, None])
    assert _matmul_shares(shares).markdown == (
        "Matmuls take 60.0%–90.0% of the kernel time in the forward pass and 55.0%–80.0% of a full training step, "
        "so the other kernels take 10.0%–40.0% of the forward and 20.0%–45.0% of the step: the AdamW update "
        "(elementwise over every parameter) and the backward of the elementwise ops add non-matmul time. In every "
        "configuration the share falls, by 5.0–10 points.")
    # per size, the largest fall at the shortest context is said where the profiles show it
    sized = shares.assign(size=["s", "s", "s"], context_length=[128, 256, 512])
    assert _matmul_shares(sized).markdown.endswith(", most at each size's shortest context, where the optimizer "
                                                   "update (fixed per parameter) weighs most against matmul work "
                                                   "that grows with the tokens.")
    mixed = sized.assign(matmul_percent_train_step=[80.0, 61.0, None])
    assert _matmul_shares(mixed).markdown.endswith(" The share falls in 1 of 2 configurations.")


def test_the_2026_model_table_says_how_the_other_tables_name_its_models() -> None:
    """2026's Table 1 names its models as its handout does, and so do the other sections' tables of the 2026
    writeup; the 2025 handout's xl, which some of them measure too, is named so: the model-size answer says it."""
    from cs336_systems.experiments.model_sizes import _names_elsewhere

    said = _names_elsewhere("2026")
    assert said == (" The other sections name these models as this table does; one that also measures the 2025 "
                    "handout's xl calls it CS336 2025's xl (1600/6400/48/25).")
    assert _names_elsewhere("2025") == _names_elsewhere("cse599o") == _names_elsewhere("") == ""


def test_the_warm_up_answer_says_whether_one_or_two_steps_match_five() -> None:
    import pandas as pd

    from cs336_systems.experiments.benchmarking import _few_against_five

    study = pd.DataFrame({"size": ["small"] * 3 + ["xl"] * 3, "warmup": [1, 2, 5] * 2, "status": ["ok"] * 6,
                          "forward_mean_ms": [20.0, 20.1, 20.0, 250.0, 238.0, 238.0],
                          "forward_std_ms": [0.5, 0.5, 0.5, 0.2, 0.2, 0.2]})
    assert _few_against_five(study) == "; here 1 of 4 such cells differ from 5 warm-up steps beyond the spread: " \
                                       "xl after 1: 250 ms against 238 ms."
    calm = study.assign(forward_mean_ms=[20.0, 20.1, 20.0, 238.1, 238.0, 238.0])
    assert "every size's forward takes what it takes after 5, within 3 standard deviations of the study's own steps" in _few_against_five(calm)
    assert _few_against_five(calm).endswith("(the largest difference, small after 2: 20.1 ms against 20.0 ms, "
                                            "0.500%).")
    assert _few_against_five(None) == ""


def test_a_course_test_skipped_on_cpu_is_not_counted_as_a_failure(tmp_path) -> None:
    from cs336_systems.report.answers import implemented
    from cs336_systems.report.data import SectionData

    (tmp_path / "course_tests").mkdir()
    (tmp_path / "course_tests" / "2025-cpu.json").write_text(json.dumps({"tests": {
        "tests/test_attention.py::test_flash_forward_pass_pytorch": "passed",
        "tests/test_attention.py::test_flash_forward_pass_triton[True]": "skipped"}}))
    text = implemented(SectionData(tmp_path, "flash_benchmarking"), "ours", "x.py", "tests/x.py",
                       "test_attention.py").markdown
    assert "1 of 2 passed (1 skipped, which need CUDA) on CPU (§4)." in text


def test_model_rows_are_those_of_the_writeups_handout_under_its_names() -> None:
    """One run measures both handouts' model tables; each writeup shows its own (2026: 2025's 2.7B is its xl,
    the same architecture), and a model no handout lists stays."""
    from cs336_systems.report.answers import edition_rows

    df = pd.DataFrame({"size": ["small", "xl", "2.7B", "10B@2026", "tiny"], "ms": [1.0, 2.0, 3.0, 4.0, 5.0]})
    assert edition_rows(df, "2025")[["size", "ms"]].values.tolist() == [["small", 1.0], ["xl", 2.0], ["2.7B", 3.0],
                                                                        ["tiny", 5.0]]
    twenty_six = edition_rows(df, "2026")
    assert twenty_six[["size", "ms"]].values.tolist() == [["small", 1.0], ["xl", 3.0], ["10B", 4.0], ["tiny", 5.0]]
    assert twenty_six["preset"].tolist() == ["small", "2.7B", "10B@2026", "tiny"]  # for the FLOPs and parameters
    assert edition_rows(None, "2026") is None and edition_rows(df, "nonesuch") is df
    both = pd.concat([df, pd.DataFrame({"size": ["xl@2026"], "ms": [6.0]})], ignore_index=True)
    assert edition_rows(both, "2026")["ms"].tolist() == [1.0, 4.0, 5.0, 6.0]  # its own preset, not 2.7B's row
    assert edition_rows(both, "2025")["ms"].tolist() == [1.0, 2.0, 3.0, 5.0]  # and 2.7B's here


def test_each_writeup_answers_with_its_handouts_model_table(results: Path) -> None:
    from cs336_systems.experiments.benchmarking import SECTION
    from cs336_systems.report.data import SectionData

    rows = [{"size": s, "status": "ok", "forward_mean_ms": f, "forward_std_ms": 0.1, "backward_mean_ms": 2 * f,
             "backward_std_ms": 0.2} for s, f in (("small", 10.0), ("xl", 20.0), ("2.7B", 30.0))]
    rows.append({"size": "10B@2026", "status": "OOM"})
    ResultWriter("benchmarking", params={"warmup": 5, "steps": 10}, smoke=False).table(pd.DataFrame(rows), "timings")

    def text(edition: str) -> str:
        (b, *_) = [q for q in SECTION.answer(SectionData(results, "benchmarking", edition=edition))
                   if getattr(q, "label", None) == "b"]
        return " ".join(x.plain() for x in b.blocks if hasattr(x, "plain"))

    assert "xl 20.0 ms / 40.0 ms and 2.7B 30.0 ms / 60.0 ms" in text("2025") and "10B" not in text("2025")
    assert "small 10.0 ms / 20.0 ms and xl 30.0 ms / 60.0 ms" in text("2026")
    assert "Not measured: 10B (OOM: 12.8 B parameters" in text("2026")


def test_mixed_precision_names_a_larger_model_whose_bf16_pass_is_faster() -> None:
    from cs336_systems.experiments.mixed_precision import _not_monotonic
    from cs336_systems.report.answers import edition_rows

    speed = edition_rows(pd.DataFrame({"size": ["large", "xl", "2.7B"], "forward_bf16_ms": [70.0, 77.0, 85.0],
                                       "backward_bf16_ms": [84.0, 155.0, 141.0]}), "2025")
    assert _not_monotonic(speed).startswith("; not monotonically, though: 2.7B's bf16 backward (141 ms) is faster "
                                            "than xl's (155 ms); the larger model has 32 layers to 48")
    assert "was not profiled, so no cause is claimed here" in _not_monotonic(speed)
    assert "probably" not in _not_monotonic(speed) and "launches fewer" not in _not_monotonic(speed)
    assert _not_monotonic(speed.assign(backward_bf16_ms=[84.0, 130.0, 141.0])) == ""
    # timed by each run's fastest step (the means too noisy), the text says so rather than quote them as means
    assert _not_monotonic(speed, fastest=True).startswith("; not monotonically, though: 2.7B's fastest bf16 backward "
                                                          "step (141 ms) is faster than xl's (155 ms)")


def test_models_are_named_as_each_handout_names_them() -> None:
    """2026 calls 2025's 2.7B its xl; a model only another handout lists is named with that handout."""
    import pandas as pd

    from cs336_systems.experiments.torch_compile import _handout_sizes
    from cs336_systems.report.answers import edition_models, handout_model, in_handout

    assert in_handout("2.7B", "2026") and not in_handout("xl", "2026") and in_handout("xl", "2025")
    assert _handout_sizes(["xl", "2.7B"], "2026") == ["xl"] and _handout_sizes(["xl", "2.7B"], "2025") == ["xl", "2.7B"]

    assert handout_model("2.7B", "2026") == handout_model("xl@2026", "2026") == "xl"
    assert handout_model("xl", "2026") == "CS336 2025's xl"
    assert handout_model("xl@2026", "2025") == "2.7B" and handout_model("xl", "2025") == "xl"
    assert handout_model("tiny", "2026") == "tiny" and handout_model("not a preset", "2026") == "not a preset"
    frame = edition_models(pd.DataFrame({"model": ["xl", "2.7B"], "ms": [1.0, 2.0]}), "2026")
    assert list(frame["model"]) == ["CS336 2025's xl", "xl"] and list(frame["ms"]) == [1.0, 2.0]


def test_memory_timeline_text_follows_which_moment_sets_the_training_peak() -> None:
    """memory_profiling (a): where the gradients (a copy of the weights) outweigh the activations the backward
    frees, the training step rises through the backward; where the activations outweigh them, it falls."""
    from cs336_systems.experiments.memory_profiling import _training_shape

    def peaks(acts: dict[int, float]) -> pd.DataFrame:
        rows = [("forward", c, 10.0 + a, 10.0) for c, a in acts.items()]
        rows += [("train", c, 40.0 + a, 30.0) for c, a in acts.items()]
        return pd.DataFrame(rows, columns=["mode", "context_length", "peak_GiB", "allocated_before_GiB"]).assign(
            precision="fp32", status="ok")

    rising = _training_shape(peaks({128: 4.0}))
    assert "keeps rising through the backward" in rising and "falls" not in rising and "at context" not in rising
    both = _training_shape(peaks({128: 4.0, 2048: 25.0}))
    assert ("at context 128 it keeps rising through the backward" in both
            and "; at context 2,048 it peaks at the end of the forward and falls" in both)
    # how to read the panels' colours goes to the figure's caption, not the answer's sentences
    from cs336_systems.experiments.memory_profiling import _panel_legend

    assert "no user frame" not in both and "“other”" not in both
    legend = _panel_legend(peaks({128: 4.0, 2048: 25.0}))
    assert legend.startswith(" Where the peak comes at the optimizer step (context 128), the training panel draws")
    assert _panel_legend(peaks({2048: 25.0})).startswith(" “(no user frame)” marks allocations")


def test_mixed_precision_says_when_the_end_to_end_timings_ran_on_another_gpu(tmp_path) -> None:
    from cs336_systems.experiments.mixed_precision import _other_machine
    from cs336_systems.report.data import SectionData

    def record(folder: str, table: str, device: str) -> None:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{table}.meta.json").write_text(json.dumps({"device": device, "device_type": "cuda",
                                                                           "num_gpus": 1}))
        (tmp_path / folder / f"{table}.csv").write_text("size\nsmall\n")

    record("mixed_precision", "precision_timings", "NVIDIA H100 80GB HBM3")
    record("benchmarking", "timings", "NVIDIA H200")
    assert _other_machine(SectionData(tmp_path, "mixed_precision")) == (
        " These runs are an H100's and §1.1.3's fp32 timings an H200's: compare the two sections' ratios, not "
        "their times.")
    record("benchmarking", "timings", "NVIDIA H100 80GB HBM3")
    assert _other_machine(SectionData(tmp_path, "mixed_precision")) == ""


def test_no_answer_text_loses_a_latex_command_to_a_python_escape() -> None:
    """``"$T\\times T$"`` in a plain (not raw) string is a tab and ``imes``: the math renders as "TimesT". No
    string in the answer code holds a control character where a LaTeX command would start (``\\t``imes,
    ``\\f``rac, ``\\b``eta, ``\\v``ec, ``\\a``lpha, ``\\r``ho)."""
    import ast
    import re
    from pathlib import Path

    import cs336_systems

    escaped = re.compile(r"[\t\x08\x0c\x0b\x07\r][a-z]")
    found = []
    for path in sorted(Path(cs336_systems.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and escaped.search(node.value):
                found.append(f"{path.name}:{node.lineno} {node.value[:60]!r}")
    assert not found, found


def test_mixed_precision_names_a_bf16_forward_as_long_as_its_backward() -> None:
    """A bf16 forward that takes as long as its backward, where fp32's takes about half, is the host's time:
    named with both pairs; a size whose forward keeps fp32's proportion is not."""
    from cs336_systems.experiments.mixed_precision import _host_bound_forward

    timings = pd.DataFrame({"size": ["small", "small", "medium", "medium"], "precision": ["fp32", "bf16"] * 2,
                            "forward_mean_ms": [19.4, 14.8, 52.5, 39.1], "backward_mean_ms": [37.9, 31.3, 104.3, 38.5]})
    text = _host_bound_forward(timings)
    assert "medium's bf16 forward takes as long as its backward (39.1 ms against 38.5 ms), where in fp32 it takes " \
        "50% of it" in text and "small" not in text
    assert _host_bound_forward(timings.assign(forward_mean_ms=[19.4, 14.8, 52.5, 20.0])) == ""


def test_nsys_grid_sentence_says_which_profiles_ran_out_of_memory() -> None:
    """Out of memory is said as such (not "not run"); a grid that all ran says so once."""
    from cs336_systems.experiments.nsys_profile import _grid_sentence

    grid = pd.DataFrame({"size": ["small", "small", "large", "large"], "context_length": [128, 2048] * 2,
                         "status": ["ok", "ok", "ok", "OOM"]})
    assert _grid_sentence(grid) == ("Profiled: small and large at contexts 128 and 2,048, 3 of 4 configurations; out "
                                    "of memory: large at 2,048. ")
    assert _grid_sentence(grid.assign(status="ok")).endswith(", all 4 configurations. ")


def test_nsys_c_names_the_profiles_largest_non_matmul_kernels_and_their_operations() -> None:
    """(c) lists the profile's own non-matmul kernels (not a guessed list), each with its share and, where the
    kernel is known, the model's operation; matmuls and other configurations are left out."""
    from cs336_systems.experiments.nsys_profile import _non_matmul

    top = pd.DataFrame({
        "size": ["xl"] * 4 + ["small"], "context_length": [512] * 4 + [512], "range": ["forward"] * 5,
        "rank": [1, 2, 3, 4, 1], "percent": [70.0, 3.0, 2.0, 1.0, 9.0],
        "category": ["matmul", "elementwise", "copy", "elementwise", "elementwise"],
        "name": ["sm80_xmma_gemm_f32f32", "void at::native::elementwise_kernel<128, 2, DivFunctor<float> >(int)",
                 "Memcpy DtoD (Device -> Device)", "void at::native::flip_kernel_impl<float>(int)",
                 "void at::native::elementwise_kernel<128, 2, MulFunctor<float> >(int)"]})
    row = pd.Series({"size": "xl", "context_length": 512, "matmul_percent_forward": 88.0})
    text = _non_matmul(top, row)
    assert text.startswith("non-matmul kernels take 12.0% of the forward kernel time; the largest are ")
    assert "DivFunctor>` 3.00% (the softmax's division by its row sums)" in text and "Memcpy" in text
    assert "MulFunctor" not in text  # another configuration's kernel
    assert "gemm" not in text and _non_matmul(None, row) == ""


def test_the_fsdp_gathers_table_names_the_model_as_the_writeups_handout_does() -> None:
    from cs336_systems.experiments.fsdp_gathers import _named_for_the_handout

    table = pd.DataFrame({"variant": ["xl@2026, bf16 compute, 2 ranks (rank 0)"], "span_ms": [150.3]})
    assert _named_for_the_handout(table, "2026")["variant"].tolist() == ["xl, bf16 compute, 2 ranks (rank 0)"]
    assert _named_for_the_handout(table, "2025")["variant"].tolist() == ["2.7B, bf16 compute, 2 ranks (rank 0)"]


def test_memory_b_points_an_out_of_memory_step_to_the_checkpointed_one_that_fits(tmp_path) -> None:
    """Where the fp32 training step ran out of memory at the context §1.1.7 checkpoints the same model at, (b) says
    that the checkpointed step fits and at what peak; another model or context says nothing."""
    from cs336_systems.experiments import memory_profiling as mp
    from cs336_systems.report.data import SectionData

    peaks = pd.DataFrame({"mode": ["train", "train"], "precision": ["fp32"] * 2, "context_length": [128, 2048],
                          "status": ["ok", "OOM"]})
    folder = tmp_path / "gradient_checkpointing"
    folder.mkdir()
    pd.DataFrame({"block_size": [0.0, 0.5, 1.0, 2.0], "status": ["OOM", "ok", "ok", "ok"],
                  "peak_GiB": [None, 65.28, 65.28, 72.76]}).to_csv(folder / "checkpointing.csv", index=False)
    params = {"preset": "xl@2026", "batch_size": 4, "context_length": 2048}
    (folder / "checkpointing.meta.json").write_text(json.dumps({"params": params}))
    d = SectionData(tmp_path, "memory_profiling")
    assert mp._fits_checkpointed(d, "xl@2026", peaks) == (" With its blocks checkpointed the training step fits at "
                                                          "context 2,048: a peak of 65.3 GiB (§1.1.7 (b)).")
    assert mp._fits_checkpointed(d, "2.7B", peaks) == ""
    assert mp._fits_checkpointed(d, "xl@2026", peaks.assign(status="ok")) == ""


def test_mixed_precision_table_shows_each_mean_with_its_spread() -> None:
    from cs336_systems.experiments.mixed_precision import _with_spread

    table = pd.DataFrame({"size": ["xl"], "forward_fp32_ms": [237.61], "forward_bf16_ms": [68.35],
                          "forward_speedup": [3.48]})
    timings = pd.DataFrame({"size": ["xl", "xl"], "precision": ["fp32", "bf16"], "forward_std_ms": [0.058, 11.8],
                            "backward_std_ms": [0.2, 4.4]})
    shown = _with_spread(table, timings)
    assert shown.iloc[0].tolist() == ["xl", "237.6 ± 0.058", "68.35 ± 12", 3.48]
    assert _with_spread(table, None) is table


def test_nsys_attention_matmul_time_is_the_matmul_kernels_of_its_ranges() -> None:
    """The scores' range also runs the scaling and the mask: those are counted apart, not as matmul time."""
    from cs336_systems.experiments.nsys_profile import attention_products

    scores = pd.DataFrame({"name": ["gemm", "mul", "masked_fill"], "total_ms": [10.0, 2.0, 3.0],
                           "category": ["matmul", "elementwise", "elementwise"]})
    final = pd.DataFrame({"name": ["gemm"], "total_ms": [9.0], "category": ["matmul"]})
    assert attention_products([scores, final]) == (19.0, 5.0)
    assert attention_products([scores.iloc[:0], final.iloc[:0]]) == (0.0, 0.0)


def test_memory_c_says_for_which_peaks_mixed_precision_matters(tmp_path) -> None:
    """(c)'s verdict names the peaks that move by more than 10% and those that do not, and which way is in the
    factors that follow."""
    from cs336_systems.experiments import memory_profiling as mp
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "memory_profiling"
    folder.mkdir()
    rows = [(mode, 128, peak, prec) for mode, fp32, bf16 in (("inference", 13.0, 12.9), ("forward", 17.4, 22.1),
                                                             ("train", 51.4, 51.0))
            for prec, peak in (("fp32", fp32), ("bf16", bf16))]
    pd.DataFrame(rows, columns=["mode", "context_length", "peak_GiB", "precision"]).assign(
        status="ok", allocated_before_GiB=12.75).to_csv(folder / "peak_memory.csv", index=False)
    (folder / "peak_memory.meta.json").write_text(json.dumps({"params": {"size": "2.7B"}, "device": "H200"}))
    c = next(q for q in mp.answer(SectionData(tmp_path, "memory_profiling")) if getattr(q, "label", None) == "c")
    text = " ".join(getattr(x, "markdown", "") for x in c.blocks)
    assert text.startswith("Not significantly for the inference forward and training step peaks (within 10%); it "
                           "raises the forward with autograd peak by 27%.")  # one context: not "up to"
    # a context both precisions ran out of memory at is named: mixed precision did not rescue it
    oom = pd.DataFrame([(m, 2048, None, prec, "OOM") for m in ("forward", "train") for prec in ("fp32", "bf16")],
                       columns=["mode", "context_length", "peak_GiB", "precision", "status"])
    assert mp._not_rescued(oom) == ("It does not rescue a longer context: at context 2,048 the forward with autograd "
                                    "and training step still run out of memory under bf16, as in fp32. ")
    assert mp._not_rescued(oom[oom["precision"] == "fp32"]) == ""


def test_short_attention_cells_that_do_not_order_by_head_size_are_called_launch_bound() -> None:
    from cs336_systems.experiments.pytorch_attention import _launch_bound

    grid = pd.DataFrame({"d_model": [16, 128, 16, 128], "seq_len": [256, 256, 4096, 4096],
                         "forward_mean_ms": [0.30, 0.17, 2.0, 3.0]})
    assert _launch_bound(grid).startswith(" At 256 tokens the forward times do not grow with $d$ (0.170 ms–0.300 ms)")
    assert _launch_bound(grid.assign(forward_mean_ms=[0.17, 0.30, 2.0, 3.0])) == ""


def test_profiled_elementwise_kernels_are_named_by_the_operation_they_run() -> None:
    """A multiply by a Python scalar (the 1/sqrt(d) scaling) and a tensor-tensor multiply share a short name;
    the full name tells them apart."""
    from cs336_systems.experiments.nsys_profile import _non_matmul

    scalar = ("void at::native::vectorized_elementwise_kernel<4, at::native::BUnaryFunctor<float, float, float, "
              "at::native::binary_internal::MulFunctor<float>>, std::array<char*, 2ul>>(int, ...)")
    tensor = scalar.replace("BUnaryFunctor<float, float, float,", "BinaryFunctor<float, float, float,")
    top = pd.DataFrame({"size": "large", "context_length": 1024, "range": "forward", "rank": [1, 2],
                        "name": [scalar, tensor], "percent": [2.19, 1.0], "category": "elementwise"})
    text = _non_matmul(top, pd.Series({"size": "large", "context_length": 1024}))
    assert "2.19% (the $1/\\sqrt{d}$ score scaling, a multiply by the reciprocal)" in text
    assert text.endswith("`vectorized_elementwise_kernel<MulFunctor>` 1.00%")


def test_nsys_b_counts_the_top_kernel_per_block_and_names_steps_led_by_other_kernels() -> None:
    from cs336_systems.experiments.nsys_profile import _calls_per_block, _step_leaders

    assert _calls_per_block(pd.Series({"size": "large", "top_kernel_calls_per_forward": 109})) == \
        " (3 per block × 36 blocks + 1, the LM head's)"
    assert _calls_per_block(pd.Series({"size": "large", "top_kernel_calls_per_forward": 50})) == ""
    summary = pd.DataFrame({"size": ["small", "small"], "context_length": [512, 4096], "status": "ok",
                            "top_forward_kernel": ["gemm_a", "gemm_a"]})
    top = pd.DataFrame({"size": ["small", "small"], "context_length": [512, 4096], "range": "step", "rank": 1,
                        "name": ["gemm_a", "div_kernel"], "percent": [30.0, 12.5], "category": ["matmul", "elementwise"]})
    text = _step_leaders(top, summary)
    assert text.startswith(" The training step's top kernel is the forward's in 1 of 2 profiles; in small at 4,096 (")
    assert "12.5% of the step) it is not a matmul" in text
    assert _step_leaders(top.iloc[:1], summary) == " The training step's top kernel is the forward's in 1 of 1 profiles."


def test_fsdp_host_paced_sentence_only_where_compute_leaves_the_gpu_idle() -> None:
    from cs336_systems.experiments.fsdp_gathers import host_paced

    class Data:
        def __init__(self, frames: dict) -> None:
            self.frames = frames

        def frame(self, name: str):
            return self.frames.get(name)

        def meta(self, name: str) -> dict:
            return {}

        def sibling(self, name: str):
            return Data({})

    tl = pd.DataFrame({"kind": ["compute"] * 4, "start_ms": [0.0, 2.0, 4.0, 6.0]})
    late_second = pd.DataFrame({"start_ms": [0.0, 3.0], "late": [False, True]})
    summary = pd.DataFrame([{"span_ms": 10.0, "compute_ms": 3.0, "late_gathers": 1}])
    text = host_paced(Data({"gathers_summary": summary, "gathers_timeline": tl, "gathers_forward": late_second}))
    assert text.plain().startswith("Compute ran only 3.00 ms of the forward's 10.0 ms")
    busy = summary.assign(compute_ms=8.0)
    assert host_paced(Data({"gathers_summary": busy, "gathers_timeline": tl, "gathers_forward": late_second})) is None
    first = late_second.assign(late=[True, False])
    assert host_paced(Data({"gathers_summary": summary, "gathers_timeline": tl, "gathers_forward": first})) is None
    # where the fit says the link could carry the gathers, the answer gives both causes that fit a rank-0 profile
    import cs336_systems.experiments.fsdp_gathers as gathers

    slow = summary.assign(gather_ms=9.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5))
        said = host_paced(Data({"gathers_summary": slow, "gathers_timeline": tl, "gathers_forward": late_second}))
    plain = said.plain()
    assert plain.startswith("The link is not what is slow") and "cannot tell them apart" in plain
    assert "so rank 0's forward is paced" not in plain  # a cause this profile cannot show is not stated as fact
    # with both ranks' timelines on one clock, the answer says which part was waiting for the peer
    two = pd.DataFrame([{**slow.iloc[0].to_dict(), "variant": f"rank {i}", "gathers": 4, "peer_wait_ms": w,
                         "arrived_last": n, "transfer_ms": 1.5} for i, (w, n) in enumerate(((7.0, 1), (0.5, 3)))])
    # rank 1's rows are in the timeline too: the rank-0 readings must keep to rank 0's
    tl2 = pd.concat([tl.assign(variant="rank 0"), tl.assign(variant="rank 1", start_ms=tl["start_ms"] + 50.0)])
    both = Data({"gathers_summary": two, "gathers_timeline": tl2, "gathers_forward": late_second.assign(
        variant="rank 0")})
    both.meta = lambda name: {"extra": {"clocks": [{"variant": "rank 0", "residual_us": 0.0},
                                                   {"variant": "rank 1", "residual_us": 4.0}]}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5))
        plain = host_paced(both).plain()
    assert "cannot tell them apart" not in plain and "agree within 4.0 µs" in plain
    assert "7.00 ms passed before rank 1 reached the same gather" in plain and "took 1.50 ms, close to" in plain
    assert "rank 0 at 1 and rank 1 at 3 of the 4 gathers" in plain and "not the link" in plain
    assert "a kernel every" not in plain  # superseded by the peers' reading
    from cs336_systems.experiments.fsdp_gathers import _gather_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5e9))
        fit = _gather_model(both, "xl", 2, "bf16", two.iloc[0])
    assert "took 9.00× that on rank 0." in fit and "the transfers took 1.50 ms" in fit
    always = Data({**both.frames, "gathers_summary": two.assign(arrived_last=[0, 4], peer_wait_ms=[7.0, 0.0],
                                                                 wait_ms=[6.0, 0.0], compute_ms=[3.0, 2.5])})
    always.meta = both.meta
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5))
        plain = host_paced(always).plain()
    assert ("Rank 1 reached every one of the 4 gathers last, and its own GPU, which waited for no gather, ran "
            "compute for only 2.50 ms of its 10.0 ms forward") in plain
    both.meta = lambda name: {"extra": {"clocks": [{"variant": "rank 1", "residual_us": 400.0}]}}
    with pytest.MonkeyPatch.context() as mp:  # clocks that do not line up: back to the rank-0 reading
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5))
        assert "cannot tell them apart" in host_paced(both).plain()


def test_fsdp_cause_in_brief_needs_every_ranks_timeline_and_names_the_host_paced_rank() -> None:
    import cs336_systems.experiments.fsdp_gathers as gathers
    from cs336_systems.experiments.fsdp_gathers import cause_in_brief

    class Data:
        def __init__(self, frames: dict, clocks: list) -> None:
            self.frames, self.clocks = frames, clocks

        def frame(self, name: str):
            return self.frames.get(name)

        def meta(self, name: str) -> dict:
            return {"extra": {"clocks": self.clocks}}

    row = {"span_ms": 10.0, "gathers": 4, "gather_ms": 9.0, "transfer_ms": 1.5}
    two = pd.DataFrame([{**row, "variant": "xl, 2 ranks (rank 0)", "peer_wait_ms": 7.0, "arrived_last": 0,
                         "compute_ms": 6.0},
                        {**row, "variant": "xl, 2 ranks (rank 1)", "peer_wait_ms": 0.0, "arrived_last": 4,
                         "compute_ms": 2.5}])
    clocks = [{"variant": "rank 0", "residual_us": 0.0}, {"variant": "rank 1", "residual_us": 4.0}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gathers, "_predicted_gather_ms", lambda *a: (1.0, 0.5))
        plain = cause_in_brief(Data({"gathers_summary": two}, clocks)).plain()
        assert plain.startswith("Of rank 0's 9.00 ms of gather kernel time, 7.00 ms passed before the other rank "
                                "reached the same gather; the transfers themselves (the other rank's kernels, on its own clock, "
                                "so the two need not add up exactly) took 1.50 ms, close "
                                "to §2.1's fit (1.00 ms)")
        assert "rank 1's GPU sat idle waiting for its host's launches (2.50 ms of compute in a 10.0 ms forward)" in plain
        busy = two.assign(compute_ms=[6.0, 8.0])  # the late rank's GPU was busy: no claim about its host
        assert "sat idle waiting" not in cause_in_brief(Data({"gathers_summary": busy}, clocks)).plain()
        assert cause_in_brief(Data({"gathers_summary": two.iloc[:1]}, clocks)) is None  # one rank's profile
        assert cause_in_brief(Data({"gathers_summary": two}, [{"residual_us": 400.0}])) is None  # clocks apart


def test_a_large_figure_of_many_panels_is_shown_wide_only_where_it_is_tall(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cs336_systems.report.document import Figure
    from cs336_systems.report.html import figure_html

    def png(name: str, size: tuple[float, float], large: bool) -> Figure:
        fig = plt.figure(figsize=size, dpi=100)
        fig.savefig(tmp_path / name)
        plt.close(fig)
        return Figure(tmp_path / name, f"caption {name}", name, {}, large=large)

    assert 'class="large"' in figure_html(png("grid.png", (10, 10), True), 1)
    assert 'class="large"' not in figure_html(png("wide.png", (15, 10), True), 2)  # wide: the height cap is enough
    assert 'class="large"' not in figure_html(png("plain.png", (10, 10), False), 3)


def test_an_answer_with_marked_tables_says_so_before_its_numbers() -> None:
    """A table measured on older code, on a machine that calibrated slow, or disagreeing with another section
    puts one caveat at the top of its answer, naming each mark once; an answer with clean tables gets none."""
    from cs336_systems.report.answers import marked_results
    from cs336_systems.report.document import Table, Text

    def table(**meta):
        return Table(pd.DataFrame({"ms": [1.0]}), "caption", "figures/x/t.csv", meta)

    assert marked_results([Text("prose"), table()]) == ""
    caveat = marked_results([table(stale="changed since: x.py"), table(stale="again"),
                             table(machine={"state": "suspect", "reason": "GPU 1 slow"})])
    assert caveat.count("STALE") == 1 and "SUSPECT" in caveat and "DISAGREES" not in caveat
    assert marked_results([table(machine={"state": "uncalibrated"})]) == ""  # no calibration is no mark
    assert "DISAGREES" in marked_results([table(disagrees="§1.3: 0.84×")])


def test_overlap_traces_name_the_idle_host_time_between_backward_and_the_optimizer() -> None:
    """The traced step's time with no kernel between backward's end and the optimizer, per variant (a kernel
    running into the gap counts only for its part), beside the untraced steps' exposed wait."""
    from cs336_systems.experiments.ddp_overlap_individual import _idle_after_backward

    def phases(variant, backward_end, optimizer_start):
        return [(variant, "phase", "phase", "backward", 0.0, backward_end),
                (variant, "phase", "phase", "optimizer", optimizer_start, 5.0)]

    timeline = pd.DataFrame(
        [*phases("flat", 100.0, 110.0), ("flat", "cuda:1", "comm", "allreduce", 100.0, 10.0),
         *phases("individual", 100.0, 116.0), ("individual", "cuda:1", "compute", "k", 99.0, 2.0),
         ("individual", "cuda:2", "comm", "allreduce", 110.0, 1.0)],
        columns=["variant", "lane", "kind", "name", "start_ms", "dur_ms"])
    text = _idle_after_backward(timeline, pd.Series({"sync_ms": 1.92}))
    assert "idle for individual 14.0 ms: host time" in text  # flat's gap is its all-reduce: not idle
    assert text.endswith("its untraced steps in the table of (a) leave 1.92 ms there.")
    assert _idle_after_backward(timeline[timeline["variant"] == "flat"]) == ""
    gapped_flat = timeline.assign(dur_ms=timeline["dur_ms"].where(timeline["kind"] != "comm", 3.0))  # 7 ms idle
    assert "flat" not in _idle_after_backward(gapped_flat).split(":")[0]  # flat's gap is its all-reduce's, not a wait


def test_an_edition_cites_the_part_that_shows_a_borrowed_question() -> None:
    """2026's memory-profiling section shows the checkpointing section's residuals as its (f): answers cite that
    part; the workbook's own order has no borrowing."""
    from cs336_systems.report.editions import borrowed_as

    assert borrowed_as("2026", "memory_profiling", "gradient_checkpointing", "residuals") == "f"
    assert borrowed_as("2025", "memory_profiling", "gradient_checkpointing", "residuals") is None
    assert borrowed_as("2026", "memory_profiling", "gradient_checkpointing", "b") is None


def test_committed_writeups_have_no_unformatted_placeholders() -> None:
    """An answer string missing its f prefix prints its placeholders (``{fmt.sig(peak['ddp'])}``) verbatim."""
    import re

    from cs336_systems.results import REPO_ROOT

    pages = sorted(REPO_ROOT.glob("writeup*.html"))
    assert pages
    for page in pages:
        left = re.findall(r"\{(?:fmt\.|[a-z_]+\[['\"])[^}]*\}", page.read_text())
        assert not left, (page.name, left[:3])


def test_allreduce_answer_gives_the_reference_curve_and_the_fit_later_sections_cite_in_the_main_text() -> None:
    """The handout's reference curve is derived, and the latency-bandwidth fit the DDP and FSDP sections quote is
    given, in the answer itself, not only in the appendix."""
    import re

    from cs336_systems.experiments import distributed_communication_single_node as comm
    from cs336_systems.report.data import SectionData
    from cs336_systems.results import FIGURES_DIR

    main = comm.answer(SectionData(FIGURES_DIR, "distributed_communication_single_node/cse599o", edition="cse599o"))[0]
    text = " ".join(getattr(b, "markdown", "") for b in main.blocks if b is not None)
    assert "`nvidia-smi topo -m` shows NV18 between the GPUs" in text and "so the reference curve is 450 GB/s" in text
    assert "NCCL with 2 processes gives $\\alpha$ = " in text and "which later sections use" in text
    # the handout asks for 2-3 sentences of commentary
    assert len(re.findall(r"[.!?](?:\s|$)", re.sub(r"\$[^$]*\$", "", text.strip()))) <= 3, text


def test_bucketed_answer_gives_each_bucket_sizes_communication_time(tmp_path) -> None:
    """CSE599-O's Problem 8 asks for communication time per bucket size: the exposed wait (measured) beside what
    all of a size's all-reduces take, n_b o + s/w from the same run's fit, and the share the backward hid."""
    import json

    from cs336_systems.experiments.ddp_bucketed import _communication
    from cs336_systems.report.data import SectionData

    folder = tmp_path / "ddp_bucketed"
    folder.mkdir()
    b = pd.DataFrame({"variant": ["bucketed (1MB)", "bucketed (1000MB)"], "mode": "bucketed", "bucket_size_mb": [1.0, 1000.0],
                      "num_buckets": [300, 4], "step_ms": [100.0, 110.0], "step_ms_median": [99.0, 111.0],
                      "sync_ms": [0.5, 6.0], "grad_bytes": 2e9})
    b.to_csv(folder / "steps_large_fp32.csv", index=False)
    (folder / "overhead_model_large_fp32.json").write_text(json.dumps({"o_us": 30.0, "w_GBps": 400.0}))
    table = _communication(SectionData(tmp_path, "ddp_bucketed"), "steps_large_fp32", b)
    frame = table.frame
    # 300 calls of 30 µs = 9 ms, plus 2 GB at 400 GB/s = 5 ms; 4 calls: 0.12 + 5 ms
    assert frame["modelled_allreduce_ms"].tolist() == pytest.approx([14.0, 5.12])
    assert frame["step_ms"].tolist() == [99.0, 111.0]  # the median step
    assert frame["hidden_pct"].round(1).tolist() == [96.4, 0.0]  # a wait past the modelled time hid nothing
    assert "$o$ = 30.0 µs and $w$ = 400 GB/s" in table.caption
    assert _communication(SectionData(tmp_path, "ddp_bucketed"), "steps_large_bf16", b) is None  # no fit: no table


def test_stream_lanes_name_each_traced_row_by_its_kernels() -> None:
    """A traced step's rows are the profiler's stream names (cuda:17); the captions say which carries NCCL."""
    from cs336_systems.report.answers import stream_lanes

    timeline = pd.DataFrame({"lane": ["cuda:17", "cuda:7", "cuda:7", "cuda:7", "step"],
                             "kind": ["comm", "compute", "compute", "comm", "phase"]})
    assert stream_lanes(timeline) == "cuda:17 (stream 17) is NCCL's stream, cuda:7 (stream 7) is the compute stream"
    assert stream_lanes(None) == "" and stream_lanes(timeline[["lane"]]) == ""
    # naive DDP all-reduces on the compute stream: its panel's row carries both kinds, and the caption says so
    per_variant = pd.DataFrame({"variant": ["naive"] * 4 + ["flat"] * 4,
                                "lane": ["cuda:7"] * 4 + ["cuda:7", "cuda:7", "cuda:7", "cuda:17"],
                                "kind": ["compute", "comm", "compute", "comm", "compute", "compute", "compute", "comm"]})
    assert stream_lanes(per_variant) == ("cuda:7 (stream 7) is the compute stream (NCCL's kernels run on it too in "
                                         "naive), cuda:17 (stream 17) is NCCL's stream")
    # a timeline merges runs of compute kernels into one row: the lane's kind is its kernel time, not its rows'
    merged = pd.DataFrame({"variant": ["naive"] * 5 + ["flat"] * 3,
                           "lane": ["cuda:7"] * 5 + ["cuda:7", "cuda:7", "cuda:17"],
                           "kind": ["compute", "comm", "comm", "comm", "comm", "compute", "comm", "comm"],
                           "dur_ms": [380.0, 9.0, 9.0, 9.0, 9.0, 390.0, 0.01, 22.0]})
    assert stream_lanes(merged) == ("cuda:7 (stream 7) is the compute stream (NCCL's kernels run on it too in "
                                    "naive), cuda:17 (stream 17) is NCCL's stream")


def test_fsdp_figure_caption_maps_preset_labels_to_the_handouts_names_where_they_differ() -> None:
    from cs336_systems.report.answers import preset_labels as _preset_labels

    runs = pd.DataFrame({"model": ["xl", "2.7B", "xl"]})
    assert _preset_labels(runs, "2026") == (" Its labels are the presets' names: xl is CS336 2025's xl and 2.7B "
                                            "is this handout's xl.")
    assert _preset_labels(runs, "2025") == ""  # the labels are this handout's names
    assert _preset_labels(runs, "cse599o") == ""  # no size of its own: the text uses CS336 2025's names too
    assert _preset_labels(None, "2026") == ""
