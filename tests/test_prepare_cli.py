"""`tinylm prepare` end to end: the built-in corpus, a file with BPE, stdin, and every
bad input giving one line on stderr, exit status 2, and an untouched output folder."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tinylm.cli import main
from tinylm.data import load_prepared


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tinylm prepare: error: "), err
    return err


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "some.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. 日本語も大丈夫。\n" * 300,
                    encoding="utf-8")
    return path


@pytest.fixture
def prepared(tmp_path, capsys):
    out = tmp_path / "py"
    assert main(["prepare", "--out", str(out)]) == 0
    capsys.readouterr()
    return out


def test_builtin_corpus_with_no_input(prepared, capsys) -> None:
    d = load_prepared(prepared)
    assert d.meta["source"] == "corpus:python-docs" and d.tokenizer.kind == "char"
    assert len(d.val) == round(0.1 * (len(d.train) + len(d.val))) > 0


def test_file_with_bpe_prints_summary(text_file, tmp_path, capsys) -> None:
    out = tmp_path / "x"
    code = main(["prepare", "--input", str(text_file), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--context-length", "16", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"prepared {out}" in printed and "bpe tokenizer with 300 tokens" in printed
    d = load_prepared(out)
    assert d.tokenizer.decode(np.concatenate([d.train, d.val])) == text_file.read_text()


def test_stdin_and_rerun_of_same_dataset(text_file, tmp_path) -> None:
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "tinylm", "prepare", "--input", "-", "--context-length", "16",
           "--out", str(out)]
    for _ in range(2):  # the same dataset again is fine (no --force needed)
        run = subprocess.run(cmd, input=text_file.read_bytes(), capture_output=True)
        assert run.returncode == 0, run.stderr
    d = load_prepared(out)
    assert d.meta["source"] == "-"
    assert d.tokenizer.decode(np.concatenate([d.train, d.val])) == text_file.read_text()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json",
                                                     "train-00000.bin", "val-00000.bin"]


@pytest.mark.parametrize("case", ["missing", "empty", "short", "non_utf8", "non_utf8_bpe",
                                  "binary",
                                  "vocab_small", "bad_val_fraction", "unknown_corpus",
                                  "different_dataset", "different_text", "missing_tokenizer",
                                  "shard_tokens", "workers", "no_text_field", "bad_parquet",
                                  "no_glob_match", "separator", "json_file"])
def test_bad_input_one_line_exit_2_nothing_overwritten(case, prepared, text_file, tmp_path,
                                                       capsys) -> None:
    before = _snapshot(prepared)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    short = tmp_path / "short.txt"
    short.write_text("hello\n")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 ".encode("utf-8") * 100 + "na\u00efve".encode("latin-1"))
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    records = tmp_path / "r.jsonl"
    records.write_text('{"body": "no text field here"}\n' * 50)
    parquet = tmp_path / "broken.parquet"
    parquet.write_bytes(b"PAR1 but not really")
    (tmp_path / "x.json").write_text('[{"text": "a list of records"}]')
    args = {
        "missing": ["--input", str(tmp_path / "nope.txt")],
        "empty": ["--input", str(empty)],
        "short": ["--input", str(short)],
        "non_utf8": ["--input", str(bad)],
        "non_utf8_bpe": ["--input", str(bad), "--tokenizer", "bpe"],  # raised inside training
        "binary": ["--input", str(binary)],
        "vocab_small": ["--tokenizer", "bpe", "--vocab-size", "200"],
        "bad_val_fraction": ["--val-fraction", "1.5"],
        "unknown_corpus": ["--corpus", "nope"],
        "different_dataset": ["--tokenizer", "bpe"],
        "different_text": ["--input", str(text_file)],
        "missing_tokenizer": ["--tokenizer", str(tmp_path / "tok.json")],
        "shard_tokens": ["--shard-tokens", "0"],
        "workers": ["--workers", "-2"],
        "no_text_field": ["--input", str(records)],
        "bad_parquet": ["--input", str(parquet)],
        "no_glob_match": ["--input", str(tmp_path / "*.parquet.nope")],
        "separator": ["--input", str(text_file), "--input", str(short), "--doc-separator",
                      "<|nope|>"],
        "json_file": ["--input", str(tmp_path / "x.json")],
    }[case]
    expect = {
        "missing": "does not exist",
        "empty": "input is empty",
        "short": "input is too short: 6 tokens",
        "non_utf8": f"{bad} is not UTF-8 text: byte 0xef at byte offset 602",
        "non_utf8_bpe": f"{bad} is not UTF-8 text: byte 0xef at byte offset 602",
        "binary": f"{binary} is not UTF-8 text: byte 0x89 at byte offset 0",
        "vocab_small": "too small for byte-level BPE",
        "bad_val_fraction": "val fraction must be between 0 and 1",
        "unknown_corpus": "unknown corpus 'nope'",
        "different_dataset": "already holds a different dataset",
        "different_text": "already holds a different dataset",
        "missing_tokenizer": "does not exist",
        "shard_tokens": "--shard-tokens must be a positive integer, got 0",
        "workers": "--workers must be a positive integer, got -2",
        "no_text_field": f"50 record(s) have no usable text (50 field 'text' is missing); "
                         f"the first: {records} line 1",
        "bad_parquet": f"{parquet} is not a readable Parquet file",
        "no_glob_match": "matches no files",
        "separator": "--doc-separator <|nope|> is not a special token",
        "json_file": "x.json is a .json file, which prepare does not read as text",
    }[case]
    if not case.startswith("different"):  # --force: only the bad input may stop the run
        args.append("--force")
    assert main(["prepare", *args, "--out", str(prepared)]) == 2
    err = _error_line(capsys)
    assert expect in err, err
    assert _snapshot(prepared) == before


def test_force_overwrites_a_different_dataset(prepared, text_file, capsys) -> None:
    args = ["prepare", "--input", str(text_file), "--context-length", "16", "--out",
            str(prepared)]
    assert main(args) == 2
    assert main([*args, "--force"]) == 0
    assert load_prepared(prepared).meta["source"] == str(text_file.resolve())


def test_output_that_is_a_file_or_holds_other_files(text_file, tmp_path, capsys) -> None:
    args = ["prepare", "--input", str(text_file), "--context-length", "16", "--out"]
    assert main([*args, str(text_file)]) == 2
    assert "is a file, not a folder" in _error_line(capsys)
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main([*args, str(other)]) == 2
    assert "is not empty (has notes.txt)" in _error_line(capsys)
    assert main([*args, str(other), "--force"]) == 0
    assert (other / "notes.txt").read_text() == "mine"  # --force never deletes other files


def test_errors_replace_goes_on(tmp_path, capsys) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("na\u00efve caf\u00e9\n".encode("latin-1") * 50)
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(bad), "--errors", "replace", "--context-length", "16",
                 "--out", str(out)]) == 0
    assert "\ufffd" in load_prepared(out).tokenizer.chars


def test_unknown_replace_is_stored_in_the_tokenizer(text_file, tmp_path) -> None:
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(text_file), "--unknown", "replace",
                 "--context-length", "16", "--out", str(out)]) == 0
    tok = load_prepared(out).tokenizer
    assert tok.decode(tok.encode("fox🦊")) == "fox<unk>"


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_special_spellings_in_a_corpus_are_text_unless_allow_special(tokenizer, tmp_path,
                                                                     capsys) -> None:
    """Issue 11 item 4: a corpus that spells <|endoftext|> gets the special id only with
    --allow-special (recorded in meta.json and in the dataset's settings)."""
    text = tmp_path / "t.txt"
    text.write_text("one document<|endoftext|>another one, and more text. " * 200,
                    encoding="utf-8")
    flags = ["--tokenizer", tokenizer, "--vocab-size", "300", "--context-length", "8",
             "--no-progress"]
    for allow in (False, True):
        out = tmp_path / f"{tokenizer}-{allow}"
        extra = ["--allow-special"] if allow else []
        assert main(["prepare", "--input", str(text), "--out", str(out), *flags, *extra]) == 0
        data = load_prepared(out)
        eos = data.tokenizer.eos_id
        ids = np.concatenate([np.asarray(data.train), np.asarray(data.val)])
        # one separator per document boundary is the only special id without the flag
        assert (int((ids == eos).sum()) > 150) == allow, (tokenizer, allow)
        assert data.meta["allow_special"] is allow
    capsys.readouterr()
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / f"{tokenizer}-False"),
                 *flags, "--allow-special"]) == 2  # another dataset: refused without --force
    assert "allow_special" in capsys.readouterr().err
