"""The writeup builder: committed results in ``figures/`` → ``writeup.pdf``.

``python -m cs336_systems.report build`` reads every results folder, lets one builder per course
problem answer its deliverables from the data (``sections/``), renders the document to HTML with
math typeset by matplotlib's mathtext (``html.py``), prints it to PDF with headless Chromium
(``pdf.py``) and records the sha256 of every input in ``figures/writeup_manifest.json``
(``manifest.py``). ``python -m cs336_systems.report check`` fails when any result changed since.

The package imports nothing on its own: the sections import its leaf modules (editions, fmt, answers), and
the builder, which reads the sections, loads only when asked for (``cs336_systems.report.build``).
"""
