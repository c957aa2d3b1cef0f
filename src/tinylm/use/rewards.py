"""Tasks with checkable answers for ``tinylm rl``: records, rewards and pass@k.

:func:`load_rl_task` turns a spec into an :class:`RLTask`:

``builtin:arith``, ``builtin:count-letters``, ``builtin:sort``, ``builtin:gsm8k-mini``
    generated in code from ``seed`` (:mod:`tinylm.use.rl_builtins` says what each asks and
    how its answer is read from a completion). ``held_out``: ``n_held_out`` distinct
    prompts; ``train``: exactly ``n_train`` records, drawn from another seeded stream, none
    with a held-out prompt (a train prompt may repeat). The held-out set depends only on
    the seed and ``n_held_out``, never on ``n_train``.
``FILE.jsonl``
    one JSON object a line with ``"prompt"`` (the user's message) and ``"answer"`` (a
    string or a number), any other fields kept in :attr:`Record.data`. ``match="exact"``:
    right when the completion equals the answer after whitespace is normalised (runs of
    spaces, tabs and new lines as one space, the ends stripped); ``match="regex"``: the
    answer is a Python regex that must match somewhere in the completion (``re.search``;
    anchor it with ``^...$`` for a whole match). ``held_out``: min(``n_held_out``, 10 % of
    the file's distinct prompts, at least 1) prompts drawn with ``seed``; ``train``: the
    records of the other prompts, shuffled with ``seed``, at most ``n_train`` of them. A
    prompt is never in both.

Rewards. A built-in or file task's reward is 1.0 when the completion is right and 0.0
otherwise; ``format_reward`` (default 0, off) gives that much instead of 0 to a built-in
task's completion whose answer could be read but is wrong (a file task has no such
notion: asking for one there is a ConfigError). :meth:`RLTask.correct` (what pass@k
counts) is always the task's own check, whatever the reward.

``reward="module:function"`` replaces the reward with a user's own function
``f(prompt: str, completion: str, record: dict) -> float``. This is code the user chose
to run: the module is imported in-process with :mod:`importlib` (found on ``sys.path``,
with the current directory appended while it imports) and the function runs in the
trainer with its full rights. Its value must be a finite real number (any finite value;
the built-ins' [0, 1] is not required). An import that fails, a missing or non-callable
attribute, a call that raises or a value that is not a finite number is a one-line
:class:`~tinylm.core.errors.ConfigError` naming the function (and the record's prompt).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinylm.core.checks import check_fraction, check_int
from tinylm.core.display import display_name
from tinylm.core.errors import ConfigError, DataError
from tinylm.use.rl_builtins import RL_BUILTIN_PREFIX, RL_BUILTIN_TASKS, RL_BUILTINS
from tinylm.use.task_files import read_jsonl

MATCHES = ("exact", "regex")
#: Draws in a row that bring no new record before a built-in is judged too small.
_MISSES = 10_000


@dataclass(frozen=True)
class Record:
    """One prompt: ``prompt`` (the user's message; the trainer renders it with the
    model's chat template), ``answer`` (the right answer's text, or a file task's regex)
    and ``data`` (the raw record: a file's JSON object, a built-in's fields)."""

    prompt: str
    answer: str
    data: dict = field(default_factory=dict, hash=False)


#: A verdict on a completion: True right, False readable but wrong, None no answer read.
Judge = Callable[[Record, str], "bool | None"]


@dataclass(frozen=True)
class UserReward:
    """A user's reward function ``f(prompt, completion, record) -> float``, checked."""

    name: str
    function: Callable[..., Any]

    def __call__(self, record: Record, completion: str) -> float:
        try:
            value = self.function(record.prompt, completion, dict(record.data))
        except Exception as exc:
            raise ConfigError(
                f"reward function {self.name} raised {type(exc).__name__}: "
                f"{display_name(str(exc))} on the record with prompt "
                f"{display_name(_short(record.prompt))!r}") from exc
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok or not math.isfinite(float(value)):
            raise ConfigError(
                f"reward function {self.name} returned {display_name(_short(repr(value)))} "
                f"on the record with prompt {display_name(_short(record.prompt))!r}; it "
                f"must return a finite float")
        return float(value)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True, eq=False)
class RLTask:
    """Prompts to learn from (``train``), prompts to measure on (``held_out``, never a
    train prompt), and how a completion is scored. ``stop``: stop strings for generation
    (empty: the model's end-of-turn token ends it); ``max_new_tokens``: a generation
    budget long enough for a right answer, a default for the trainer."""

    name: str
    train: tuple[Record, ...]
    held_out: tuple[Record, ...]
    judge: Judge
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 64
    format_reward: float = 0.0
    user_reward: UserReward | None = None

    def correct(self, record: Record, completion: str) -> bool:
        """Whether ``completion`` answers ``record`` rightly (what pass@k counts)."""
        return self.judge(record, completion) is True

    def reward(self, record: Record, completion: str) -> float:
        """The user's reward if one was given, else 1.0 right, ``format_reward`` for a
        readable wrong answer, 0.0 otherwise."""
        if self.user_reward is not None:
            return self.user_reward(record, completion)
        verdict = self.judge(record, completion)
        if verdict is True:
            return 1.0
        return self.format_reward if verdict is False else 0.0


