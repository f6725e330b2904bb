"""The writeup builder: committed results in ``figures/`` → ``writeup.pdf`` and the other editions' writeups.

``python -m cs336_systems.writeup build`` loads every section (:mod:`cs336_systems.experiments`), lets each answer
its problems from its results folder, renders the document with :mod:`cs336_systems.report`'s renderers and records
the sha256 of every input in ``figures/writeup_manifest.json``; ``status`` says which results are fresh, stale,
suspect or missing; ``replot`` redraws figures from committed tables. It is the top of the workbook: nothing
below imports it.
"""
