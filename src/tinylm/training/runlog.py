"""What a run tells: OUT/metrics.jsonl, the progress bar or log lines, loss plots, and
the stop signal (SIGINT/SIGTERM) that asks the loop to save and stop.

:func:`read_metrics` reads a run's records; :func:`plot_losses` / :func:`plot_runs`
draw them (``tinylm plot``); :class:`MetricsLog`, :class:`Progress`,
:class:`Throughput` and :class:`StopSignal` are the parts :func:`tinylm.training.train`
opens for one run (:class:`tinylm.training.state.Logs`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tinylm.core.config import available_cpus
from tinylm.core.errors import DataError, TinyLMError
from tinylm.io.files import atomic_write, disk_errors
from tinylm.use.plotting import (
    figure_path,
    legend_outside,
    new_figure,
    readable_log_axis,
    save_figure,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


# --- metrics and plots --------------------------------------------------------------------


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist; pass a run folder written by tinylm train")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records
            if isinstance(r.get(key), (int, float)) and "step" in r]


def plot_losses(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike,
                *, log_scale: bool = False, title: str | None = None) -> Path:
    """Draw, per (label, records): train loss (thin line), the periodic validation
    estimate (dots on a line) and the final whole-split validation loss (a star), kept
    apart because they are different measurements. Written atomically in the format of
    ``out``'s suffix (PNG, SVG or PDF; :func:`tinylm.use.plotting.save_figure`)."""
    figure_path(out)  # refuse a bad name before drawing
    fig = new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, records) in enumerate(runs):
        color = f"C{i % 10}"
        tr = _series(records, "train_loss")
        est = _series(records, "val_loss_estimate")
        if not est:  # a run folder from before the estimates had their own key
            est = _series([r for r in records if not r.get("final")], "val_loss")
        exact = _series([r for r in records if r.get("final")], "val_loss")
        if tr:
            ax.plot(*zip(*tr, strict=True), color=color, alpha=0.6, lw=1,
                    label=f"{label} train")
        if est:
            ax.plot(*zip(*est, strict=True), color=color, marker="o", ms=3, lw=1.5,
                    label=f"{label} val (sample estimate)")
        if exact:
            ax.plot(*zip(*exact, strict=True), color=color, marker="*", ms=11, lw=0,
                    label=f"{label} val (whole split)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if log_scale:
        ax.set_yscale("log")
        readable_log_axis(ax.yaxis)
    ax.grid(True, alpha=0.3)
    legend_outside(ax, fontsize=8)
    if title:
        ax.set_title(title)
    return save_figure(fig, out, bbox_inches="tight")


def plot_runs(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
              log_scale: bool = False) -> Path:
    """One figure comparing the loss curves of several run folders (``tinylm plot``)."""
    figure_path(out)
    runs = [(Path(d).resolve().name, read_metrics(d)) for d in run_dirs]
    if not any(records for _, records in runs):
        raise DataError(f"no metrics recorded yet in {', '.join(map(str, run_dirs))}")
    return plot_losses(runs, out, log_scale=log_scale)


class MetricsLog:
    """Appends records to metrics.jsonl (rank 0 only) and keeps them for the plot."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None) -> None:
        self.path = out / METRICS_FILE
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._plot_warned = False
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            # Drop what a killed run logged after its last checkpoint: it is replayed.
            self.records = [r for r in read_metrics(out) if r.get("step", 0) <= resume_step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        with disk_errors(self.path):
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with disk_errors(self.path):
            self._append(json.dumps(record) + "\n")

    def _append(self, line: str) -> None:
        self._file.write(line)
        self._file.flush()

    def redraw(self, out: Path, log_scale: bool) -> None:
        """Redraw OUT/loss.png from the records; a missing matplotlib only costs the
        picture (said once)."""
        try:
            plot_losses([(out.resolve().name, self.records)], out / PLOT_FILE,
                        log_scale=log_scale)
        except TinyLMError as exc:
            if not self._plot_warned:
                self._plot_warned = True
                log.warning("loss.png not drawn: %s", exc)

    def close(self) -> None:
        if self.enabled:
            with contextlib.suppress(OSError):
                self._file.close()


# --- progress display ---------------------------------------------------------------------


def _fmt_seconds(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A tqdm bar on a terminal at least 20 columns wide, plain log lines otherwise
    (CI, pipes, a 0-column terminal). :meth:`open` starts the bar, after the header."""

    def __init__(self, enabled: bool, use_bar: bool | None) -> None:
        self.enabled = enabled
        if use_bar is None:
            use_bar = sys.stderr.isatty() and shutil.get_terminal_size((0, 0)).columns >= 20
        self.use_bar = enabled and use_bar
        self.bar = None

    def open(self, start: int, total: int) -> None:
        if self.use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def set_total(self, total: int) -> None:
        if self.bar is not None and self.bar.total != total:
            self.bar.total = total
            self.bar.refresh()

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, total: int, loss: float, lr: float, tok_s: float,
               eta: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}",
                                 refresh=False)
        else:
            log.info("step %d/%d | loss %.4f | lr %.2e | %s tok/s | eta %s", step, total,
                     loss, lr, f"{tok_s:,.0f}", _fmt_seconds(eta))

    def message(self, text: str, level: int = logging.INFO) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            log.log(level, "%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Throughput:
    """Says once when tokens/s falls below a quarter of this run's own earlier rate."""

    def __init__(self) -> None:
        self.intervals = 0
        self.peak_tok_s = 0.0
        self.slow_warned = False

    def watch(self, tok_s: float, bar: Progress) -> None:
        """Count one log interval at ``tok_s``; warn on ``bar`` at the first collapse."""
        self.intervals += 1
        if self.intervals <= 2 or tok_s <= 0:  # the first intervals include warm-up costs
            return
        if self.peak_tok_s and tok_s < self.peak_tok_s / 4 and not self.slow_warned:
            self.slow_warned = True
            cpus = available_cpus()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            bar.message(slow_message(tok_s, self.peak_tok_s, load, cpus,
                                     torch.get_num_threads()), logging.WARNING)
        self.peak_tok_s = max(self.peak_tok_s, tok_s)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def slow_message(tok_s: float, peak: float, load: float, cpus: int, threads: int) -> str:
    """The one-line warning of a throughput collapse; it suggests fewer threads only
    when there are fewer to use (half the ones in use)."""
    advice = "stop the other jobs" + (
        f" or use fewer threads (--threads {threads // 2})" if threads > 1 else "")
    return (f"throughput fell to {tok_s:,.0f} tokens/s from {peak:,.0f} earlier in this run; "
            f"the machine is probably busy (load average {load:.1f} on "
            f"{_plural(cpus, 'CPU')}, {_plural(threads, 'thread')} here): {advice}")


# --- the stop signal --------------------------------------------------------------------


class StopSignal:
    """SIGINT/SIGTERM handler: the first one asks the loop to save and stop at the next
    step boundary; a second one interrupts immediately."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

