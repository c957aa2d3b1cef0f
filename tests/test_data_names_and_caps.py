"""Issue #32: names printed escaped (control characters, escape codes, line breaks, bidi
marks), tokenizer.json size-capped like config.json; #36 item 10: prepare's counts in words."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest

from tinylm.cli import main
from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data.tokenizer_files import MAX_TOKENIZER_BYTES, load_tokenizer, tokenizer_from_json
from tinylm.data.tokenizers import CharTokenizer

HOSTILE = "evil\n\x1b[2J\x1b[31mred\r\t\x07\x7f\x85\u202etxt.exe\u2066\u200f"


@pytest.mark.parametrize("name, shown", [
    ("plain/é/日本/😀.jsonl", "plain/é/日本/😀.jsonl"),
    ("a\nb", "a\\nb"),
    ("\x1b[31mred", "\\x1b[31mred"),
    ("x\u202eexe.txt", "x\\u202eexe.txt"),
    ("\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069\u200e\u200f",
     "\\u202a\\u202b\\u202c\\u202d\\u2066\\u2067\\u2068\\u2069\\u200e\\u200f"),
    ("\x00\x7f\x9b", "\\x00\\x7f\\x9b"),
    (b"bad\xff\xfe.txt", "bad\\xff\\xfe.txt"),
    (Path(os.fsdecode(b"d/\xff\n")), "d/\\xff\\n"),
    ("lone \ud800", "lone \\ud800"),
])
def test_display_name_escapes_what_changes_the_display(name, shown) -> None:
    assert display_name(name) == shown


def test_display_name_escapes_exactly_the_controls_and_bidi_marks() -> None:
    # the oracle: Unicode's own category Cc (C0, DEL, C1) plus the listed marks
    marks = {*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)),
             "\u200e", "\u200f", "\u061c", "\u2028", "\u2029"}
    for c in map(chr, range(0x3000)):
        shown = display_name(f"a{c}b")
        if unicodedata.category(c) == "Cc" or c in marks:
            assert shown != f"a{c}b" and shown.isprintable(), repr(c)
            assert shown.encode("ascii").decode("unicode_escape") == f"a{c}b"
        else:
            assert shown == f"a{c}b", repr(c)


def _no_raw_controls(text: str) -> None:
    for bad in ("\x1b", "\r", "\x07", "\x7f", "\x85", "\u202e", "\u2066", "\u200f"):
        assert bad not in text, repr(bad)


def test_prepare_prints_hostile_file_names_escaped(tmp_path, capsys) -> None:
    folder = tmp_path / HOSTILE
    folder.mkdir()
    src = folder / f"{HOSTILE}.jsonl"
    docs = [f"document {i} with some words in it " * 4 for i in range(12)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + '{"tex": 1}\n')
    out = tmp_path / f"out{HOSTILE}"
    assert main(["prepare", "--input", str(src), "--context-length", "8", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert err.count("\n") == 1 and display_name(src) + " line 13" in err
    assert main(["prepare", "--input", str(src), "--context-length", "8", "--skip-bad",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    _no_raw_controls(captured.out + captured.err)
    assert captured.out.count("\n") == 1
    assert f"prepared {display_name(out)}:" in captured.out
    assert "from 11 training documents and 1 validation document, 1 bad record skipped" \
        in captured.out
    assert display_name(src) in captured.out
    # a folder of nothing usable: the error names it escaped
    empty = tmp_path / f"e{HOSTILE}"
    empty.mkdir()
    assert main(["prepare", "--input", str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert err.count("\n") == 1 and display_name(empty) in err


def test_chat_messages_escape_hostile_names(tmp_path, capsys) -> None:
    src = tmp_path / f"{HOSTILE}.jsonl"
    src.write_text('{"prompt": "hi", "completion": "there"}\nnot json\n')
    assert main(["prepare", "--chat", str(src), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert err.count("\n") == 1 and f"{display_name(src)}:2: not valid JSON" in err
    missing = tmp_path / f"gone{HOSTILE}.jsonl"
    assert main(["prepare", "--chat", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert err.count("\n") == 1 and display_name(missing) in err


def test_prepare_counts_documents_in_words(tmp_path, capsys) -> None:
    # "from 1 + 0 documents" said nothing; a single text file splits by tokens
    (tmp_path / "one.txt").write_text("some text to learn from, " * 40)
    assert main(["prepare", "--input", str(tmp_path / "one.txt"), "--context-length", "8",
                 "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "from 1 training document and 0 validation documents," in out
    assert " + 0 documents" not in out


# --- tokenizer.json capped ---------------------------------------------------------------------


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # no disk used: the cap is checked before anything is read
    return path


def test_a_tokenizer_file_over_the_cap_is_refused_before_reading(tmp_path) -> None:
    assert MAX_TOKENIZER_BYTES == 64 << 20
    big = _sparse(tmp_path / "tokenizer.json", MAX_TOKENIZER_BYTES + 1)
    for target in (big, tmp_path):
        with pytest.raises(DataError) as info:
            load_tokenizer(target)
        message = str(info.value)
        assert "\n" not in message and f"{MAX_TOKENIZER_BYTES + 1:,} bytes" in message
        assert "67,108,864 (64 MiB)" in message
    with pytest.raises(DataError, match="64 MiB"):
        tokenizer_from_json(" " * (MAX_TOKENIZER_BYTES + 1), "x.json")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "vocab.json").write_text("{}")
    _sparse(gpt2 / "merges.txt", MAX_TOKENIZER_BYTES)
    with pytest.raises(DataError, match="64 MiB"):
        load_tokenizer(gpt2)


def test_a_tokenizer_file_at_the_cap_still_loads(tmp_path) -> None:
    tok = CharTokenizer("abc")
    text = json.dumps(tok.to_hf_json())
    path = tmp_path / "tokenizer.json"
    path.write_text(text + " " * (MAX_TOKENIZER_BYTES - len(text)))
    assert path.stat().st_size == MAX_TOKENIZER_BYTES
    assert load_tokenizer(path).encode("cab") == tok.encode("cab")


def test_cli_refuses_a_huge_tokenizer_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "t.txt").write_text("hello " * 100)
    big = _sparse(tmp_path / f"tok{HOSTILE}.json", 200 << 20)
    assert main(["prepare", "--input", str(tmp_path / "t.txt"), "--tokenizer", str(big),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert err.count("\n") == 1 and "209,715,200 bytes" in err and "64 MiB" in err
