"""Sharded prepared data: TokenShards reads like the concatenation, tiny --shard-tokens gives
the same tokens and batches as one shard, 1 and 3 workers write identical files, training
resumes exactly across shard boundaries, old single-file folders load, and a bad meta.json
or an id past the vocabulary is a one-line DataError."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tinylm.data.encoding as encoding_mod
import tinylm.data.pool as pool_mod
import tinylm.data.scan as scan_mod
from tinylm.cli import main
from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.core.errors import DataError
from tinylm.core.model import GPT
from tinylm.data import get_batch, iter_windows, load_prepared, prepare
from tinylm.data.corpora import load_corpus
from tinylm.data.shards import TokenShards
from tinylm.training import train
from tinylm.use.evaluation import evaluate

EOT = "<|endoftext|>"


def _docs(n: int = 60) -> list[str]:
    text = load_corpus("python-docs")[:120_000]
    size = len(text) // n
    return [text[i * size:(i + 1) * size] + ("日本語\n" if i % 7 == 0 else "") for i in range(n)]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()), encoding="utf-8")
    return path


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".bin"}


def test_token_shards_index_like_the_concatenation() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, n).astype(np.uint16) for n in (7, 1, 30, 0, 12)]
    whole = np.concatenate(parts)
    ts = TokenShards(parts)
    assert len(ts) == whole.size == ts.shape[0] and ts.dtype == np.uint16
    assert np.array_equal(np.asarray(ts), whole) and ts.max() == whole.max()
    for i in [0, 6, 7, 8, 37, 49, -1, -50]:
        assert ts[i] == whole[i]
    for s in [slice(0, 50), slice(5, 9), slice(6, 39), slice(40, 10), slice(3, 45, 4),
              slice(-9, None)]:
        assert np.array_equal(ts[s], whole[s]), s
    idx = rng.integers(0, whole.size, (4, 9))
    assert np.array_equal(ts[idx], whole[idx])
    with pytest.raises(IndexError):
        ts[50]
    with pytest.raises(IndexError):
        ts[np.array([0, 50])]


def test_tiny_shards_same_tokens_batches_and_windows_as_one(jsonl, tmp_path) -> None:
    one = prepare(tmp_path / "one", [jsonl], special_tokens=[EOT], context_length=16,
                  progress=False)
    many = prepare(tmp_path / "many", [jsonl], special_tokens=[EOT], context_length=16,
                   shard_tokens=997, progress=False)
    assert isinstance(one.train, np.memmap) and isinstance(many.train, TokenShards)
    n_shards = len(many.meta["shards"]["train"])
    assert n_shards == -(-len(one.train) // 997) > 50
    assert all(e["tokens"] <= 997 for e in many.meta["shards"]["train"])
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(getattr(one, split)), np.asarray(getattr(many, split)))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(20):  # windows run across shard boundaries like through one file
        x1, y1 = get_batch(one.train, 8, 64, g1)
        x2, y2 = get_batch(many.train, 8, 64, g2)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    for a, b in zip(iter_windows(one.val, 50, 4), iter_windows(many.val, 50, 4), strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=one.vocab_size, n_layer=1, n_head=2, n_embd=16,
                            context_length=32))
    assert evaluate(model, many.val).loss == evaluate(model, one.val).loss  # eval reads shards


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_one_and_three_workers_write_identical_files(jsonl, tmp_path, monkeypatch,
                                                     tokenizer) -> None:
    monkeypatch.setattr(encoding_mod, "TASK_CHARS", 7_000)  # many tasks in flight
    monkeypatch.setattr(encoding_mod, "PIECE_CHARS", 900)  # long documents cut in pieces
    kw = dict(tokenizer=tokenizer, vocab_size=400, special_tokens=[EOT], context_length=16,
              shard_tokens=5_000, progress=False)
    d1 = prepare(tmp_path / "w1", [jsonl], workers=1, **kw)
    d3 = prepare(tmp_path / "w3", [jsonl], workers=3, **kw)
    assert d1.meta["workers"] == 1 and d3.meta["workers"] == 3
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3")
    assert len(_files(tmp_path / "w1")) > 4
    # ... and both equal encoding each document on its own, joined by the separator.
    eot = d1.tokenizer.token_to_id(EOT)
    train = np.asarray(d1.train).tolist()
    docs = [d1.tokenizer.encode(t) for t in _docs()]
    val_docs = d1.meta["documents"]["val"]
    assert val_docs == 6 and d1.meta["documents"]["train"] == 54
    joined = [[*ids, eot] for ids in docs]
    assert sum(len(j) for j in joined) - 2 == len(train) + len(d1.val)
    assert train[-1] != eot and train.count(eot) == 53


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_workers_reading_units_write_what_one_process_writes(jsonl, tmp_path, monkeypatch,
                                                             tokenizer) -> None:
    """A given tokenizer and JSONL/Parquet inputs are read in units (both passes) by any
    number of workers, one included: 1 and 3 workers write what the serial reading path
    writes (units switched off), bad records, splits, counts and sha256s included. A
    Parquet file without nulls is counted from its metadata in pass 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tinylm.data.readers as readers_mod

    docs = _docs(40)
    mixed = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"text": d}) for d in docs[:20]]
    lines[5], lines[9] = '{"text": null}', ""  # a bad record and a blank line
    mixed.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": [None, *docs[20:30]]}), tmp_path / "more.parquet",
                   row_group_size=3)
    pq.write_table(pa.table({"text": docs[30:]}), tmp_path / "clean.parquet",
                   row_group_size=2)
    prepared = prepare(tmp_path / "tok", [jsonl], tokenizer=tokenizer, vocab_size=400,
                       special_tokens=[EOT], context_length=16, progress=False)
    tok = tmp_path / "tok" / "tokenizer.json"
    monkeypatch.setattr(readers_mod, "UNIT_BYTES", 3_000)  # many units, lines cut across
    monkeypatch.setattr(encoding_mod, "PIECE_CHARS", 900)
    scans, from_meta = [], []
    monkeypatch.setattr(scan_mod, "scan_units", lambda *a, f=scan_mod.scan_units:
                        scans.append(1) or f(*a))
    monkeypatch.setattr(readers_mod, "_rows_without_nulls", lambda *a,
                        f=readers_mod._rows_without_nulls: from_meta.append(f(*a))
                        or from_meta[-1])
    for extra in ({}, {"val_files": [tmp_path / "more.parquet"]}):
        inputs = [mixed, tmp_path / "clean.parquet"] + ([] if extra else
                                                        [tmp_path / "more.parquet"])
        kw = dict(tokenizer=tok, context_length=16, shard_tokens=4_000, skip_bad=True,
                  progress=False, force=True, **extra)
        with monkeypatch.context() as serial:
            serial.setattr(scan_mod, "units_apply", lambda sources: False)
            ref = prepare(tmp_path / "ref", inputs, workers=1, **kw)
        d1 = prepare(tmp_path / "w1", inputs, workers=1, **kw)
        d3 = prepare(tmp_path / "w3", inputs, workers=3, **kw)
        assert len(_files(tmp_path / "ref")) > 3
        for d, folder in ((d1, "w1"), (d3, "w3")):
            assert _files(tmp_path / folder) == _files(tmp_path / "ref")
            for key in ("documents", "input_chars", "inputs"):  # inputs: the sha256s
                assert d.meta[key] == ref.meta[key], key
        assert d3.meta["documents"]["first_skipped"].endswith(
            "mixed.jsonl line 6: field 'text' is null")
    assert len(scans) == 4 and prepared.vocab_size > 0
    assert any(n is not None for n in from_meta) and None in from_meta


