"""Tokenizers: lossless round trips on random Unicode, the unknown-character policy,
one JSON format readable by Hugging Face ``tokenizers``, GPT-2 files, and the
streaming cut points of byte-level BPE."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm.corpora import load_corpus
from tinylm.data import safe_split
from tinylm.errors import DataError
from tinylm.tokenizers import UNK, BPETokenizer, CharTokenizer, load_tokenizer

JAPANESE = "注意機構は、クエリとキーの内積から重みを計算する。言語モデル🌤️"
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text that stresses GPT-2's pre-tokenizer: runs of spaces/newlines, contractions,
# digits, punctuation, Japanese, emoji, tabs and carriage returns.
tricky_text = st.lists(
    st.sampled_from(list("ab Z9 \n\n\r\t\x0b\x1c\x85\u2028'sl.,!?-_")
                    + ["'s", "'ll", "  ", "\u3000", "日本", "é", "🌤️", "\xa0"]),
    max_size=120,
).map("".join)


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    text = load_corpus("python-docs")[:200_000] + JAPANESE * 20
    return BPETokenizer.train([text], vocab_size=600, special_tokens=["<|endoftext|>"])


# --- char ----------------------------------------------------------------------------------


@FAST
@given(st.text())
def test_char_round_trip_random_unicode(s: str) -> None:
    tok = CharTokenizer(s + JAPANESE)
    ids = tok.encode(s + JAPANESE)
    assert len(ids) == len(s + JAPANESE)  # one token per code point
    assert tok.decode(ids) == s + JAPANESE


def test_char_ids_follow_code_points_and_japanese_is_one_token_each() -> None:
    tok = CharTokenizer("日本語abc")
    assert tok.vocab_size == 6
    assert tok.encode("abc語日本") == [0, 1, 2, 5, 3, 4]  # ids in code-point order
    assert [tok.id_to_token(i) for i in range(6)] == sorted("日本語abc")
    assert tok.token_to_id("本") == 4 and tok.token_to_id("x") is None


def test_char_unknown_error_names_the_characters() -> None:
    tok = CharTokenizer("abc ")
    with pytest.raises(DataError) as info:
        tok.encode("abc é日 a")
    msg = str(info.value)
    assert "'é' (U+00E9)" in msg and "'日' (U+65E5)" in msg and "--unknown replace" in msg
    assert "\n" not in msg


def test_char_unknown_replace_maps_to_unk() -> None:
    tok = CharTokenizer("abc", unknown="replace")
    unk = tok.token_to_id(UNK)
    assert unk == 3 and tok.vocab_size == 4
    assert tok.encode("aéb🌤") == [0, unk, 1, unk]
    assert tok.decode(tok.encode("aéb")) == f"a{UNK}b"


def test_char_save_load_is_a_hugging_face_tokenizer_json(tmp_path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    text = "Hello, 世界! 🌤️\n\ttabs"
    for unknown in ("error", "replace"):
        tok = CharTokenizer(text, unknown=unknown, special_tokens=["<|endoftext|>"])
        path = tok.save(tmp_path / f"{unknown}.json")
        back = load_tokenizer(path)
        assert isinstance(back, CharTokenizer) and back.kind == "char"
        assert back.unknown == unknown and back.vocab_size == tok.vocab_size
        assert back.encode(text) == tok.encode(text)
        assert back.eos_id == tok.eos_id == tok.token_to_id("<|endoftext|>")
        hf = HFTokenizer.from_file(str(path))  # the same file works in HF tokenizers
        assert hf.encode(text).ids == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text


def test_char_encode_array_and_batch() -> None:
    tok = CharTokenizer("ab日")
    assert tok.encode_array(["ab", "日a"]).tolist() == tok.encode("ab日a")
    assert tok.encode_batch(["ab", "", "日"]) == [[0, 1], [], [2]]
    with pytest.raises(DataError):
        tok.decode([0, 7])


# --- bpe -----------------------------------------------------------------------------------


@FAST
@given(st.text())
def test_bpe_round_trip_random_unicode(bpe: BPETokenizer, s: str) -> None:
    assert bpe.decode(bpe.encode(s)) == s


@FAST
@given(tricky_text)
def test_bpe_round_trip_tricky_text(bpe: BPETokenizer, s: str) -> None:
    assert bpe.decode(bpe.encode(s + JAPANESE)) == s + JAPANESE


def test_bpe_is_byte_level_with_requested_vocab(bpe: BPETokenizer) -> None:
    assert bpe.kind == "bpe" and bpe.vocab_size == 600
    assert bpe.eos_id == bpe.token_to_id("<|endoftext|>") is not None
    ids = bpe.encode("the return statement")
    assert len(ids) < len("the return statement") / 2  # merges learned from the corpus
    assert bpe.encode_batch(["a b", "日本"]) == [bpe.encode("a b"), bpe.encode("日本")]
    assert bpe.encode_array(["def f", "(x)"]).tolist() == bpe.encode("def f") + bpe.encode("(x)")


def test_bpe_display_tokens_invert(bpe: BPETokenizer) -> None:
    for i in range(bpe.vocab_size):
        shown = bpe.id_to_token(i)
        assert isinstance(shown, str)
        assert bpe.token_to_id(shown) == i, (i, shown)
    assert "Ġ" not in bpe.id_to_token(bpe.encode(" the")[0])  # readable, not byte-mapped


def test_bpe_save_load_and_hf_compat(bpe: BPETokenizer, tmp_path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    path = bpe.save(tmp_path)  # a folder -> folder/tokenizer.json
    assert path.name == "tokenizer.json"
    back = load_tokenizer(tmp_path)
    assert back.kind == "bpe" and back.vocab_size == bpe.vocab_size
    text = "def f(x):\n    return x  # 日本語 🌤️"
    assert back.encode(text) == bpe.encode(text)
    assert HFTokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids == \
        bpe.encode(text)


def test_gpt2_files_load_from_disk(bpe: BPETokenizer, tmp_path) -> None:
    bpe.hf.model.save(str(tmp_path))  # writes vocab.json + merges.txt, GPT-2's layout
    assert (tmp_path / "vocab.json").is_file() and (tmp_path / "merges.txt").is_file()
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "gpt2"
    text = "import os\nprint(os.getcwd())  # 日本"
    assert tok.encode(text) == bpe.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert load_tokenizer(tmp_path / "vocab.json").encode(text) == bpe.encode(text)


def test_plain_hf_tokenizer_json_is_kind_file(tmp_path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.kind == "file" and tok.vocab_size == 3
    assert tok.encode("hello world moon") == [0, 1, 2]
    assert tok.id_to_token(1) == "world" and tok.token_to_id("hello") == 0


def test_bpe_vocab_too_small() -> None:
    with pytest.raises(DataError, match="at least 257"):
        BPETokenizer.train(["abc"], vocab_size=256, special_tokens=["<|endoftext|>"])


def test_load_tokenizer_bad_paths(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(DataError, match="no tokenizer in folder"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "other.json")


# --- streaming cut points ------------------------------------------------------------------


def _cuts(text: str) -> list[int]:
    """Every safe cut point of ``text``, found the way the streaming reader finds them."""
    cuts, hi = [], len(text)
    while (p := safe_split(text, 0, hi)) > 0:
        cuts.append(p)
        hi = p - 1
    return sorted(cuts)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tricky_text, st.randoms(use_true_random=False))
def test_cutting_at_safe_points_gives_one_shot_tokens(bpe: BPETokenizer, text: str,
                                                      rnd) -> None:
    cuts = _cuts(text)
    chosen = sorted(c for c in cuts if rnd.random() < 0.5)
    pieces = [text[a:b] for a, b in zip([0, *chosen], [*chosen, len(text)], strict=True)]
    assert "".join(pieces) == text
    streamed = np.concatenate([np.asarray(bpe.encode(p), dtype=np.int64) for p in pieces]
                              + [np.zeros(0, np.int64)])
    assert streamed.tolist() == bpe.encode(text)


def test_safe_split_examples() -> None:
    assert safe_split("ab cd", 0, 5) == 2  # before the space: " cd" is one token
    assert safe_split("ab  cd", 0, 6) == 3  # a run gives its last space to the next word
    assert safe_split("ab\r\ncd", 0, 6) == 3  # before "\n", never between "\r\n" and "c"
    assert safe_split("abcd", 0, 4) == -1
    assert safe_split("ab   ", 0, 5) == -1  # trailing whitespace is not a safe cut
