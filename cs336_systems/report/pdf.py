"""HTML → PDF with a headless Chromium (Debian package ``chromium``), which implements CSS paged media
(page size, margins, page-number boxes, repeated table headers) well enough for a report."""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSER_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str:
    """The Chromium executable: ``$CS336_CHROMIUM`` if set, else the first candidate on ``PATH``."""
    override = os.environ.get("CS336_CHROMIUM")
    if override:
        if shutil.which(override) is None:
            raise RuntimeError(f"CS336_CHROMIUM={override!r} is not an executable")
        return override
    for name in BROWSER_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "rendering writeup.pdf needs a headless Chromium; install it with "
        "`sudo apt-get install chromium fonts-liberation` (or set CS336_CHROMIUM to a Chrome binary)"
    )


_PDF_DATE = re.compile(rb"/(CreationDate|ModDate) \(D:\d{14}\+00'00'\)")


def stamp_dates(pdf: bytes, when: str | None) -> bytes:
    """Replace the browser's wall-clock creation and modification dates with ``when`` (ISO 8601, UTC; the
    inputs' date), or the epoch. Same length, so the cross-reference offsets stay valid."""
    moment = _dt.datetime.fromisoformat(when).astimezone(_dt.UTC) if when else _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
    stamp = moment.strftime("%Y%m%d%H%M%S").encode()
    return _PDF_DATE.sub(lambda m: b"/" + m.group(1) + b" (D:" + stamp + b"+00'00')", pdf)


_NODE_ID = re.compile(rb"\(node(\d{8})\)")


def renumber_structure_ids(pdf: bytes) -> bytes:
    """Chromium names the tagged PDF's structure elements ``(nodeNNNNNNNN)`` after its accessibility nodes,
    whose numbers vary between runs; renumber them 1, 2, … in their numeric order. The width stays eight
    digits (offsets stay valid) and the order is kept (the ID tree stays sorted), so an unchanged document
    prints byte for byte the same."""
    rank = {old: i for i, old in enumerate(sorted({int(m) for m in _NODE_ID.findall(pdf)}), start=1)}
    return _NODE_ID.sub(lambda m: b"(node%08d)" % rank[int(m.group(1))], pdf)


def html_to_pdf(html_path: Path, pdf_path: Path, timeout_s: float = 180.0, date: str | None = None) -> Path:
    """Print ``html_path`` to ``pdf_path``, dated ``date`` (see :func:`stamp_dates`); raises ``RuntimeError``
    with the browser's output on failure."""
    browser = find_browser()
    pdf_path = Path(pdf_path).resolve()
    pdf_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_pdf = pdf_path.with_suffix(".pdf.tmp")
    with tempfile.TemporaryDirectory(prefix="cs336-chromium-") as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-extensions",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--no-pdf-header-footer",
            f"--print-to-pdf={tmp_pdf}",
            Path(html_path).resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not tmp_pdf.exists() or tmp_pdf.stat().st_size == 0:
        tmp_pdf.unlink(missing_ok=True)
        raise RuntimeError(f"{browser} failed to print {html_path} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    tmp_pdf.write_bytes(renumber_structure_ids(stamp_dates(tmp_pdf.read_bytes(), date)))
    tmp_pdf.replace(pdf_path)
    return pdf_path