def test_parquet_scanned_by_metadata_alone_needs_no_pool(tmp_path, monkeypatch) -> None:
    """Clean Parquet inputs (no nulls) are scanned in the main process from their
    metadata, pass 2 still by the workers; the files equal the serial reader's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(30)
    for k in range(2):
        pq.write_table(pa.table({"text": docs[k * 15:(k + 1) * 15]}),
                       tmp_path / f"clean{k}.parquet", row_group_size=2)
    inputs = [tmp_path / "clean0.parquet", tmp_path / "clean1.parquet"]
    prepare(tmp_path / "tok", inputs, tokenizer="bpe", vocab_size=400, special_tokens=[EOT],
            context_length=16, progress=False)
    kw = dict(tokenizer=tmp_path / "tok" / "tokenizer.json", context_length=16,
              shard_tokens=3_000, progress=False)
    with monkeypatch.context() as serial:
        serial.setattr(scan_mod, "units_apply", lambda sources: False)
        ref = prepare(tmp_path / "ref", inputs, workers=1, **kw)
    pools = []
    monkeypatch.setattr(pool_mod, "_pooled", lambda *a, f=pool_mod._pooled:
                        pools.append(a[1].__name__) or f(*a))
    d3 = prepare(tmp_path / "w3", inputs, workers=3, **kw)
    assert pools == ["encode_unit"]  # no pool for the scan
    assert _files(tmp_path / "w3") == _files(tmp_path / "ref")
    assert d3.meta["documents"] == ref.meta["documents"] and d3.meta["inputs"] == ref.meta[
        "inputs"] and d3.meta["input_chars"] == ref.meta["input_chars"]


def test_parquet_counted_from_metadata_must_match_its_rows(tmp_path, monkeypatch) -> None:
    """If a Parquet file's statistics undercount its nulls, pass 2 finds fewer documents
    than pass 1 counted: a one-line DataError, nothing written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tinylm.data.readers as readers_mod

    docs = _docs(12)
    path = tmp_path / "lies.parquet"
    pq.write_table(pa.table({"text": [*docs[:5], None, *docs[5:]]}), path)
    prepare(tmp_path / "tok", [path], tokenizer="char", context_length=16, skip_bad=True,
            special_tokens=[EOT], progress=False)
    monkeypatch.setattr(readers_mod, "_rows_without_nulls",
                        lambda src, p, groups=None: 13)  # "no nulls in 13 rows"
    with pytest.raises(DataError, match="12 documents read where the first pass counted 13"):
        prepare(tmp_path / "out", [path], tokenizer=tmp_path / "tok" / "tokenizer.json",
                context_length=16, progress=False)
    assert not (tmp_path / "out").exists()