# --- built-in tasks -----------------------------------------------------------------------


def _draw(make: Callable[[random.Random], tuple[str, str, dict]], rnd: random.Random,
          n: int, skip: set[str], distinct: bool, what: str) -> list[Record]:
    """``n`` records from ``make``, none with a prompt in ``skip`` (nor repeated if
    ``distinct``); a ConfigError when the task has too few prompts for that."""
    out: list[Record] = []
    seen = set(skip)
    misses = 0
    while len(out) < n and misses < _MISSES:
        prompt, answer, data = make(rnd)
        if prompt in seen:
            misses += 1
            continue
        misses = 0
        if distinct:
            seen.add(prompt)
        out.append(Record(prompt, answer, {"prompt": prompt, "answer": answer, **data}))
    if len(out) == n:
        return out
    raise ConfigError(f"{what}: found only {len(out)} of the {n} records asked for; the "
                      f"task has too few distinct prompts, ask for fewer")


def _builtin_task(spec: str, seed: int, n_train: int, n_held_out: int,
                  format_reward: float) -> RLTask:
    name = spec[len(RL_BUILTIN_PREFIX):]
    if name not in RL_BUILTINS:
        raise ConfigError(f"no built-in RL task {spec!r}; the built-in RL tasks are "
                          f"{', '.join(RL_BUILTIN_TASKS)}")
    builtin = RL_BUILTINS[name]
    index = list(RL_BUILTINS).index(name)
    held_rnd = random.Random(seed * 1000 + 2 * index)
    train_rnd = random.Random(seed * 1000 + 2 * index + 1)
    held = _draw(builtin.make, held_rnd, n_held_out, set(), True,
                 f"{spec} held-out set (n_held_out={n_held_out})")
    train = _draw(builtin.make, train_rnd, n_train, {r.prompt for r in held}, False,
                  f"{spec} train set (n_train={n_train}, n_held_out={n_held_out})")

    def judge(record: Record, completion: str) -> bool | None:
        got = builtin.extract(completion)
        return None if got is None else got == record.answer

    return RLTask(spec, tuple(train), tuple(held), judge,
                  max_new_tokens=builtin.max_new_tokens, format_reward=format_reward)


# --- JSONL files --------------------------------------------------------------------------


def _file_record(path: Path, n: int, raw: dict[str, Any], match: str) -> Record:
    where = f"{display_name(path)}:{n}"
    prompt, answer = raw.get("prompt"), raw.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: field 'prompt' must be a non-empty string, got "
                        f"{display_name(_short(repr(prompt)))}; an RL task file holds "
                        f'{{"prompt": ..., "answer": ...}} a line')
    ok = isinstance(answer, (str, int, float)) and not isinstance(answer, bool)
    if not ok or (isinstance(answer, float) and not math.isfinite(answer)):
        raise DataError(f"{where}: field 'answer' must be a string or a number, got "
                        f"{display_name(_short(repr(answer)))}")
    answer = str(answer)
    if match == "regex":
        try:
            re.compile(answer)
        except re.error as exc:
            raise DataError(f"{where}: 'answer' is not a valid regex ({exc}); with "
                            f"match='regex' every answer is a Python regex") from exc
    return Record(prompt, answer, raw)


