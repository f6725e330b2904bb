"""What the sections answer with and the writeup is drawn from: the document model (``document.py``), number
formatting (``fmt.py``), answer helpers (``answers.py``), a results folder as the answers read it (``data.py``),
the editions of the handout (``editions.py``), the cross-section agreement check (``agreement.py``), freshness of
results (``staleness.py``) and the renderers: HTML with math typeset by matplotlib's mathtext (``html.py``), PDF
through headless Chromium (``pdf.py``), the results index (``index.py``) and the input manifest
(``manifest.py``).

It sits below the sections (:mod:`cs336_systems.experiments`), which import its leaf modules; the builder that
reads the sections and assembles the writeups is :mod:`cs336_systems.writeup`, above them. The package imports
nothing on its own.
"""
