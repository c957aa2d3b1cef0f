"""``tinylm eval --task / --suite``: load a model, score its tasks, record them in the run.

:func:`eval_tasks` is the one library call of the command: it reads the tasks first (a
bad file fails before the model loads), scores each with
:func:`tinylm.use.tasks.evaluate_task`, adds the CORE-style summary of a suite
(:mod:`tinylm.use.suite`), and, when the model is a training run folder, appends one
record to its metrics.jsonl (``{"step", "tasks": {...}, "core"}``; the record format of
:mod:`tinylm.training.runlog`, whose plots ignore it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tinylm.core.config import resolve_device
from tinylm.core.errors import ConfigError, TinyLMError
from tinylm.io.checkpoint import load_model, require_tokenizer_of, resolve_checkpoint_dir
from tinylm.io.checkpoint_files import STATE_JSON_FILE
from tinylm.io.files import disk_errors
from tinylm.io.jsonio import read_json
from tinylm.training.runlog import METRICS_FILE
from tinylm.use.suite import SuiteTask, read_suite, summarize
from tinylm.use.task_files import load_task
from tinylm.use.tasks import FEWSHOT_SEED, Task, evaluate_task

#: progress(task name, items done, items in all)
TaskProgress = Callable[[str, int, int], None]


def _unique(name: str, taken: dict[str, Any]) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name}#{n}" in taken:
        n += 1
    return f"{name}#{n}"


def _plan(specs: Sequence[str], suite: str | os.PathLike | None, *, task_format: str | None,
          fewshot_file: str | None, limit: int | None, num_fewshot: int
          ) -> tuple[list[SuiteTask], int | None]:
    """The tasks to run: the suite file's, or one entry per --task with the flags'."""
    if suite is not None:
        if specs:
            raise ConfigError("give --task or --suite, not both (a suite lists its tasks)")
        return read_suite(suite)
    if not specs:
        raise ConfigError("name a task: --task builtin:copy, --task FILE.jsonl or --suite "
                          "FILE.toml")
    return [SuiteTask(s, None, task_format, fewshot_file, limit, num_fewshot) for s in specs], \
        None


def run_step(model_path: str | os.PathLike) -> int | None:
    """The training step of the checkpoint ``model_path`` names, when it records one."""
    try:
        meta = read_json(resolve_checkpoint_dir(model_path) / STATE_JSON_FILE)
    except (OSError, TinyLMError):  # no training state (a converted model): no step
        return None
    step = meta.get("step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) else None


def record_in_run(model_path: str | os.PathLike, report: dict[str, Any]) -> Path | None:
    """Append the report's tasks (and core) to RUN/metrics.jsonl when ``model_path`` is a
    training run folder (it holds latest/); return the file, or None when it is not."""
    folder = Path(model_path)
    if not (folder.is_dir() and resolve_checkpoint_dir(folder) != folder):
        return None
    record = {"step": report.get("step"), "tasks": report["tasks"]}
    if "core" in report:
        record["core"] = report["core"]
    path = folder / METRICS_FILE
    with disk_errors(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return path


def eval_tasks(model_path: str | os.PathLike, specs: Sequence[str] = (), *,
               suite: str | os.PathLike | None = None, task_format: str | None = None,
               fewshot_file: str | None = None, limit: int | None = None,
               num_fewshot: int = 0, seed: int | None = None, batch_size: int = 16,
               device: str | None = None, allow_nonfinite: bool = False,
               progress: TaskProgress | None = None) -> dict[str, Any]:
    """Score the tasks ``specs`` (or a ``suite`` file's) on the model at ``model_path``.

    Returns ``{"model", "step", "tasks": {name: result}, "core" (suite only),
    "metrics_file"}``; each result is :func:`~tinylm.use.tasks.evaluate_task`'s, with
    its centred score (and, in a suite, the metric that counts and its score).
    """
    entries, suite_seed = _plan(specs, suite, task_format=task_format,
                                fewshot_file=fewshot_file, limit=limit,
                                num_fewshot=num_fewshot)
    seed = seed if seed is not None else suite_seed if suite_seed is not None else FEWSHOT_SEED
    tasks: list[Task] = [load_task(e.spec, task_format=e.task_format,
                                   fewshot_file=e.fewshot_file, name=e.name) for e in entries]
    model = load_model(model_path, resolve_device(device), allow_nonfinite=allow_nonfinite)
    tokenizer = require_tokenizer_of(model_path, "task evaluation turns text into ids with "
                                     "it; evaluate a model that has its tokenizer")
    results: dict[str, dict[str, Any]] = {}
    for entry, task in zip(entries, tasks, strict=True):
        name = _unique(task.name, results)
        report = None if progress is None else (
            lambda done, total, _n=name: progress(_n, done, total))
        results[name] = evaluate_task(model, tokenizer, task, limit=entry.limit,
                                      num_fewshot=entry.num_fewshot, seed=seed,
                                      batch_size=batch_size, progress=report)
    out: dict[str, Any] = {"model": str(model_path), "step": run_step(model_path),
                           "tasks": results}
    if suite is not None:
        out["core"] = summarize(entries, results)
    else:
        summarize(entries, results)  # each task's centred score, on its acc
    written = record_in_run(model_path, out)
    out["metrics_file"] = None if written is None else str(written)
    return out


__all__ = ["eval_tasks", "record_in_run", "run_step"]