def test_training_resumes_exactly_across_shard_boundaries(tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(load_corpus("python-docs")[:20_000], encoding="utf-8")
    one = tmp_path / "one"
    many = tmp_path / "many"
    prepare(one, [text], context_length=16, progress=False)
    prepare(many, [text], context_length=16, shard_tokens=211, progress=False)
    assert len(load_prepared(many).meta["shards"]["train"]) > 80
    model = ModelConfig(n_layer=1, n_head=2, n_embd=16, context_length=16, dropout=0.0)
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, max_steps=6, eval_every=3,
                      eval_windows=2, save_every=3, log_every=1, seed=5, device="cpu")
    train(model, cfg, one, tmp_path / "ref", progress=False)

    def stop(step: int) -> None:
        if step == 4:  # the checkpoint at 3 is kept
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        train(model, cfg, many, tmp_path / "run", progress=False, on_step=stop)
    train(model, cfg, many, tmp_path / "run", resume=True, progress=False)
    ref = load_file(str(tmp_path / "ref" / "latest" / "model.safetensors"))
    got = load_file(str(tmp_path / "run" / "latest" / "model.safetensors"))
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def _legacy(folder) -> None:
    """Rewrite a prepared folder in format 1: one train.bin and val.bin, no index."""
    meta = json.loads((folder / "meta.json").read_text())
    for split in ("train", "val"):
        blobs = [(folder / e["file"]).read_bytes() for e in meta["shards"][split]]
        for e in meta["shards"][split]:
            (folder / e["file"]).unlink()
        (folder / f"{split}.bin").write_bytes(b"".join(blobs))
    for key in ("shards", "max_token_id", "documents", "shard_tokens"):
        del meta[key]
    meta["version"] = 1
    (folder / "meta.json").write_text(json.dumps(meta))


def test_old_single_file_folders_still_load(jsonl, tmp_path) -> None:
    d = prepare(tmp_path / "d", [jsonl], special_tokens=[EOT], shard_tokens=3000,
                context_length=16, progress=False)
    train, val = np.asarray(d.train), np.asarray(d.val)
    _legacy(tmp_path / "d")
    old = load_prepared(tmp_path / "d")
    assert isinstance(old.train, np.memmap)
    assert np.array_equal(old.train, train) and np.array_equal(old.val, val)
    # Re-preparing into it (same settings) replaces the old files with shards.
    again = prepare(tmp_path / "d", [jsonl], special_tokens=[EOT], shard_tokens=3000,
                    context_length=16, progress=False, force=True)
    assert not (tmp_path / "d" / "train.bin").exists()
    assert np.array_equal(np.asarray(again.train), train)


def _meta_edit(folder, change) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case", ["deep", "not_object", "uint8", "int16", "bad_shard",
                                  "traversal", "sum", "max_id", "legacy_max_id", "huge"])
