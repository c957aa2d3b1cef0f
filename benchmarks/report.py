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
