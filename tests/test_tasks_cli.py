"""tinylm eval --task / --suite: the JSON contract, the table, the CORE-style summary,
the record in a run's metrics.jsonl, and one-line errors."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tinylm.cli import main
from tinylm.core.config import ModelConfig
from tinylm.core.errors import DataError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import BPETokenizer
from tinylm.io.checkpoint import load_model, load_tokenizer_of
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.training.runlog import read_metrics
from tinylm.use.suite import centred, read_suite
from tinylm.use.task_files import load_task
from tinylm.use.tasks import evaluate_task

TEXT = "The sky is blue. Grass is green. Snow is white. Fire is hot. Ice is cold. " * 4
ITEMS = [{"context": "The sky is", "choices": ["blue", "green", "hot"], "answer": 0},
         {"context": "Grass is", "choices": ["white", "green"], "answer": 1},
         {"context": "Fire is ", "choices": ["cold", "hot"], "answer": 1},
         {"context": "Snow is", "choices": ["white", "blue", "hot", "green"], "answer": 0}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaltasks")
    tok = BPETokenizer.train([TEXT], vocab_size=300, special_tokens=["<|endoftext|>"])
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16,
                            context_length=32))
    save_checkpoint(root / "ckpt", model, tok)
    items = root / "colors.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in ITEMS), encoding="utf-8")
    return root


def _eval_json(capsys, *argv) -> dict:
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_is_the_contract_and_equals_the_library(checkpoint, capsys) -> None:
    ckpt, items = checkpoint / "ckpt", checkpoint / "colors.jsonl"
    out = _eval_json(capsys, "--model", str(ckpt), "--task", str(items), "--batch-size", "3")
    result = out["tasks"]["colors"]
    assert result["kind"] == "multiple_choice" and result["n"] == 4
    lib = evaluate_task(load_model(ckpt), load_tokenizer_of(ckpt), load_task(str(items)))
    for key in ("acc", "acc_norm", "acc_bytes", "baseline"):
        assert result[key] == lib[key]
    assert result["centered"] == pytest.approx(centred(lib["acc"], lib["baseline"]))
    assert out["metrics_file"] is None  # a checkpoint folder, not a run folder
    limited = _eval_json(capsys, "--model", str(ckpt), "--task", str(items), "--limit", "2",
                         "--num-fewshot", "1", "--task", "builtin:count")
    assert limited["tasks"]["colors"]["n"] == 2
    assert limited["tasks"]["colors"]["num_fewshot"] == 1
    assert limited["tasks"]["builtin:count"]["kind"] == "cloze"


def test_table_by_default(checkpoint, capsys) -> None:
    assert main(["eval", "--model", str(checkpoint / "ckpt"), "--task",
                 str(checkpoint / "colors.jsonl")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("task"))
    assert header.split() == ["task", "kind", "n", "shots", "acc", "acc_norm", "acc_bytes",
                              "baseline", "centred", "s/100"]
    row = next(line for line in out.splitlines() if line.startswith("colors"))
    assert row.split()[:3] == ["colors", "multiple_choice", "4"]


def test_suite_reports_centred_scores_and_their_mean(checkpoint, capsys) -> None:
    suite = checkpoint / "suite.toml"
    suite.write_text(textwrap.dedent("""\
        limit = 3
        [[task]]
        task = "colors.jsonl"
        metric = "acc_norm"
        [[task]]
        task = "builtin:brackets"
        [[task]]
        task = "builtin:add-digits"
        limit = 2
        """), encoding="utf-8")
    out = _eval_json(capsys, "--model", str(checkpoint / "ckpt"), "--suite", str(suite))
    tasks = out["tasks"]
    assert list(tasks) == ["colors", "builtin:brackets", "builtin:add-digits"]
    assert tasks["colors"]["n"] == 3 and tasks["builtin:add-digits"]["n"] == 2
    assert tasks["colors"]["score"] == tasks["colors"]["acc_norm"]
    assert tasks["builtin:brackets"]["baseline"] == 0.25
    assert tasks["builtin:add-digits"]["baseline"] == 0.0
    for r in tasks.values():
        assert r["centered"] == pytest.approx((r["score"] - r["baseline"])
                                              / (1 - r["baseline"]))
    assert out["core"] == pytest.approx(sum(r["centered"] for r in tasks.values()) / 3)
    assert main(["eval", "--model", str(checkpoint / "ckpt"), "--suite", str(suite)]) == 0
    assert "CORE-style score" in capsys.readouterr().out


def test_suite_file_errors(tmp_path) -> None:
    from tinylm.core.errors import ConfigError

    bad = tmp_path / "s.toml"
    for text, message in [("", "no \\[\\[task\\]\\]"), ("[[task]]\nname = 'x'\n", "needs task"),
                          ("[[task]]\ntask = 'a.jsonl'\nmetrc = 'acc'\n", "unknown key 'metrc'"),
                          ("[[task]]\ntask = 'a.jsonl'\nmetric = 'f1'\n", "metric must be"),
                          ("limit = 0\n[[task]]\ntask = 'builtin:copy'\n", "limit must be"),
                          ("[[task]\n", "not valid TOML")]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            read_suite(bad)
    bad.write_text("[[task]]\ntask = 'sub/a.jsonl'\nfewshot_file = 'b.jsonl'\n")
    entries, seed = read_suite(bad)
    assert entries[0].spec == str(tmp_path / "sub" / "a.jsonl") and seed is None
    assert entries[0].fewshot_file == str(tmp_path / "b.jsonl")
    with pytest.raises(DataError):
        centred(0.5, 1.0)


def test_a_run_folder_gets_a_metrics_record(checkpoint, capsys, tmp_path) -> None:
    run = tmp_path / "run"
    (tmp_path / "text.txt").write_text(TEXT * 10, encoding="utf-8")
    assert main(["prepare", "--input", str(tmp_path / "text.txt"), "--out",
                 str(tmp_path / "data"), "--context-length", "16", "--no-progress"]) == 0
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(run), "--n-layer",
                 "1", "--n-head", "2", "--n-embd", "16", "--context-length", "16",
                 "--batch-size", "2", "--max-steps", "2", "--eval-every", "2",
                 "--eval-windows", "1", "--save-every", "2", "--warmup-steps", "0",
                 "--device", "cpu", "--no-progress", "-q"]) == 0
    capsys.readouterr()
    before = read_metrics(run)
    out = _eval_json(capsys, "--model", str(run), "--task", str(checkpoint / "colors.jsonl"))
    after = read_metrics(run)
    assert after[:-1] == before
    assert after[-1] == {"step": 2, "tasks": out["tasks"]}
    assert out["step"] == 2 and out["metrics_file"] == str(run / "metrics.jsonl")


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_errors_are_one_line(checkpoint, capsys) -> None:
    ckpt = str(checkpoint / "ckpt")
    assert "tinylm downloads nothing" in _one_line(capsys, ["eval", "--model", ckpt,
                                                            "--task", "hellaswag"])
    assert "no built-in task" in _one_line(capsys, ["eval", "--model", ckpt, "--task",
                                                    "builtin:nope"])
    assert "--stride applies to --data" in _one_line(
        capsys, ["eval", "--model", ckpt, "--task", "builtin:copy", "--stride", "4"])
    assert "--fewshot-file" in _one_line(
        capsys, ["eval", "--model", ckpt, "--task", str(checkpoint / "colors.jsonl"),
                 "--num-fewshot", "2"])
    assert "not allowed with" in _one_line(
        capsys, ["eval", "--model", ckpt, "--task", "builtin:copy", "--suite", "x.toml"])
