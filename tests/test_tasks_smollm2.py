"""Task accuracy on the real SmolLM2-135M-Instruct (its GGUF file through tinylm's cache):
the built-in tasks and 20 easy common-sense items (tests/data/commonsense20.jsonl) score
above chance, through ``tinylm eval --suite --json``."""

from __future__ import annotations

import json
from pathlib import Path

from tinylm.cli import main

ITEMS = Path(__file__).parent / "data" / "commonsense20.jsonl"
SUITE = """\
[[task]]
task = "builtin:copy"
limit = 10
[[task]]
task = "builtin:count"
limit = 10
[[task]]
task = "builtin:brackets"
limit = 12
[[task]]
task = "builtin:add-digits"
limit = 10
[[task]]
task = "builtin:add-words"
limit = 20
[[task]]
task = "{items}"
"""


def test_real_model_scores_above_chance(smollm2_gguf, tmp_path, capsys) -> None:
    suite = tmp_path / "suite.toml"
    suite.write_text(SUITE.format(items=ITEMS), encoding="utf-8")
    assert main(["eval", "--model", str(smollm2_gguf), "--suite", str(suite), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tasks = out["tasks"]
    assert list(tasks) == ["builtin:copy", "builtin:count", "builtin:brackets",
                           "builtin:add-digits", "builtin:add-words", "commonsense20"]
    for name, r in tasks.items():
        assert r["acc"] > r["baseline"], (name, r)
        assert r["centered"] > 0, (name, r)
    assert tasks["commonsense20"]["n"] == 20 and tasks["commonsense20"]["baseline"] == 0.5
    assert tasks["commonsense20"]["acc"] >= 0.75  # measured: 0.80 (16 of 20)
    assert out["core"] > 0.2
