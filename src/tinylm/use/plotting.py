"""The one way tinylm draws and saves a figure (loss curves, compress sweeps, maps).

:func:`new_figure` makes a matplotlib ``Figure`` on the Agg canvas (no display, no
pyplot global state); :func:`save_figure` writes it in the format its file name asks
for (``.png``, ``.svg`` or ``.pdf``; a name without a suffix gets ``.png``; any other
suffix is refused before drawing), atomically, and returns the path really written;
:func:`legend_outside` puts a legend where it covers no curve.
matplotlib is optional: without it these raise a one-line ConfigError.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from tinylm.core.errors import ConfigError
from tinylm.io.files import atomic_write

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def figure_path(path: str | os.PathLike) -> Path:
    """The file a figure for ``path`` is written to (``.png`` added when no suffix);
    an unsupported suffix or an existing folder is a ConfigError."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{out} is a folder; pass a file name such as {out / 'plot.png'}")
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"cannot draw a {out.suffix} file ({out.name}); use a name ending "
                          f"in {', '.join(FORMATS)}")
    return out


def new_figure(width: float, height: float, dpi: int = 100, **kwargs: Any):
    """An empty matplotlib Figure attached to the Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("plotting needs matplotlib; pip install 'tinylm[plot]'") from exc
    fig = Figure(figsize=(width, height), dpi=dpi, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def readable_log_axis(axis: Any) -> None:
    """Plain-number tick labels on a log-scale axis ("6", "4.5", not "6×10⁰")."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_minor_locator(LogLocator(base=10, subs=(1.5, 4.0, 6.0, 7.0, 8.0, 9.0)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(FormatStrFormatter("%g"))


def legend_outside(ax: Any, **kwargs: Any) -> Any:
    """The legend of ``ax`` beside its plot area, right of it and top-aligned, so that
    it never covers a curve, however many runs it lists (matplotlib's "best" place
    inside the axes still sits on a curve when they fill the plot). Save the figure
    with ``bbox_inches="tight"`` so that the file keeps it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                     **kwargs)


def save_figure(fig: Any, path: str | os.PathLike, **kwargs: Any) -> Path:
    """Write ``fig`` to ``path`` in the format of its suffix, atomically; returns the
    path written (see :func:`figure_path`)."""
    out = figure_path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=FORMATS[out.suffix.lower()], **kwargs)
    return atomic_write(out, buf.getvalue())