def _split(records: list[Record], seed: int, n_train: int, n_held_out: int,
           path: Path) -> tuple[list[Record], list[Record]]:
    """(train, held_out): held-out prompts drawn with ``seed``, disjoint from train."""
    prompts = list(dict.fromkeys(r.prompt for r in records))
    n_hold = min(n_held_out, max(1, len(prompts) // 10)) if n_held_out else 0
    if n_hold and len(prompts) < 2:
        raise DataError(f"RL task file {display_name(path)} has {len(prompts)} distinct "
                        f"prompt; it needs at least 2 (one to train on, one held out)")
    rnd = random.Random(seed)
    held_prompts = set(rnd.sample(prompts, n_hold))
    held: dict[str, Record] = {}
    train = []
    for r in records:
        if r.prompt in held_prompts:
            held.setdefault(r.prompt, r)
        else:
            train.append(r)
    rnd.shuffle(train)
    return train[:n_train], list(held.values())


def _file_task(spec: str, seed: int, n_train: int, n_held_out: int, match: str) -> RLTask:
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"RL task file {display_name(path)} does not exist; pass a JSONL "
                        f'file of {{"prompt": ..., "answer": ...}} lines or a built-in '
                        f"task: {', '.join(RL_BUILTIN_TASKS)}")
    records = [_file_record(path, n, raw, match) for n, raw in read_jsonl(path)]
    train, held = _split(records, seed, n_train, n_held_out, path)
    if match == "regex":
        patterns = {r.answer: re.compile(r.answer) for r in records}

        def judge(record: Record, completion: str) -> bool | None:
            pattern = patterns.get(record.answer) or re.compile(record.answer)
            return True if pattern.search(completion) else None
    else:
        def judge(record: Record, completion: str) -> bool | None:
            return True if " ".join(completion.split()) == " ".join(record.answer.split()) \
                else None

    return RLTask(path.stem, tuple(train), tuple(held), judge)


# --- the user's reward function -----------------------------------------------------------


def _import_module(module_name: str, spec: str) -> Any:
    """The module ``module_name``, with the current directory appended to sys.path while
    it imports."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".")[0] and exc.name != module_name:
            raise ConfigError(f"importing {module_name} for --reward {spec} failed: "
                              f"{display_name(str(exc))}") from exc
        raise ConfigError(f"cannot import module {module_name!r} for --reward {spec}: put "
                          f"{module_name.split('.')[0]}.py in the current directory or on "
                          f"PYTHONPATH") from exc
    except Exception as exc:
        raise ConfigError(f"importing {module_name} for --reward {spec} failed: "
                          f"{type(exc).__name__}: {display_name(str(exc))}") from exc
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_reward(spec: str) -> UserReward:
    """The user's reward function ``module:function`` (``function`` may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise ConfigError(f"--reward must be MODULE:FUNCTION (e.g. myrewards:score), got "
                          f"{display_name(spec)!r}")
    target: Any = _import_module(module_name, spec)
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"--reward {spec}: module {module_name} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"--reward {spec}: {attr} is a {type(target).__name__}, not a "
                          f"function of (prompt, completion, record)")
    try:
        inspect.signature(target).bind("", "", {})
    except TypeError as exc:
        raise ConfigError(f"--reward {spec}: {attr} cannot be called as f(prompt, "
                          f"completion, record) ({exc})") from exc
    except ValueError:
        pass  # a builtin without a signature: its first call tells
    return UserReward(spec, target)


# --- the entry point ----------------------------------------------------------------------


def load_rl_task(spec: str, *, seed: int = 0, n_train: int = 2000, n_held_out: int = 100,
                 reward: str | None = None, match: str = "exact",
                 format_reward: float = 0.0) -> RLTask:
    """The RL task ``spec`` names (``builtin:NAME`` or ``FILE.jsonl``; see the module's
    docstring), with the user's reward function ``reward`` ("module:function") if given."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"an RL task must be builtin:NAME ({', '.join(RL_BUILTIN_TASKS)}) "
                          f"or a JSONL file, got {spec!r}")
    check_int("seed", seed, 0)
    check_int("n_train", n_train, 1)
    check_int("n_held_out", n_held_out, 0)
    check_fraction("format_reward", format_reward, high_open=False)
    if match not in MATCHES:
        raise ConfigError(f"match must be one of {', '.join(MATCHES)}, got {match!r}")
    if spec.startswith(RL_BUILTIN_PREFIX):
        if match != "exact":
            raise ConfigError(f"match={match!r} is for JSONL task files; {spec} reads its "
                              f"own answers")
        task = _builtin_task(spec, seed, n_train, n_held_out, format_reward)
    else:
        if format_reward:
            raise ConfigError("format_reward is for the built-in tasks; a task file has no "
                              "answer format to reward")
        task = _file_task(spec, seed, n_train, n_held_out, match)
    if reward is None:
        return task
    return RLTask(task.name, task.train, task.held_out, task.judge, task.stop,
                  task.max_new_tokens, task.format_reward, load_reward(reward))


# --- pass@k -------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``c`` right answers among ``n`` samples (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold
    a right one. Exact (integer binomials, one rounding)."""
    check_int("n", n, 1)
    check_int("c", c, 0, n)
    check_int("k", k, 1, n, hint=f"pass@k needs at least k samples per prompt (n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_of(correct_per_prompt: Sequence[Sequence[bool]], k: int) -> float:
    """The mean pass@k over prompts, each given as its samples' right/wrong flags."""
    if not correct_per_prompt:
        raise ConfigError("pass@k needs at least one prompt")
    return sum(pass_at_k(len(flags), sum(bool(f) for f in flags), k)
               for flags in correct_per_prompt) / len(correct_per_prompt)


__all__ = ["MATCHES", "RLTask", "Record", "UserReward", "load_reward", "load_rl_task",
           "pass_at_k", "pass_at_k_of"]
