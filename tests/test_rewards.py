"""RL tasks with checkable answers (tinylm.use.rewards): records, rewards, pass@k."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from tinylm.core.errors import ConfigError, DataError
from tinylm.use.rewards import Record, load_rl_task, pass_at_k, pass_at_k_of
from tinylm.use.task_files import load_task
from tinylm.use.tasks import _generate_metrics

BUILTINS = ("builtin:arith", "builtin:count-letters", "builtin:sort", "builtin:gsm8k-mini")


def _recomputed(spec: str, prompt: str) -> str:
    """The answer of a built-in prompt, worked out from its text alone."""
    if spec == "builtin:arith":
        a, b = map(int, re.findall(r"\d+", prompt))
        return str(a - b if "gives" in prompt else a + b)
    if spec == "builtin:count-letters":
        letter, word = re.fullmatch(r"How many times does the letter (\w) appear in "
                                    r"'(\w+)'\?", prompt).groups()
        return str(sum(ch == letter for ch in word))
    if spec == "builtin:sort":
        return ", ".join(str(n) for n in sorted(int(x) for x in re.findall(r"\d+", prompt)))
    numbers = [int(x) for x in re.findall(r"\d+", prompt)]
    if "packs" in prompt:
        a, b, c = numbers
        return str(a * b - c)
    if "boxes" in prompt:
        a, b, c = numbers
        return str(a * b + c)
    a, more = numbers  # "has a ... A friend has `more` more ... than ..."
    return str(a + (a + more))


@pytest.mark.parametrize("spec", BUILTINS)
def test_builtins_are_seeded_disjoint_and_right(spec: str) -> None:
    task = load_rl_task(spec, seed=3, n_train=300, n_held_out=50)
    again = load_rl_task(spec, seed=3, n_train=300, n_held_out=50)
    other = load_rl_task(spec, seed=4, n_train=300, n_held_out=50)
    assert len(task.train) == 300 and len(task.held_out) == 50
    assert task.train == again.train and task.held_out == again.held_out
    assert [r.prompt for r in task.train] != [r.prompt for r in other.train]
    held = [r.prompt for r in task.held_out]
    assert len(set(held)) == len(held)
    assert not set(held) & {r.prompt for r in task.train}
    # the held-out set does not depend on n_train
    assert load_rl_task(spec, seed=3, n_train=7, n_held_out=50).held_out == task.held_out
    for r in task.train + task.held_out:
        assert r.answer == _recomputed(spec, r.prompt), r.prompt
        assert r.data["prompt"] == r.prompt and r.data["answer"] == r.answer


@pytest.mark.parametrize("spec", ["builtin:arith", "builtin:count-letters"])
def test_last_number_is_read_in_several_phrasings(spec: str) -> None:
    task = load_rl_task(spec, n_train=20, n_held_out=5)
    for r in task.train:
        a = r.answer
        wrong = str(int(a) + 1)
        for right in (a, f"The answer is {a}.", f"{wrong}? No: {a}", f"**{a}**\n",
                      f"It is {a}.0 exactly", f"Answer: {a}", f"0{a}"):
            assert task.reward(r, right) == 1.0 and task.correct(r, right), right
        for bad in (wrong, f"The answer is {a}.5", f"{a} or maybe {wrong}", "I do not know",
                    ""):
            assert task.reward(r, bad) == 0.0 and not task.correct(r, bad), bad


def test_sort_reads_the_last_list() -> None:
    task = load_rl_task("builtin:sort", n_train=20, n_held_out=5)
    for r in task.train:
        nums = r.answer.split(", ")
        for right in (r.answer, f"Sorted: {r.answer}.", ",".join(nums),
                      ", ".join(nums[:-1]) + " and " + nums[-1],
                      ", ".join(nums[:-1]) + ", and " + nums[-1],
                      f"From {', '.join(reversed(nums))} we get {r.answer}"):
            assert task.correct(r, right) and task.reward(r, right) == 1.0, right
        for bad in (", ".join(reversed(nums)), ", ".join(nums[:-1]), nums[0], "no idea",
                    f"{r.answer} reversed is {', '.join(reversed(nums))}"):
            assert not task.correct(r, bad) and task.reward(r, bad) == 0.0, bad


def test_gsm8k_mini_agrees_with_the_harness_extractor(tmp_path: Path) -> None:
    task = load_rl_task("builtin:gsm8k-mini", n_train=30, n_held_out=5)
    path = tmp_path / "gsm.jsonl"
    with path.open("w") as f:
        for r in task.train:
            f.write(json.dumps({"question": r.prompt, "answer": r.data["solution"]}) + "\n")
    harness = load_task(str(path))
    for r, item in zip(task.train, harness.items, strict=True):
        a = r.answer
        assert r.data["solution"].endswith(f"\n#### {a}")
        completions = [r.data["solution"], f"So it is {a}.\n#### {a}.", f"#### {a}",
                       f"#### {int(a) + 1}", f"The answer is {a}.", f"#### ${a}",
                       f"#### {a}\n#### {int(a) + 1}", f"#### {int(a) + 1}\n#### {a}", ""]
        for text in completions:
            strict = _generate_metrics(harness, [item], [text])["strict-match"]
            assert task.correct(r, text) == (strict == 1.0), text
            assert task.reward(r, text) == strict
    r = task.train[0]
    assert task.correct(r, f"#### {r.answer}") and not task.correct(r, f"{r.answer}")


def test_format_reward_is_off_by_default_and_documented_when_on() -> None:
    r = load_rl_task("builtin:gsm8k-mini", n_train=1, n_held_out=1).train[0]
    on = load_rl_task("builtin:gsm8k-mini", n_train=1, n_held_out=1, format_reward=0.1)
    wrong = f"#### {int(r.answer) + 1}"
    assert load_rl_task("builtin:gsm8k-mini", n_train=1, n_held_out=1).reward(r, wrong) == 0
    assert on.reward(r, wrong) == 0.1 and on.reward(r, "no answer") == 0.0
    assert on.reward(r, f"#### {r.answer}") == 1.0 and not on.correct(r, wrong)


def test_builtin_errors() -> None:
    with pytest.raises(ConfigError, match="builtin:arith, builtin:count-letters"):
        load_rl_task("builtin:copy")
    with pytest.raises(ConfigError, match="too few distinct prompts"):
        load_rl_task("builtin:count-letters", n_held_out=100_000, n_train=1)
    with pytest.raises(ConfigError, match="n_train"):
        load_rl_task("builtin:arith", n_train=0)
    with pytest.raises(ConfigError, match="match"):
        load_rl_task("builtin:arith", match="regex")
    with pytest.raises(ConfigError, match="match must be one of exact, regex"):
        load_rl_task("builtin:arith", match="fuzzy")


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in rows))
    return path


def test_file_task_exact_and_split(tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i, "id": i} for i in range(50)]
    rows.append({"prompt": "What is 3 + 3?", "answer": "6", "id": "dup"})  # a repeated prompt
    path = _write(tmp_path / "sums.jsonl", rows)
    task = load_rl_task(str(path), seed=1, n_held_out=100)
    assert task.name == "sums" and len(task.held_out) == 5  # 10 % of 50 distinct prompts
    assert len(task.train) + len(task.held_out) in (50, 51)
    assert not {r.prompt for r in task.train} & {r.prompt for r in task.held_out}
    assert len({r.prompt for r in task.held_out}) == 5
    assert load_rl_task(str(path), seed=1).held_out == task.held_out
    assert load_rl_task(str(path), seed=2).held_out != task.held_out
    assert len(load_rl_task(str(path), n_held_out=2).held_out) == 2
    assert len(load_rl_task(str(path), n_train=10).train) == 10
    r = next(r for r in task.train if r.data["id"] == 7)
    assert r.answer == "14" and r.data == rows[7]
    for right in ("14", "  14\n", "14 "):
        assert task.reward(r, right) == 1.0 and task.correct(r, right)
    for bad in ("The answer is 14.", "15", "1 4", ""):
        assert task.reward(r, bad) == 0.0 and not task.correct(r, bad)
    spaced = _write(tmp_path / "s.jsonl", [{"prompt": "p", "answer": "two  words\n"},
                                           {"prompt": "q", "answer": "x"}])
    t = load_rl_task(str(spaced), n_held_out=0)
    rec = next(r for r in t.train if r.prompt == "p")
    assert t.correct(rec, " two\twords ") and not t.correct(rec, "twowords")


def test_file_task_regex(tmp_path: Path) -> None:
    rows = [{"prompt": "Name a primary colour.", "answer": r"(?i)\b(red|blue|yellow)\b"},
            {"prompt": "Say 42 exactly.", "answer": r"^\s*42\s*$"}]
    task = load_rl_task(str(_write(tmp_path / "re.jsonl", rows)), match="regex", n_held_out=0)
    colour, exact = sorted(task.train, key=lambda r: r.prompt)
    assert task.correct(colour, "I like Blue.") and task.reward(colour, "red") == 1.0
    assert not task.correct(colour, "green") and task.reward(colour, "bluegreen") == 0.0
    assert task.correct(exact, " 42\n") and not task.correct(exact, "it is 42")


def test_file_task_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    with pytest.raises(DataError, match="does not exist.*builtin:arith"):
        load_rl_task(str(missing))
    cases = {
        "bad.jsonl": (['{"prompt": "a", "answer": "1"}', "{not json"], r"bad.jsonl:2"),
        "noans.jsonl": ([{"prompt": "a"}], r"noans.jsonl:1: field 'answer'"),
        "noprompt.jsonl": ([{"answer": "1"}], r"noprompt.jsonl:1: field 'prompt'"),
        "list.jsonl": (["[1, 2]"], r"list.jsonl:1: not a JSON object"),
        "one.jsonl": ([{"prompt": "a", "answer": "1"}] * 3, r"1 distinct prompt"),
    }
    for name, (rows, message) in cases.items():
        with pytest.raises(DataError, match=message):
            load_rl_task(str(_write(tmp_path / name, rows)))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records"):
        load_rl_task(str(tmp_path / "empty.jsonl"))
    bad_re = _write(tmp_path / "re.jsonl", [{"prompt": "a", "answer": "(unclosed"},
                                            {"prompt": "b", "answer": "x"}])
    with pytest.raises(DataError, match=r"re.jsonl:1: 'answer' is not a valid regex"):
        load_rl_task(str(bad_re), match="regex")
    assert load_rl_task(str(bad_re)).train  # the same answers are fine as exact text
    with pytest.raises(DataError, match="field 'answer'") as info:
        load_rl_task(str(_write(tmp_path / "x.jsonl", ['{"prompt": "a", "answer": ["a\\nb"]}'])))
    assert "\n" not in str(info.value)


def _reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                   body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_user_reward_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _reward_module(tmp_path, monkeypatch, "rw_good", (
        "def score(prompt, completion, record):\n"
        "    return len(completion) / 10 + (record['answer'] in completion)\n"
        "class Holder:\n"
        "    @staticmethod\n"
        "    def half(prompt, completion, record):\n"
        "        return 0.5\n"))
    task = load_rl_task("builtin:arith", n_train=3, n_held_out=2, reward="rw_good:score")
    r = task.train[0]
    assert task.reward(r, r.answer) == pytest.approx(len(r.answer) / 10 + 1)
    assert task.reward(r, "xx") == pytest.approx(0.2)
    assert task.correct(r, r.answer) and not task.correct(r, "xx")  # the task's own check
    nested = load_rl_task("builtin:sort", n_train=1, n_held_out=1, reward="rw_good:Holder.half")
    assert nested.reward(nested.train[0], "") == 0.5


def test_user_reward_from_the_current_directory(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rw_cwd.py").write_text("def f(p, c, r):\n    return 1.0 if c else 0.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path
                                     if p not in ("", str(tmp_path))])
    task = load_rl_task("builtin:arith", n_train=1, n_held_out=1, reward="rw_cwd:f")
    assert task.reward(task.train[0], "x") == 1.0
    assert str(tmp_path) not in __import__("sys").path  # only while it imports


def test_user_reward_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _reward_module(tmp_path, monkeypatch, "rw_bad", (
        "import math\n"
        "NOT_CALLABLE = 3\n"
        "def nan(p, c, r):\n    return math.nan\n"
        "def text(p, c, r):\n    return '1.0'\n"
        "def flag(p, c, r):\n    return True\n"
        "def boom(p, c, r):\n    raise ValueError('bad\\nthing')\n"
        "def one_arg(p):\n    return 1.0\n"))
    _reward_module(tmp_path, monkeypatch, "rw_broken", "import no_such_dependency_xyz\n")

    def load(spec: str):
        return load_rl_task("builtin:arith", n_train=2, n_held_out=1, reward=spec)

    for spec, message in [("nomodule_xyz:f", "cannot import module 'nomodule_xyz'"),
                          ("rw_broken:f", "importing rw_broken .*no_such_dependency_xyz"),
                          ("rw_bad:missing", "has no 'missing'"),
                          ("rw_bad:NOT_CALLABLE", "NOT_CALLABLE is a int, not a function"),
                          ("rw_bad:one_arg", "cannot be called as f"),
                          ("rw_bad", "MODULE:FUNCTION"), (":f", "MODULE:FUNCTION")]:
        with pytest.raises(ConfigError, match=message) as info:
            load(spec)
        assert "\n" not in str(info.value)
    for name, message in [("nan", "returned nan"), ("text", "returned '1.0'"),
                          ("flag", "returned True"), ("boom", "raised ValueError: bad")]:
        task = load(f"rw_bad:{name}")
        r = task.train[0]
        with pytest.raises(ConfigError, match=f"rw_bad:{name}.*{message}") as info:
            task.reward(r, "7")
        assert "\n" not in str(info.value) and r.prompt[:20] in str(info.value)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    flags = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_all_k_subsets() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k),
                                                           abs=1e-12), (n, c, k)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0 and math.isfinite(pass_at_k(1000, 1, 500))
    per_prompt = [[True, False, False, True], [False] * 4, [True] * 4]
    assert pass_at_k_of(per_prompt, 2) == pytest.approx(
        sum(_brute_pass_at_k(4, sum(p), 2) for p in per_prompt) / 3)
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1)]:
        with pytest.raises(ConfigError):
            pass_at_k(*bad)
    with pytest.raises(ConfigError):
        pass_at_k_of([], 1)


def test_record_is_frozen() -> None:
    r = Record("p", "a", {"x": 1})
    with pytest.raises(AttributeError):
        r.prompt = "q"  # type: ignore[misc]
    assert hash(r) == hash(Record("p", "a", {"y": 2}))