def test_bad_meta_or_ids_is_a_one_line_error(case, tmp_path, capsys) -> None:
    out = tmp_path / "d"
    prepare(out, context_length=16, progress=False)
    meta_path = out / "meta.json"
    expect = {
        "deep": "nested too deeply", "not_object": "not a tinylm prepared-data meta.json",
        "uint8": "dtype 'uint8'", "int16": "dtype 'int16'", "bad_shard": "not a count",
        "traversal": "bad train shard", "sum": "do not add up", "max_id": "token ids up to",
        "legacy_max_id": "token ids up to 9999", "huge": "over 16 MB",
    }[case]
    if case == "deep":
        meta_path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "not_object":
        meta_path.write_text("[1, 2]")
    elif case in ("uint8", "int16"):
        _meta_edit(out, lambda m: m.update(dtype=case))
    elif case == "bad_shard":
        _meta_edit(out, lambda m: m["shards"]["train"][0].update(tokens="many"))
    elif case == "traversal":
        _meta_edit(out, lambda m: m["shards"]["train"][0].update(file="../../etc/passwd"))
    elif case == "sum":
        _meta_edit(out, lambda m: m.update(train_tokens=m["train_tokens"] + 1))
    elif case == "max_id":
        _meta_edit(out, lambda m: m.update(max_token_id=m["vocab_size"]))
    elif case == "legacy_max_id":
        _legacy(out)
        blob = bytearray((out / "train.bin").read_bytes())
        blob[10:12] = np.array([9999], dtype=np.uint16).tobytes()
        (out / "train.bin").write_bytes(bytes(blob))
    elif case == "huge":
        meta_path.write_text(json.dumps({"pad": "x" * (17 << 20)}))
    with pytest.raises(DataError, match=expect):
        load_prepared(out)
    # The CLI says it in one line, exit 2 (eval reads the same loader).
    capsys.readouterr()
    assert main(["train", "--data", str(out), "--out", str(tmp_path / "run"),
                 "--max-steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect.split("'")[0] in err, err
    assert not (tmp_path / "run").exists()


def test_shard_writer_syncs_behind_and_reports_a_failed_sync(tmp_path, monkeypatch) -> None:
    import os

    import tinylm.data.shards as shards_mod

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)
    monkeypatch.setattr(shards_mod, "SYNC_BYTES", 1000)
    monkeypatch.setattr(shards_mod.os, "fsync", fsync)
    writer = shards_mod.ShardWriter(tmp_path, "train", np.uint16, shard_tokens=2000)
    ids = np.arange(5000, dtype=np.uint16)
    for k in range(0, 5000, 700):
        writer.write(ids[k:k + 700])
    entries = writer.close()
    assert [e["tokens"] for e in entries] == [2000, 2000, 1000]
    assert synced and all(0 < n <= 4000 for n in synced)  # while writing, in the background
    got = np.concatenate([np.fromfile(tmp_path / e["file"], np.uint16) for e in entries])
    assert np.array_equal(got, ids)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(shards_mod.os, "fsync", broken)
    writer = shards_mod.ShardWriter(tmp_path, "val", np.uint16, shard_tokens=2000)
    writer.write(ids)
    with pytest.raises(OSError, match="Input/output"):
        writer.close()


@pytest.mark.parametrize("kernel", ["copy_file_range", "exdev", "missing"])
def test_write_from_a_part_file_across_shards(tmp_path, monkeypatch, kernel) -> None:
    import errno
    import os

    import tinylm.data.shards as shards_mod

    if kernel == "exdev":  # another file system: read and write instead
        def refuse(*a, **k):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(shards_mod.os, "copy_file_range", refuse, raising=False)
    elif kernel == "missing":  # not Linux
        monkeypatch.delattr(shards_mod.os, "copy_file_range", raising=False)
    ids = np.arange(7000, dtype=np.uint16) * 7
    part = tmp_path / "part.bin"
    part.write_bytes(ids.tobytes())
    writer = shards_mod.ShardWriter(tmp_path, "train", np.uint16, shard_tokens=1500)
    writer.write(ids[:100])
    writer.write_from(part, 200, 5000)  # ids 100..5099, from byte 200
    writer.write(ids[5100:])
    entries = writer.close()
    assert [e["tokens"] for e in entries] == [1500] * 4 + [1000]
    got = np.concatenate([np.fromfile(tmp_path / e["file"], np.uint16) for e in entries])
    assert np.array_equal(got, ids)
    with pytest.raises(OSError, match="ended"):  # a part shorter than it claims
        w = shards_mod.ShardWriter(tmp_path, "val", np.uint16, shard_tokens=1500)
        w.write_from(part, 13000, 1000)
    assert os.path.exists(part)
