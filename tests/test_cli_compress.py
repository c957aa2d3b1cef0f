"""`tinylm compress` end to end in a temporary folder: report, checkpoint, sweep, errors."""

from __future__ import annotations

import json

import pytest
import torch

from tinylm import GPT, ModelConfig
from tinylm.cli import main
from tinylm.data import prepare
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.lowrank import structure_of

TEXT = "the quick brown fox jumps over the lazy dog. attention is all you need!\n" * 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(root / "data", [root / "text.txt"], context_length=16, progress=False)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=data.vocab_size, context_length=16, n_layer=2,
                            n_head=2, n_embd=32))
    save_checkpoint(root / "model", model, data.tokenizer)
    return root


def test_compress_writes_a_checkpoint_that_loads_without_flags(setup, tmp_path, capsys) -> None:
    out = tmp_path / "small"
    code = main(["compress", "--model", str(setup / "model"), "--out", str(out),
                 "--params-fraction", "0.6", "--data", str(setup / "data")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "blocks.0.attn.qkv" in printed and "fewer" in printed
    assert "val loss:" in printed and "perplexity" in printed and "file size" in printed
    model, tok = load_checkpoint(out)
    assert tok is not None and structure_of(model)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["lowrank"] == structure_of(model)
    assert cfg["compress"]["mode"] == "params_fraction=0.6"
    # compress itself loads a compressed checkpoint and compresses it further.
    assert main(["compress", "--model", str(out), "--out", str(tmp_path / "smaller"),
                 "--rank", "2", "--layers", "ffn.up"]) == 0
    again, _ = load_checkpoint(tmp_path / "smaller")
    assert structure_of(again)["blocks.1.ffn.up"] == 2


def test_sweep_prints_a_table_and_draws_a_plot(setup, tmp_path, capsys) -> None:
    png = tmp_path / "sweep.png"
    code = main(["compress", "--model", str(setup / "model"), "--sweep", "--fractions",
                 "0.8,0.6", "--data", str(setup / "data"), "--plot", str(png),
                 "--eval-windows", "4"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| original |" in printed and "| 0.8 |" in printed and "| 0.6 |" in printed
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("flags, message", [
    (["--rank", "0"], "rank must be an integer >= 1"),
    (["--rank", "33"], "above the full rank 32"),
    (["--energy", "0"], "(0, 1]"),
    (["--energy", "1.5"], "(0, 1]"),
    (["--params-fraction", "-0.5"], "(0, 1]"),
    (["--params-fraction", "2"], "(0, 1]"),
    (["--rank", "4", "--layers", "attn.qkv,mlp.c_fc"], "unknown layer name 'mlp.c_fc'"),
    ([], "choose how much to keep"),
    (["--sweep"], "--sweep needs --data"),
    (["--sweep", "--data", "DATA", "--fractions", "0.5,1.5"], "--fractions"),
    (["--rank", "4", "--finetune", "10"], "--finetune 10 needs"),
])
def test_bad_flags_give_one_line_errors(setup, tmp_path, capsys, flags, message) -> None:
    flags = [str(setup / "data") if f == "DATA" else f for f in flags]
    out = tmp_path / "out"
    code = main(["compress", "--model", str(setup / "model"), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("tinylm compress: error:")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_missing_model_is_a_one_line_error(tmp_path, capsys) -> None:
    code = main(["compress", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                 "--rank", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and err.count("\n") == 1


def test_out_never_deletes_a_users_files(setup, tmp_path, capsys) -> None:
    """A run folder, a folder with other files, or a file as --out is refused, even with
    --force; --force replaces an existing checkpoint (and only checkpoint files)."""
    run = tmp_path / "run"
    (run / "latest").mkdir(parents=True)
    for name in ("metrics.jsonl", "run.toml", "loss.png"):
        (run / name).write_text("x")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    base = ["compress", "--model", str(setup / "model"), "--rank", "4"]
    for out, words in ((run, "training run folder"), (notes, "notes.txt"), (afile, "is a file")):
        before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
        for extra in ([], ["--force"]):
            assert main([*base, "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1, err
        if before is not None:
            assert sorted(p.name for p in out.iterdir()) == before
    assert afile.read_text() == "mine"
    out = tmp_path / "ck"
    assert main([*base, "--out", str(out)]) == 0
    assert main([*base, "--out", str(out)]) == 2 and "--force" in capsys.readouterr().err
    assert main([*base, "--out", str(out), "--force"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out


def test_sweep_plot_reports_the_file_written_and_refuses_other_formats(setup, tmp_path,
                                                                      capsys) -> None:
    base = ["compress", "--model", str(setup / "model"), "--sweep", "--fractions", "0.8",
            "--data", str(setup / "data"), "--eval-windows", "2"]
    assert main([*base, "--plot", str(tmp_path / "runs")]) == 0
    assert f"plot: {tmp_path / 'runs.png'}" in capsys.readouterr().out
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*base, "--plot", str(tmp_path / "x.svg")]) == 0
    assert b"<svg" in (tmp_path / "x.svg").read_bytes()[:500]
    assert main([*base, "--plot", str(tmp_path / "x.jpg")]) == 2
    assert ".jpg" in capsys.readouterr().err and not (tmp_path / "x.jpg").exists()


def test_data_prepared_with_another_tokenizer_is_refused(setup, tmp_path, capsys) -> None:
    """Issue 36 item 3: compress --data (and --sweep) of another tokenizer reported a loss
    change with exit 0; now one line and exit 2, as eval and quantize, nothing written. The
    same text in capitals gives a char vocabulary of the same size (every id in range)."""
    (tmp_path / "upper.txt").write_text(TEXT.upper(), encoding="utf-8")
    other = prepare(tmp_path / "other", [tmp_path / "upper.txt"], context_length=16,
                    progress=False)
    assert other.vocab_size == load_checkpoint(setup / "model")[0].config.vocab_size
    base = ["compress", "--model", str(setup / "model"), "--data", str(other.dir)]
    for flags in (["--out", str(tmp_path / "c"), "--rank", "2"],
                  ["--out", str(tmp_path / "c"), "--rank", "2", "--finetune", "2"],
                  ["--sweep", "--fractions", "0.8", "--plot", str(tmp_path / "s.png")]):
        code = main([*base, *flags])
        err = capsys.readouterr().err
        assert code == 2, flags
        assert err.startswith("tinylm compress: error:") and err.count("\n") == 1, err
        assert "was prepared with a different tokenizer than the model's" in err
        assert str(setup / "model" / "tokenizer.json") in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "s.png").exists()
