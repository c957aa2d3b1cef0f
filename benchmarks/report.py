"""Rewrite one benchmark's section of BENCHMARKS.md, leaving every other section alone.

Each benchmark owns the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``
under its own ``## Heading``. The first run appends the heading and the markers; later
runs replace only what lies between the markers.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(name: str, heading: str, body: str, path: Path = BENCHMARKS_MD) -> Path:
    """Put ``body`` between this benchmark's markers in ``path`` (created if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _old, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n{block}\n"
    path.write_text(text)
    return path


def closing_lines(script: str, load: float | None = None) -> list[str]:
    """The lines that end a section: a note when ``load`` (the load average at the start)
    was over the machine's cores, and the command that made it, with this run's
    arguments (``script``: e.g. "benchmarks/prefix.py")."""
    import os
    import sys

    cores = os.cpu_count() or 1
    lines = []
    if load is not None and load > cores:
        lines += ["", f"(The machine was busy — load average {load:.1f} on {cores} cores — "
                      f"so these figures are noisy; rerun on a quiet machine.)"]
    return lines + ["", "Command: `" + " ".join(["python", script, *sys.argv[1:]]) + "`"]
