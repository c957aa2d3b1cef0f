"""prepare(): shards equal a one-shot encoding, streaming in flat memory, atomic writes,
bad input; get_batch/iter_windows: shifted targets, exact resume, exact coverage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinylm.data.encoding as encoding_mod
import tinylm.data.pipeline as pipeline_mod
from tinylm.core.errors import DataError
from tinylm.data import (
    dtype_for_vocab,
    get_batch,
    iter_windows,
    load_prepared,
    prepare,
)
from tinylm.data.corpora import load_corpus
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer

JAPANESE = "言語モデルは次のトークンを予測する。注意機構🌤️\n"


def _all_tokens(d) -> np.ndarray:
    return np.concatenate([np.asarray(d.train), np.asarray(d.val)])


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- prepare -------------------------------------------------------------------------------


def test_prepare_builtin_corpus_matches_one_shot_char_encoding(tmp_path) -> None:
    d = prepare(tmp_path / "py", progress=False)
    text = load_corpus("python-docs")
    assert isinstance(d.tokenizer, CharTokenizer)
    assert _all_tokens(d).tolist() == d.tokenizer.encode(text)
    assert d.train.dtype == np.uint16 and isinstance(d.train, np.memmap)
    meta = json.loads((tmp_path / "py" / "meta.json").read_text())
    assert meta["source"] == "corpus:python-docs" and meta["tokenizer"]["kind"] == "char"
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)
    assert meta["val_tokens"] == round(len(text) * 0.1)
    assert meta["sha256"] == hashlib.sha256(
        hashlib.sha256(text.encode()).hexdigest().encode()).hexdigest()
    assert sorted(p.name for p in (tmp_path / "py").iterdir()) == [
        "meta.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]
    assert meta["split"] == "tokens" and meta["documents"]["read"] == 1  # one document


def test_bpe_streaming_in_small_pieces_equals_one_shot(tmp_path, monkeypatch) -> None:
    # Whitespace runs, CRLF, tabs, contractions and Japanese at every kind of boundary.
    parts = load_corpus("python-docs")[:150_000].split("\n")
    text = "".join(p + ("\r\n" if i % 7 == 0 else "\n  \n" if i % 5 == 0 else "\n")
                   + (JAPANESE if i % 11 == 0 else "") for i, p in enumerate(parts))
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8", newline="")
    monkeypatch.setattr(encoding_mod, "PIECE_CHARS", 997)
    monkeypatch.setattr(encoding_mod, "TASK_CHARS", 5000)
    d = prepare(tmp_path / "out", [src], tokenizer="bpe", vocab_size=400, chunk_bytes=4099,
                progress=False)
    assert d.tokenizer.kind == "bpe" and d.vocab_size == 400
    assert _all_tokens(d).tolist() == d.tokenizer.encode(text)  # one call, whole text
    assert d.tokenizer.decode(_all_tokens(d)) == text
    # An existing tokenizer (by path) gives the same shards.
    again = prepare(tmp_path / "again", [src], tokenizer=tmp_path / "out" / "tokenizer.json",
                    progress=False)
    assert again.tokenizer.kind == "bpe"
    assert np.array_equal(_all_tokens(again), _all_tokens(d))


def test_shard_dtype_follows_vocab_size(tmp_path) -> None:
    assert dtype_for_vocab(256) == np.uint16 and dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    # 70,000 distinct CJK code points: a char vocabulary that needs uint32.
    chars = "".join(map(chr, range(0x20000, 0x20000 + 70_000)))
    src = tmp_path / "cjk.txt"
    src.write_text(chars + chars[::-1], encoding="utf-8")
    d = prepare(tmp_path / "out", [src], progress=False)
    # prepare adds the standard special tokens (end of text, chat roles) after the chars.
    assert d.vocab_size == 70_000 + len(STANDARD_SPECIALS) and d.train.dtype == np.uint32
    ids = [d.tokenizer.token_to_id(c) for c in chars]
    assert _all_tokens(d).tolist() == ids + ids[::-1]


def test_folder_input_sorted_one_document_per_file(tmp_path) -> None:
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("second file" * 40)
    (tmp_path / "in" / "a.txt").write_text("first file\n" * 40)
    (tmp_path / "in" / "sub" / "c.md").write_text("third 日本" * 40)
    (tmp_path / "in" / ".hidden").write_text("\x00binary")
    d = prepare(tmp_path / "out", [tmp_path / "in"], context_length=8, progress=False)
    # prepare gives the char vocabulary an end-of-text token: it separates documents.
    eot = "<|endoftext|>"
    expected = "first file\n" * 40 + eot + "second file" * 40 + eot + "third 日本" * 40
    assert d.tokenizer.decode(_all_tokens(d)) == expected
    assert d.meta["documents"]["read"] == 3 and d.meta["doc_separator"] == [
        d.tokenizer.eos_id]
    assert [i["name"].split("/")[-1] for i in d.meta["inputs"]] == ["a.txt", "b.txt", "c.md"]
    only_md = prepare(tmp_path / "md", [tmp_path / "in"], glob="*.md", context_length=8,
                      progress=False)
    assert only_md.tokenizer.decode(_all_tokens(only_md)) == "third 日本" * 40
    # An output folder inside the input folder is never read back as input.
    for _ in range(2):
        inside = prepare(tmp_path / "in" / "out", [tmp_path / "in"], context_length=8,
                         progress=False)
        assert inside.tokenizer.decode(_all_tokens(inside)) == expected


def test_non_utf8_names_file_and_offset_across_chunks(tmp_path) -> None:
    good = ("ab日本" * 2000).encode()  # 3-byte characters straddle the 1000-byte chunks
    src = tmp_path / "bad.txt"
    src.write_bytes(good + b"\xff tail")
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "out", [src], chunk_bytes=1000, progress=False)
    assert f"{src} is not UTF-8 text: byte 0xff at byte offset {len(good)}" in str(info.value)
    assert not (tmp_path / "out").exists()
    d = prepare(tmp_path / "out", [src], errors="replace", chunk_bytes=1000, progress=False)
    assert d.tokenizer.decode(_all_tokens(d)) == good.decode() + "\ufffd tail"


def test_nul_byte_is_binary(tmp_path) -> None:
    src = tmp_path / "x.bin"
    src.write_bytes(b"hello world " * 100 + b"\x00\x01\x02")
    with pytest.raises(DataError, match=r"looks binary: NUL byte at byte offset 1200"):
        prepare(tmp_path / "out", [src], progress=False)


def test_failed_or_interrupted_run_leaves_folder_untouched(tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    prepare(out, progress=False)
    before = _snapshot(out)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="too short"):
        prepare(out, [short], force=True, progress=False)
    assert _snapshot(out) == before

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline_mod, "_fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, tokenizer="bpe", vocab_size=300, force=True, progress=False)
    assert _snapshot(out) == before  # no temporary files left either
    load_prepared(out)


def test_load_prepared_rejects_missing_incomplete_corrupt(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_prepared(tmp_path / "nope")
    out = tmp_path / "out"
    prepare(out, progress=False)
    train = (out / "train-00000.bin").read_bytes()
    (out / "train-00000.bin").write_bytes(train[:-2])
    with pytest.raises(DataError, match="train-00000.bin has"):
        load_prepared(out)
    (out / "train-00000.bin").write_bytes(train)
    (out / "meta.json").write_text("{broken")
    with pytest.raises(DataError, match="unreadable meta.json"):
        load_prepared(out)
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match="no meta.json"):
        load_prepared(out)


#: Size of the generated corpus of the flat-memory test. The criterion is 1 GB
#: (TINYLM_PREPARE_TEST_MB=1024, about 2 minutes on a busy 2-core machine); the suite runs
#: 256 MB to stay within its time budget. The bound on memory growth is the same for both.
BIG_MB = int(os.environ.get("TINYLM_PREPARE_TEST_MB", "256"))


@pytest.mark.slow
def test_big_jsonl_corpus_prepares_in_flat_memory(tmp_path) -> None:
    block = load_corpus("python-docs")[:400_000] + JAPANESE * 50
    line = (json.dumps({"text": block}, ensure_ascii=False) + "\n").encode()
    copies = BIG_MB * 1_000_000 // len(line) + 1
    src = tmp_path / "big.jsonl"
    with open(src, "wb") as f:  # written as a stream: the test holds one line at a time
        for _ in range(copies):
            f.write(line)
    # Peak memory of prepare and its worker processes together: the proportional set size
    # (shared pages counted once), sampled by a thread, minus what it was before.
    script = textwrap.dedent(f"""
        import json, threading, time, psutil
        from tinylm.data import prepare
        me = psutil.Process()
        def pss():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            return total / 2**20
        base, peak, done = pss(), [0.0], threading.Event()
        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], pss())
                time.sleep(0.5)
        t = threading.Thread(target=watch)
        t.start()
        prepare({str(tmp_path / "out")!r}, [{str(src)!r}], special_tokens=["<|endoftext|>"],
                shard_tokens=50_000_000, progress=False)
        done.set()
        t.join()
        print(json.dumps({{"base_mb": base, "peak_mb": peak[0]}}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{BIG_MB} MB corpus: memory {rss}")  # shown with pytest -s
    assert rss["peak_mb"] - rss["base_mb"] < 300, rss  # flat: not growing with the corpus

    d = load_prepared(tmp_path / "out")
    expected = d.tokenizer.encode_array([block])  # the in-memory encoding of one document
    n, eot = expected.size, d.tokenizer.token_to_id("<|endoftext|>")
    assert d.meta["documents"]["read"] == copies
    n_val = d.meta["documents"]["val"]
    assert n_val == round(copies * 0.1)
    assert len(d.train) == (copies - n_val) * (n + 1) - 1 and len(d.val) == n_val * (n + 1) - 1
    assert len(d.meta["shards"]["train"]) == -(-len(d.train) // 50_000_000)
    for split in (d.train, d.val):
        for k in range(0, len(split) // (n + 1) + 1, 7):
            assert np.array_equal(split[k * (n + 1):k * (n + 1) + n], expected), k
            assert k * (n + 1) + n == len(split) or split[k * (n + 1) + n] == eot


# --- batches -------------------------------------------------------------------------------


def test_get_batch_targets_are_inputs_shifted_and_resume_is_exact() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    x, y = get_batch(tokens, 8, 16, g)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # arange: each row is a contiguous window
    assert int(x.min()) >= 0 and int(y.max()) <= 999
    x2, _ = get_batch(tokens, 8, 16, g)
    g.set_state(state)
    assert torch.equal(get_batch(tokens, 8, 16, g)[0], x)
    assert torch.equal(get_batch(tokens, 8, 16, g)[0], x2)
    with pytest.raises(DataError, match="fewer than context length"):
        get_batch(tokens[:16], 2, 16, g)


def test_get_batch_reaches_the_last_token() -> None:
    tokens = np.arange(20, dtype=np.uint32)
    g = torch.Generator().manual_seed(0)
    _, y = get_batch(tokens, 500, 18, g)
    assert int(y.max()) == 19 and int(y.min()) == 1


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 300), c=st.integers(1, 40), b=st.integers(1, 7),
       stride_frac=st.none() | st.floats(0.01, 1.0))
def test_iter_windows_scores_every_target_exactly_once(n, c, b, stride_frac) -> None:
    tokens = np.arange(n, dtype=np.uint16) * 3
    c_eff = min(c, n - 1)
    stride = None if stride_frac is None else max(1, int(stride_frac * c_eff))
    counted = np.zeros(n, dtype=int)
    first = True
    for x, y, mask in iter_windows(tokens, c, b, stride=stride):
        assert x.shape == y.shape == mask.shape and x.shape[1] == c_eff and x.shape[0] <= b
        assert torch.equal(y, x + 3)  # targets are the inputs shifted by one
        targets = (y // 3).numpy()
        np.add.at(counted, targets[mask.numpy()], 1)
        for row in mask:  # marked targets are always the tail of a window
            k = int(row.sum())
            assert row[c_eff - k:].all()
            if not first and stride is not None:
                assert k <= stride
            first = False
    assert counted[0] == 0 and (counted[1:] == 1).all()


def test_iter_windows_default_is_non_overlapping() -> None:
    tokens = np.arange(101, dtype=np.uint16)
    batches = list(iter_windows(tokens, 10, 4))
    xs = torch.cat([x for x, _, _ in batches])
    assert xs[:, 0].tolist() == list(range(0, 100, 10))
    assert all(bool(m.all()) for _, _, m in batches)


def test_prepared_data_feeds_batches(tmp_path) -> None:
    d = prepare(tmp_path / "py", progress=False)
    x, y = get_batch(d.train, 4, 32, torch.Generator().manual_seed(0))
    text = d.tokenizer.decode(x[0].tolist() + y[0, -1:].tolist())
    assert text in load_corpus("python-docs")
    assert load_tokenizer(tmp_path / "py").vocab_size == d.vocab_size


def test_bpe_trains_on_a_bounded_even_sample(tmp_path) -> None:
    text = load_corpus("python-docs")[:200_000]
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    d = prepare(tmp_path / "out", [src], tokenizer="bpe", vocab_size=300, bpe_train_mb=0.05,
                chunk_bytes=10_000, progress=False)
    trained = d.meta["tokenizer"]["trained_on_chars"]
    assert 50_000 <= trained <= 60_000  # about 1 chunk in 4, spread over the input
    assert _all_tokens(d).tolist() == d.tokenizer.encode(text)  # every byte still encoded


def test_given_tokenizer_object_and_its_unknown_characters(tmp_path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("abc cab\n" * 100)
    d = prepare(tmp_path / "ok", [src], tokenizer=CharTokenizer("abc \n"), context_length=8,
                progress=False)
    assert d.tokenizer.decode(_all_tokens(d)) == "abc cab\n" * 100
    src.write_text("abc cab\n" * 100 + "naïve")
    with pytest.raises(DataError, match=r"'ï' \(U\+00EF\)"):
        prepare(tmp_path / "bad", [src], tokenizer=CharTokenizer("abc \n"), progress=False)
    assert not (tmp_path / "bad").exists()
