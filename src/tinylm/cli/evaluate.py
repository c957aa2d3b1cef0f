"""``tinylm eval --task / --suite``: task accuracy as a table, or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: eval's flags that apply to --data / --text only.
_WINDOW_FLAGS = (("stride", "--stride"), ("max_windows", "--max-windows"))


def _bars() -> tuple[Any, Any]:
    """(progress callback, close) drawing one tqdm bar per task on stderr (a terminal
    only: tqdm's ``disable=None``)."""
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def progress(name: str, done: int, total: int) -> None:
        bar = bars.get(name)
        if bar is None:
            bar = bars[name] = tqdm(total=total, desc=name, unit="item", file=sys.stderr,
                                    disable=None, leave=True, dynamic_ncols=True)
        bar.update(done - bar.n)

    def close() -> None:
        for bar in bars.values():
            bar.close()
    return progress, close


def _cell(result: dict[str, Any], key: str) -> str:
    value = result.get(key)
    return f"{value:.4f}" if isinstance(value, float) else "-"


def format_table(report: dict[str, Any]) -> str:
    """The results as a table: one row per task, and the CORE-style mean of a suite."""
    rows = [("task", "kind", "n", "shots", "acc", "acc_norm", "acc_bytes", "baseline",
             "centred", "s/100")]
    for name, r in report["tasks"].items():
        acc = _cell(r, "score") if "metric" in r and r["metric"] != "acc" else _cell(r, "acc")
        per100 = 100 * r["seconds"] / max(1, r["n"])
        rows.append((name, r["kind"], str(r["n"]), str(r["num_fewshot"]), acc,
                     _cell(r, "acc_norm"), _cell(r, "acc_bytes"), _cell(r, "baseline"),
                     _cell(r, "centered"), f"{per100:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    out = [f"model  {report['model']}" + (f" (step {report['step']:,})"
                                         if report.get("step") is not None else ""), ""]
    out += lines
    if "core" in report:
        out += ["", f"CORE-style score (mean centred accuracy): {report['core']:.4f}"]
    if report.get("metrics_file"):
        out += [f"recorded in {report['metrics_file']}"]
    return "\n".join(out)


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    """eval with --task or --suite: score, then print the table or the JSON object."""
    from tinylm.commands.evaluate import eval_tasks
    from tinylm.core.errors import ConfigError

    for attr, flag in _WINDOW_FLAGS:
        if getattr(args, attr) is not None:
            raise ConfigError(f"{flag} applies to --data and --text, not to tasks")
    if args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    progress, close = _bars()
    try:
        report = eval_tasks(args.model, args.task or (), suite=args.suite,
                            task_format=args.task_format, fewshot_file=args.fewshot_file,
                            limit=args.limit, num_fewshot=args.num_fewshot, seed=args.seed,
                            batch_size=args.batch_size, device=args.device,
                            allow_nonfinite=args.allow_nonfinite, progress=progress)
    finally:
        close()
    print(json.dumps(report) if args.json else format_table(report))
    return 0
