"""Issue #32: JSONL records are read with a cap (``--max-record-bytes``), in bounded memory.

A line over the cap is a bad record like any other: counted, reported with its file,
line, the cap and the flag, skipped with ``--skip-bad``; never read whole into memory,
never a MemoryError or a traceback. The RSS tests run prepare in a subprocess on a
compressed file holding one multi-GB line, and on a 100 MB plain line, and read the
subprocess's own peak RSS (``resource.getrusage``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from tinylm.cli import main
from tinylm.core.errors import DataError
from tinylm.data import readers
from tinylm.data.chat import read_records
from tinylm.data.chatdata import longest_token, prepare_chat
from tinylm.data.lines import DISCARD_BYTES, bounded_lines
from tinylm.data.readers import BadRecords, file_source, iter_documents, iter_unit
from tinylm.data.tokenizers import BPETokenizer, CharTokenizer

SRC = Path(__file__).resolve().parents[1] / "src"
#: Peak RSS allowed for a prepare that meets a huge line: the interpreter with torch,
#: numpy and tokenizers imported is ~250 MB here; a 16 MiB record and its parse fit in the
#: rest. Before the cap, a 100 MB line took 1.7 GB and an 8 GB line 17 GB.
RSS_BOUND_MB = 500
GOOD = [f"record number {i} says hello " * 8 for i in range(24)]


def _line(text: str) -> bytes:
    return (json.dumps({"text": text}) + "\n").encode()


# --- the reader ----------------------------------------------------------------------------


def test_bounded_lines_give_long_lines_as_their_size_and_read_on() -> None:
    data = b"abc\n" + b"x" * 10 + b"\n" + b"12345\n" + b"y" * 7
    got = list(bounded_lines(io.BufferedReader(io.BytesIO(data), 4), 5))
    assert got == [b"abc\n", 11, b"12345\n", 7]  # a line of exactly the cap passes
    # the long line is read in blocks of DISCARD_BYTES, never whole
    reads = []

    class Spy(io.BytesIO):
        def readline(self, size: int = -1) -> bytes:
            reads.append(size)
            return super().readline(size)
    long = b"z" * (3 * DISCARD_BYTES + 5) + b"\nok\n"
    assert list(bounded_lines(Spy(long), 100)) == [3 * DISCARD_BYTES + 6, b"ok\n"]
    assert max(reads) == DISCARD_BYTES and -1 not in reads


@pytest.mark.parametrize("compress", [None, "gzip", "zstd"])
def test_a_line_over_the_cap_is_a_bad_record_named_by_file_and_line(tmp_path, compress) -> None:
    data = _line(GOOD[0]) + _line("w" * 500) + _line(GOOD[1])
    name = {"gzip": "d.jsonl.gz", "zstd": "d.jsonl.zst"}.get(compress, "d.jsonl")
    if compress == "gzip":
        import gzip
        data = gzip.compress(data)
    elif compress == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    (tmp_path / name).write_bytes(data)
    bad = BadRecords()
    docs = [t for t, _, _ in iter_documents([file_source(tmp_path / name)], bad=bad,
                                            max_record_bytes=300)]
    assert docs == GOOD[:2]
    assert bad.count == 1
    assert bad.first.startswith(f"{tmp_path / name} line 2: longer than the 300-byte")
    assert "--max-record-bytes" in bad.first and "(513 bytes;" in bad.first
    assert [t for t, _, _ in iter_documents([file_source(tmp_path / name)])] == \
        [GOOD[0], "w" * 500, GOOD[1]]  # the default cap (16 MiB) takes it


@pytest.mark.parametrize("long_unit", [False, True])
def test_units_read_by_workers_cap_lines_the_same(tmp_path, monkeypatch, long_unit) -> None:
    # long_unit: the unit (> cap + UNIT_BYTES) is read a line at a time, not whole
    if long_unit:
        monkeypatch.setattr(readers, "UNIT_BYTES", 64)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(_line(t) for t in GOOD[:3]) + _line("q" * 900)
                     + b"".join(_line(t) for t in GOOD[3:6]))
    src = [file_source(path)]
    unit = readers.Unit(0, 0, path.stat().st_size, None, path.stat().st_size)
    bad = BadRecords()
    assert list(iter_unit(src, unit, bad=bad, max_record_bytes=300)) == GOOD[:6]
    assert bad.count == 1 and bad.first.startswith(f"{path} line 4: longer than the 300-byte")


def test_cli_refuses_a_long_record_in_one_line_and_skips_it_with_skip_bad(tmp_path,
                                                                          capsys) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(_line(t) for t in GOOD[:12]) + _line("L" * 5000)
                     + b"".join(_line(t) for t in GOOD[12:]))
    args = ["prepare", "--input", str(path), "--context-length", "8", "--max-record-bytes",
            "4096", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "d.jsonl line 13" in err and "4,096-byte record cap" in err
    assert "--max-record-bytes" in err and "--skip-bad" in err
    assert main([*args, "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert "1 bad record skipped" in out
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["documents"]["read"] == len(GOOD) and meta["documents"]["skipped_records"] == 1
    assert meta["settings"]["max_record_bytes"] == 4096
    assert main(["prepare", "--input", str(path), "--max-record-bytes", "0", "--out",
                 str(tmp_path / "o2")]) == 2
    assert "--max-record-bytes must be a positive integer" in capsys.readouterr().err


# --- chat records ------------------------------------------------------------------------------


def _conv(i: int, answer: str = "") -> bytes:
    return (json.dumps({"prompt": f"question {i}?", "completion": answer or f"answer {i}."})
            + "\n").encode()


def test_chat_records_over_the_cap_are_bad_records(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(_conv(0) + _conv(1, "z" * 3000) + _conv(2))
    items = list(read_records([path], max_record_bytes=1000))
    assert [n for _, n, _ in items] == [1, 2, 3]
    assert "longer than the 1,000-byte record cap" in str(items[1][2])
    assert str(items[1][2]).startswith(f"{path}:2: ") and "--max-record-bytes" in str(items[1][2])
    with pytest.raises(DataError, match=r"c\.jsonl:2: longer than the 1,000-byte.*--skip-bad"):
        prepare_chat(tmp_path / "o", [path], tokenizer="char", context_length=64,
                     max_record_bytes=1000)
    data = prepare_chat(tmp_path / "o", [path], tokenizer="char", context_length=64,
                        max_record_bytes=1000, skip_bad=True)
    assert data.meta["chat"]["skipped"] == 1


def test_chat_length_is_checked_before_tokenizing(tmp_path, monkeypatch) -> None:
    import tinylm.data.chatdata as chatdata

    path = tmp_path / "c.jsonl"
    path.write_bytes(_conv(0) + _conv(1, "long answer " * 20_000) + _conv(2))
    rendered = []
    real = chatdata.render_with_mask

    def spy(tok, messages, *a, **kw):
        rendered.append(sum(len(m["content"]) for m in messages))
        return real(tok, messages, *a, **kw)
    monkeypatch.setattr(chatdata, "render_with_mask", spy)
    with pytest.raises(DataError, match=r"c\.jsonl:2: conversation has 240,0\d\d characters, "
                                        r"far more than context length \+ 1 = 65 tokens"):
        prepare_chat(tmp_path / "o", [path], tokenizer="char", context_length=64)
    assert max(rendered) < 100  # the long one never reached the tokenizer
    data = prepare_chat(tmp_path / "o", [path], tokenizer="char", context_length=64,
                        skip_bad=True)
    assert data.meta["chat"]["skipped"] == 1


def test_longest_token_bounds_the_tokens_of_any_text() -> None:
    texts = ["hello world, " * 50, "ünïcödé 日本語 " * 30, "    indented\n" * 40]
    bpe = BPETokenizer.train(texts, vocab_size=400)
    per = longest_token(bpe)
    assert per == max(len(t) for t in bpe.hf.get_vocab())
    for text in [*texts, "x" * 1000, "hello world, hello"]:
        assert len(bpe.encode(text)) * per >= len(text)
    assert longest_token(CharTokenizer("abc")) == 1


# --- memory: subprocesses ------------------------------------------------------------------------

_RUN = """
import re, resource, sys
from tinylm.cli import main
code = main(sys.argv[1:])
# VmHWM, not RUSAGE_SELF: Linux carries ru_maxrss across exec, so a child forked from a
# test run of a few GB would report the parent's size
own = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
peak = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(f"exit={code} peak_kb={peak}")
"""


def _prepare_in_subprocess(args: list[str]) -> tuple[int, float, str]:
    """Exit code, peak RSS in MB and output of ``tinylm ARGS`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    code, peak = (int(part.split("=")[1]) for part in last.split())
    return code, peak / 1024, proc.stdout + proc.stderr


def _write_huge_line_zst(path: Path, line_bytes: int) -> None:
    """GOOD records, one record of ``line_bytes`` bytes of text, GOOD records again,
    zstd-compressed as it is written (the file is a few hundred KB)."""
    block = b"a" * (1 << 20)
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as w:
        w.write(b"".join(_line(t) for t in GOOD[:12]))
        w.write(b'{"text": "')
        for _ in range(line_bytes >> 20):
            w.write(block)
        w.write(b'"}\n')
        w.write(b"".join(_line(t) for t in GOOD[12:]))


def test_a_compressed_2_gib_line_is_skipped_in_bounded_memory(tmp_path) -> None:
    # both passes read the line (4 GiB decompressed in all), 2 MiB at most at a time
    path = tmp_path / "huge.jsonl.zst"
    _write_huge_line_zst(path, 2 << 30)
    assert path.stat().st_size < 1 << 20
    out = tmp_path / "out"
    code, peak, text = _prepare_in_subprocess([
        "prepare", "--input", str(path), "--context-length", "8", "--workers", "1",
        "--skip-bad", "--no-progress", "--out", str(out)])
    assert code == 0 and peak < RSS_BOUND_MB, text
    assert "huge.jsonl.zst line 13: longer than the 16,777,216-byte record cap" in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["skipped_records"] == 1
    assert meta["documents"]["read"] == len(GOOD)
    assert f"({(2 << 30) + 13:,} bytes;" in meta["documents"]["first_skipped"]


@pytest.mark.parametrize("tokenizer", ["char", "given"])
def test_a_plain_100_mb_line_is_skipped_in_bounded_memory(tmp_path, tokenizer) -> None:
    # "given": a tokenizer file, so the workers' units read the file (readers.iter_unit)
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b"".join(_line(t) for t in GOOD[:12]) + b'{"text": "')
        for _ in range(100):
            f.write(b"b" * (1 << 20))
        f.write(b'"}\n' + b"".join(_line(t) for t in GOOD[12:]))
    args = ["prepare", "--input", str(path), "--context-length", "8", "--skip-bad",
            "--no-progress", "--out", str(tmp_path / "out")]
    if tokenizer == "given":
        CharTokenizer("".join(GOOD) + "\n").save(tmp_path / "tokenizer.json")
        args += ["--tokenizer", str(tmp_path / "tokenizer.json"), "--workers", "1"]
    code, peak, text = _prepare_in_subprocess(args)
    assert code == 0 and peak < RSS_BOUND_MB, text
    assert "1 bad record skipped" in text and "big.jsonl line 13" in text


def test_a_100_mb_chat_record_is_skipped_in_bounded_memory(tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    with open(path, "wb") as f:
        f.write(b"".join(_conv(i) for i in range(6)) + b'{"prompt": "hi", "completion": "')
        for _ in range(100):
            f.write(b"c" * (1 << 20))
        f.write(b'"}\n' + b"".join(_conv(i) for i in range(6, 12)))
    args = ["prepare", "--chat", str(path), "--context-length", "32", "--out",
            str(tmp_path / "out")]
    code, peak, text = _prepare_in_subprocess(args)
    assert code == 2 and peak < RSS_BOUND_MB, text
    assert "chat.jsonl:7: longer than the 16,777,216-byte record cap" in text
    code, peak, text = _prepare_in_subprocess([*args, "--skip-bad"])
    assert code == 0 and peak < RSS_BOUND_MB, text
    assert "skipped 1 bad record(s)" in text


# --- damaged compressed files ----------------------------------------------------------------


@pytest.mark.parametrize("name, damage", [("cut.jsonl.gz", "cut"), ("crc.jsonl.gz", "flip"),
                                          ("cut.txt.gz", "cut")])
def test_a_damaged_gzip_file_is_one_line_not_a_traceback(tmp_path, capsys, name, damage) -> None:
    import gzip

    data = b"".join(_line(f"{t} {os.urandom(8).hex()}") for t in GOOD * 40)
    packed = bytearray(gzip.compress(data))
    if damage == "cut":
        packed = packed[:len(packed) // 2]
    else:
        packed[len(packed) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(packed))
    assert main(["prepare", "--input", str(tmp_path / name), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{name} is not a complete gzip file (" in err and "cut short or damaged" in err
