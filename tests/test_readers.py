"""Input formats for prepare: JSONL (plain, gzip, zstd), Parquet (row groups, nulls, nested
fields, non-strings), a datasets save_to_disk folder, mixed folders and globs. Each gives
the token stream of its documents encoded one by one and joined by the separator; bad
records are refused or skipped with the first file and line/row named; documents go to
val whole; --dedup drops exact duplicates."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tinylm.cli import main
from tinylm.core.errors import DataError
from tinylm.data import load_prepared, prepare

EOT = "<|endoftext|>"
DOCS = [
    "The first document.\nIt has two lines.",
    "言語モデルは次のトークンを予測する。",
    "  leading spaces and a trailing newline\n",
    "short",
    "emoji 🌤️ and tabs\tand CRLF\r\n",
    "x" * 300 + " a long one " + "y " * 200,
] * 3
VAL = ["A held-out document for validation, long enough to hold a window or two of text. " * 3,
       "And a second one, also whole. " * 5]


def _write_jsonl(path, docs, compress=None) -> None:
    data = "".join(json.dumps({"id": i, "text": d}, ensure_ascii=i % 2 == 0) + "\n"
                   for i, d in enumerate(docs)).encode()
    if compress == "gzip":
        data = gzip.compress(data)
    elif compress == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def _write_parquet(path, docs, nested=False) -> None:
    if nested:
        table = pa.table({"meta": pa.array([{"body": {"text": d}} for d in docs])})
    else:
        table = pa.table({"n": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=4)  # several row groups


def _write_dataset(path, docs) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(
        str(path))


def _expected(tok, docs) -> list[int]:
    eot = tok.token_to_id(EOT)
    out: list[int] = []
    for i, d in enumerate(docs):
        out += ([eot] if i else []) + tok.encode(d)
    return out


def _prepare(tmp_path, inputs, name="out", **kw):
    val = tmp_path / "val.jsonl"
    if not val.exists():
        _write_jsonl(val, VAL)
    kw = {"special_tokens": [EOT], "context_length": 8, "progress": False,
          "val_files": [val], **kw}
    if kw.get("text_field", "text") != "text" and kw["val_files"] == [val]:
        kw["val_files"] = [tmp_path / "val.parquet"]
        _write_parquet(kw["val_files"][0], VAL, nested=True)
    return prepare(tmp_path / name, inputs, **kw)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "parquet-nested",
                                 "dataset"])
@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_each_format_gives_the_documents_joined_by_the_separator(fmt, tokenizer,
                                                                 tmp_path) -> None:
    if fmt.startswith("jsonl"):
        src = tmp_path / f"docs.{fmt}"
        _write_jsonl(src, DOCS, {"jsonl.gz": "gzip", "jsonl.zst": "zstd"}.get(fmt))
    elif fmt.startswith("parquet"):
        src = tmp_path / "docs.parquet"
        _write_parquet(src, DOCS, nested=fmt == "parquet-nested")
    else:
        src = tmp_path / "saved"
        _write_dataset(src, DOCS)
    field = "meta.body.text" if fmt == "parquet-nested" else "text"
    d = _prepare(tmp_path, [src], tokenizer=tokenizer, vocab_size=400, text_field=field)
    assert np.asarray(d.train).tolist() == _expected(d.tokenizer, DOCS)
    assert np.asarray(d.val).tolist() == _expected(d.tokenizer, VAL)
    assert d.meta["documents"] | {"first_skipped": None} == {
        "read": len(DOCS) + 2, "train": len(DOCS), "val": 2, "duplicates_removed": 0,
        "skipped_records": 0, "first_skipped": None}
    assert d.meta["split"] == "files"
    if tokenizer == "bpe":  # trained on the documents, whatever the format's reading pace
        assert d.vocab_size == 400 and d.meta["tokenizer"]["trained_on_chars"] > 2000


def test_mixed_folder_and_glob_in_sorted_order(tmp_path) -> None:
    folder = tmp_path / "mixed"
    (folder / "d").mkdir(parents=True)
    (folder / "a.txt").write_text(DOCS[0], encoding="utf-8")
    _write_jsonl(folder / "b.jsonl.gz", DOCS[1:3], "gzip")
    _write_parquet(folder / "c.parquet", DOCS[3:9])
    _write_dataset(folder / "d" / "saved", DOCS[9:12])
    (folder / "e.md").write_text(DOCS[12], encoding="utf-8")
    d = _prepare(tmp_path, [folder])
    assert np.asarray(d.train).tolist() == _expected(d.tokenizer, DOCS[:13])
    assert [i["format"] for i in d.meta["inputs"]] == [
        "text", "jsonl", "parquet", "arrow", "text", "jsonl"]
    g = _prepare(tmp_path, [str(folder / "*.parquet"), str(folder / "[ab].*")], name="g")
    assert np.asarray(g.train).tolist() == _expected(g.tokenizer, DOCS[3:9] + DOCS[:3])


def test_bad_jsonl_records_are_refused_or_skipped_with_file_and_line(tmp_path) -> None:
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": DOCS[0]}), json.dumps({"title": "no text"}), "{not json",
             json.dumps({"text": 42}), "", json.dumps({"text": None}), json.dumps([1]),
             json.dumps({"text": DOCS[1]})]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        _prepare(tmp_path, [src])
    msg = str(info.value)
    assert "5 record(s) have no usable text" in msg and f"the first: {src} line 2: field " \
        f"'text' is missing" in msg and "--skip-bad" in msg
    assert "1 not valid JSON" in msg and "1 field 'text' is not a string" in msg
    assert not (tmp_path / "out").exists()
    d = _prepare(tmp_path, [src], skip_bad=True)
    assert np.asarray(d.train).tolist() == _expected(d.tokenizer, DOCS[:2])
    assert d.meta["documents"]["skipped_records"] == 5
    assert d.meta["documents"]["first_skipped"].startswith(f"{src} line 2")


def test_bad_parquet_rows_named_by_row(tmp_path) -> None:
    src = tmp_path / "p.parquet"
    docs = [DOCS[0], DOCS[1], None, DOCS[2], DOCS[3], None, DOCS[4]]
    pq.write_table(pa.table({"text": docs, "n": list(range(7))}), src, row_group_size=3)
    with pytest.raises(DataError, match=rf"2 record\(s\).*the first: {src} row 2: field "
                                        r"'text' is null"):
        _prepare(tmp_path, [src])
    d = _prepare(tmp_path, [src], skip_bad=True)
    assert np.asarray(d.train).tolist() == _expected(d.tokenizer, [x for x in docs if x])
    val = tmp_path / "val.jsonl"
    with pytest.raises(DataError, match=rf"\(7 field 'n' is not a string.*{src} row 0: "
                                        r"field 'n' is not a string \(int64\)"):
        _prepare(tmp_path, [src], name="n", text_field="n", val_files=[val], skip_bad=False)
    with pytest.raises(DataError, match=rf"{src} row 0: field 'body' is missing"):
        _prepare(tmp_path, [src], name="m", text_field="body", val_files=[val])


def test_val_fraction_takes_whole_documents_spread_evenly(tmp_path) -> None:
    src = tmp_path / "many.jsonl"
    docs = [f"document number {i} " * (5 + i % 4) for i in range(40)]
    _write_jsonl(src, docs)
    d = prepare(tmp_path / "out", [src], special_tokens=[EOT], val_fraction=0.1,
                context_length=8, progress=False)
    eot = d.tokenizer.token_to_id(EOT)

    def split_docs(tokens) -> list[str]:
        ids = np.asarray(tokens).tolist()
        parts, cur = [], []
        for t in ids + [eot]:
            if t == eot:
                parts.append(d.tokenizer.decode(cur))
                cur = []
            else:
                cur.append(t)
        return parts

    train, val = split_docs(d.train), split_docs(d.val)
    assert len(val) == 4 and len(train) == 36 and d.meta["split"] == "documents"
    assert sorted(train + val) == sorted(docs)  # whole documents, none cut or lost
    where = [docs.index(v) for v in val]
    assert where == sorted(where) and where[-1] - where[0] >= 25  # in order, spread out
    assert [x for x in docs if x not in val] == train


def test_dedup_drops_exact_duplicates(tmp_path) -> None:
    src = tmp_path / "dups.jsonl"
    _write_jsonl(src, DOCS)  # DOCS is 6 documents three times
    d = _prepare(tmp_path, [src], dedup=True)
    assert np.asarray(d.train).tolist() == _expected(d.tokenizer, DOCS[:6])
    assert d.meta["documents"]["duplicates_removed"] == 12


def test_doc_separator_choices(tmp_path) -> None:
    src = tmp_path / "d.jsonl"
    _write_jsonl(src, [*DOCS[:3], DOCS[5]])  # the last one goes to val
    text = prepare(tmp_path / "t", [src], doc_separator="\n\n", context_length=8,
                   val_fraction=0.25, progress=False)
    assert text.tokenizer.decode(text.train) == "\n\n".join(DOCS[:3])
    assert text.tokenizer.decode(text.val) == DOCS[5]
    none = prepare(tmp_path / "n", [src], doc_separator="", context_length=8,
                   val_fraction=0.25, progress=False)
    assert none.tokenizer.decode(none.train) == "".join(DOCS[:3])
    with pytest.raises(DataError, match="not a special token of this tokenizer"):
        prepare(tmp_path / "x", [src], doc_separator="<|nope|>", context_length=8, progress=False)


def test_cli_reads_jsonl_and_parquet(tmp_path, capsys) -> None:
    _write_jsonl(tmp_path / "a.jsonl.zst", DOCS, "zstd")
    _write_parquet(tmp_path / "b.parquet", DOCS)
    code = main(["prepare", "--input", str(tmp_path / "a.jsonl.zst"), "--input",
                 str(tmp_path / "b.parquet"), "--special-token", EOT, "--context-length", "8",
                 "--shard-tokens", "50", "--dedup", "--workers", "2", "--out",
                 str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "from 5 training documents and 1 validation document, 30 duplicates removed" in out
    assert "2 worker(s)" in out
    d = load_prepared(tmp_path / "out")
    assert len(d.meta["shards"]["train"]) > 1 and "{" not in d.tokenizer.decode(d.train)


def test_non_utf8_file_names_work_and_errors_name_them(tmp_path, capsys) -> None:
    folder = os.fsencode(tmp_path / "in")
    os.mkdir(folder)
    name = os.path.join(folder, b"caf\xe9.txt")
    with open(name, "wb") as f:
        f.write(DOCS[0].encode() * 20)
    for given in (name, folder):  # directly and inside a folder, as sys.argv has them
        out = tmp_path / ("o1" if given is name else "o2")
        assert main(["prepare", "--input", os.fsdecode(given), "--context-length", "8",
                     "--out", str(out)]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["inputs"][0]["name"].endswith("caf\\xe9.txt")
        assert given is folder or "caf\\xe9.txt" in capsys.readouterr().out
    with open(name, "ab") as f:
        f.write(b"\xff")
    capsys.readouterr()
    assert main(["prepare", "--input", os.fsdecode(folder), "--context-length", "8", "--out",
                 str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.isascii(), err
    assert "caf\\xe9.txt is not UTF-8 text" in err
    assert not (tmp_path / "o3").exists()


def test_units_cover_a_jsonl_file_in_whole_lines(tmp_path) -> None:
    from tinylm.data.readers import BadRecords, file_source, iter_unit, iter_units

    texts = [f"doc {i} " + "x" * (i * 37 % 300) for i in range(60)] + ["y" * 5000, "last"]
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": t}) for t in texts]
    lines[49] = '{"text": null}'  # a bad record far into the file: line 50
    body = "\n".join(lines)  # no final line break
    path.write_text(body.replace('"doc 7', '"doc\\u00a07'), encoding="utf-8")
    src = file_source(path)
    units = list(iter_units([src], unit_bytes=700))
    assert units[0].start == 0 and units[-1].stop == path.stat().st_size > 700 * 8
    assert all(a.stop == b.start for a, b in zip(units, units[1:], strict=False))
    raw = path.read_bytes()
    assert all(raw[u.stop - 1:u.stop] == b"\n" for u in units[:-1])  # whole lines
    assert all(u.first is None for u in units)  # planning does not count lines
    got, bad = [], BadRecords()
    for u in units:
        got += list(iter_unit([src], u, bad=bad))
    want = [t.replace("doc 7", "doc\u00a07") for i, t in enumerate(texts) if i != 49]
    assert got == want and bad.count == 1
    assert bad.first.endswith("d.jsonl line 50: field 'text' is null")  # counted when shown
    late = next(u for u in units if u.start > raw.index(b"null"))
    bad = BadRecords()
    list(iter_unit([src], late, bad=bad))
    assert bad.count == 0


def test_units_get_smaller_near_the_end(tmp_path) -> None:
    from tinylm.data.readers import MIN_UNIT_BYTES, file_source, iter_units

    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "z" * 1000}) + "\n"
    path.write_text(line * (40 * MIN_UNIT_BYTES // len(line)), encoding="utf-8")
    units = list(iter_units([file_source(path)], unit_bytes=4 * MIN_UNIT_BYTES, parts=4))
    sizes = [u.size for u in units]
    assert sum(sizes) == path.stat().st_size
    assert max(sizes) <= 4 * MIN_UNIT_BYTES + len(line)
    assert sizes[0] > 3 * MIN_UNIT_BYTES and sizes[-2] < 1.1 * MIN_UNIT_BYTES
    assert all(a >= b for a, b in zip(sizes[:-2], sizes[1:-1], strict=True))  # shrinking


FAST_CASES = [
    b'{"text": "plain"}', b'{"text": "\\u65e5\\u672c", "id": 3}', b'{"text": "tab\\tend"}\r',
    b'{"text": "trailing spaces"}  \t', b'  {"text": "indented"}', b'', b'   ', b'\r',
    b'{"text": null}', b'{"text": 5}', b'{"other": "x"}', b'{"text": "a", "text": 7}',
    b'{"text": "x"} {"text": "y"}', b'{"text": "x"} junk', b'{"text": "unterminated}',
    b'["text"]', b'"text"', b'{"text": "lone \\ud800 surrogate"}',
    b'{"text": "pair \\ud83c\\udf24"}', b'{"text": "caf\xc3\xa9"}', b'{"text": "bad \xff"}',
    '\ufeff{"text": "bom"}'.encode(), '{"text": "utf16"}'.encode("utf-16-le"),
    b'{"meta": {"body": "nested"}}', b'{"text": "NaN", "n": NaN}', b'{"text": "x"}\x0b',
    b'{"text": "\x01control"}', b'{' * 3000 + b'}' * 3000,
]


@pytest.mark.parametrize("line", FAST_CASES)
@pytest.mark.parametrize("field", ["text", "meta.body"])
def test_fast_jsonl_path_agrees_with_json_loads(line, field) -> None:
    """json's C scanner, called directly, either gives what json.loads and the record
    checks give or hands the line to them (blank, indented, bad or odd lines)."""
    from tinylm.data.readers import _SLOW, BadRecords, _fast_text, _record

    path = field.split(".")
    fast = _fast_text(line, path)
    bad = BadRecords()
    try:
        slow = _record(line, "f line 1", path, "replace", bad)
    except DataError as exc:
        slow = exc
    if fast is not _SLOW:
        assert fast == slow and bad.count == 0 and isinstance(fast, str)
    if line in (b'{"text": "plain"}', b'{"text": "tab\\tend"}\r', b'{"text": "caf\xc3\xa9"}'):
        assert (fast is _SLOW) == (field != "text")  # the common case takes the fast path
