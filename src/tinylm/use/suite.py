"""A CORE-style suite: several tasks, each centred on its random baseline, and their mean.

nanochat's CORE score averages tasks after centring each one's accuracy on the accuracy
of random guessing, so that 0 is chance and 1 is perfect whatever the number of choices:

    centred = (acc - baseline) / (1 - baseline)     baseline = mean of 1/choices (multiple
                                                    choice), 0 (cloze, generate)
    core    = the mean of the tasks' centred scores

A suite is a TOML file (docs/evaluate.md)::

    limit = 200            # defaults for every task (optional)
    num_fewshot = 0

    [[task]]
    task = "builtin:copy"
    [[task]]
    task = "hellaswag_val.jsonl"   # relative to the suite file
    format = "hellaswag"           # optional: found from the fields otherwise
    metric = "acc_norm"            # which accuracy counts (default: acc)
    num_fewshot = 0                # per task: limit, num_fewshot, fewshot_file,
                                   # name, baseline too
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from tinylm.core.checks import is_int
from tinylm.core.errors import ConfigError, DataError

TOP_KEYS = {"limit", "num_fewshot", "seed", "task"}
TASK_KEYS = {"task", "name", "format", "fewshot_file", "limit", "num_fewshot", "metric",
             "baseline"}
METRICS = ("acc", "acc_norm", "acc_bytes")


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite and how it is run and counted."""

    spec: str
    name: str | None = None
    task_format: str | None = None
    fewshot_file: str | None = None
    limit: int | None = None
    num_fewshot: int = 0
    metric: str = "acc"
    baseline: float | None = None


def centred(acc: float, baseline: float) -> float:
    """(acc - baseline) / (1 - baseline): 0 at chance, 1 when every item is right."""
    if not baseline < 1:
        raise DataError(f"a random baseline of {baseline} leaves nothing to centre on")
    return (acc - baseline) / (1 - baseline)


def _check(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: "
                          f"{', '.join(sorted(allowed))})")
    for key in ("limit", "num_fewshot"):
        if key in table and (not is_int(table[key]) or table[key] < (key == "limit")):
            raise ConfigError(f"{where}: {key} must be an integer >= {int(key == 'limit')}, "
                              f"got {table[key]!r}")


def _entry(table: Any, defaults: dict[str, Any], folder: Path, where: str) -> SuiteTask:
    if not isinstance(table, dict) or not isinstance(table.get("task"), str):
        raise ConfigError(f"{where}: each [[task]] needs task = \"builtin:NAME\" or a file")
    _check(table, TASK_KEYS, where)
    spec = table["task"]
    if not spec.startswith("builtin:") and not Path(spec).is_absolute():
        spec = str(folder / spec)
    fewshot = table.get("fewshot_file")
    if fewshot is not None and not Path(fewshot).is_absolute():
        fewshot = str(folder / fewshot)
    metric = table.get("metric", "acc")
    if metric not in METRICS:
        raise ConfigError(f"{where}: metric must be one of {', '.join(METRICS)}, got "
                          f"{metric!r}")
    baseline = table.get("baseline")
    if baseline is not None and (not isinstance(baseline, (int, float)) or
                                 not 0 <= baseline < 1):
        raise ConfigError(f"{where}: baseline must be a number in [0, 1), got {baseline!r}")
    return SuiteTask(spec, table.get("name"), table.get("format"), fewshot,
                     table.get("limit", defaults.get("limit")),
                     table.get("num_fewshot", defaults.get("num_fewshot", 0)), metric,
                     None if baseline is None else float(baseline))


def read_suite(path: str | os.PathLike) -> tuple[list[SuiteTask], int | None]:
    """(the tasks, the seed or None) of a suite TOML file."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"suite file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read suite file {path} ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc})") from exc
    _check(doc, TOP_KEYS, str(path))
    tables = doc.get("task")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path} has no [[task]] tables; add one per task")
    seed = doc.get("seed")
    if seed is not None and not is_int(seed):
        raise ConfigError(f"{path}: seed must be an integer, got {seed!r}")
    return [_entry(t, doc, path.parent, f"{path} task {i + 1}")
            for i, t in enumerate(tables)], seed


def summarize(entries: list[SuiteTask], results: dict[str, dict[str, Any]]) -> float:
    """Add metric, score, baseline and centred to each task's result (in place); return
    the mean of the centred scores (the CORE-style score)."""
    scores = []
    for entry, result in zip(entries, results.values(), strict=True):
        if entry.metric not in result:
            raise ConfigError(f"task {entry.spec} reports no {entry.metric} (a "
                              f"{result['kind']} task); use metric = \"acc\"")
        if entry.baseline is not None:
            result["baseline"] = entry.baseline
        result["metric"] = entry.metric
        result["score"] = result[entry.metric]
        result["centered"] = centred(result["score"], result["baseline"])
        scores.append(result["centered"])
    return sum(scores) / len(scores)


__all__ = ["SuiteTask", "centred", "read_suite", "summarize"]
