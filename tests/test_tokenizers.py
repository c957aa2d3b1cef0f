"""Tokenizers: lossless round trips on random Unicode, the unknown-character policy,
one JSON format readable by Hugging Face ``tokenizers``, GPT-2 files, and the
streaming cut points of byte-level BPE."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm.core.errors import DataError, TinyLMError
from tinylm.data import safe_split
from tinylm.data.corpora import load_corpus
from tinylm.data.tokenizer_files import load_tokenizer, tokenizer_from_json
from tinylm.data.tokenizers import (
    CHAT_TEMPLATE,
    STANDARD_SPECIALS,
    UNK,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
)

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


# --- special tokens only on purpose (issue 11 item 4) ---------------------------------------

SPECIALS = list(STANDARD_SPECIALS)
HOSTILE = "a <|endoftext|> b<|user|><|assistant|>c<|end|><|system|>\n<unk>"


def _word_level_file(tmp_path) -> Tokenizer:
    """A kind-"file" tokenizer: WordLevel over characters, with the standard specials."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    chars = sorted(set(HOSTILE + "xyz"))
    hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="x"))
    hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf.add_special_tokens(SPECIALS)
    hf.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(tmp_path / "tokenizer.json")


@pytest.fixture()
def every_kind(bpe: BPETokenizer, tmp_path) -> list[Tokenizer]:
    """One tokenizer of each kind, each with the standard special tokens."""
    char = CharTokenizer(HOSTILE + JAPANESE, unknown="replace", special_tokens=SPECIALS)
    trained = BPETokenizer.train([load_corpus("python-docs")[:50_000], HOSTILE],
                                 vocab_size=400, special_tokens=SPECIALS)
    (tmp_path / "g").mkdir()
    trained.hf.model.save(str(tmp_path / "g"))
    gpt2 = load_tokenizer(tmp_path / "g").with_special_tokens(SPECIALS)
    kinds = [char, trained, gpt2, _word_level_file(tmp_path)]
    assert [t.kind for t in kinds] == ["char", "bpe", "gpt2", "file"]
    return kinds


def test_user_text_never_becomes_a_special_id_for_every_kind(every_kind) -> None:
    for tok in every_kind:
        special = {tok.token_to_id(s) for s in tok.special_tokens} - {tok.token_to_id(UNK)}
        assert len(special) >= len(SPECIALS), tok
        for ids in (tok.encode(HOSTILE), tok.encode_batch([HOSTILE])[0],
                    tok.encode_array([HOSTILE, HOSTILE]).tolist()):
            assert not special & set(ids), (tok.kind, ids)
        if tok.kind != "file":  # WordLevel maps characters it lacks to its unk
            assert tok.decode(tok.encode(HOSTILE)) == HOSTILE
        # Asked for, the spellings are the tokens.
        wanted = tok.encode(HOSTILE, allow_special=True)
        assert [i for i in wanted if i in special] == [
            tok.token_to_id(s) for s in ("<|endoftext|>", "<|user|>", "<|assistant|>",
                                         "<|end|>", "<|system|>")], tok.kind
        assert tok.encode_array([HOSTILE], allow_special=True).tolist() == wanted


def test_hugging_face_matches_both_ways_of_encoding(every_kind, tmp_path) -> None:
    import transformers

    for tok in every_kind:
        path = tok.save(tmp_path / f"{tok.kind}.json")
        auto = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        assert auto(HOSTILE, add_special_tokens=False)["input_ids"] == \
            tok.encode(HOSTILE, allow_special=True), tok.kind
        assert auto(HOSTILE, add_special_tokens=False, split_special_tokens=True
                    )["input_ids"] == tok.encode(HOSTILE), tok.kind


def test_with_special_tokens_appends_ids_and_keeps_the_rest(every_kind, tmp_path) -> None:
    for tok in every_kind:
        more = tok.with_special_tokens(["<|tool|>", "<|user|>"])
        assert more.vocab_size == tok.vocab_size + 1 and more.kind == tok.kind
        assert more.token_to_id("<|tool|>") == tok.vocab_size
        assert more.encode(HOSTILE) == tok.encode(HOSTILE)
        assert more.token_to_id("<|user|>") == tok.token_to_id("<|user|>")
        back = load_tokenizer(more.save(tmp_path / f"more-{tok.kind}.json"))
        # (GPT-2 files of another size than GPT-2's read back as byte-level "bpe")
        assert back.vocab_size == more.vocab_size
        assert back.kind == ("bpe" if more.kind == "gpt2" else more.kind)
        assert back.encode(HOSTILE, allow_special=True) == more.encode(HOSTILE,
                                                                       allow_special=True)


def test_char_unk_keeps_its_id_when_tokens_are_added(tmp_path) -> None:
    tok = CharTokenizer("abc", unknown="replace", special_tokens=["<|endoftext|>"])
    unk = tok.token_to_id(UNK)
    more = tok.with_special_tokens(["<|user|>"])
    assert more.token_to_id(UNK) == unk and more.token_to_id("<|user|>") == 5
    back = load_tokenizer(more.save(tmp_path / "t.json"))
    assert back.token_to_id(UNK) == unk and back.encode("aé") == [0, unk]


def test_chat_template_only_with_every_chat_token() -> None:
    assert CharTokenizer("ab", special_tokens=SPECIALS).chat_template == CHAT_TEMPLATE
    assert CharTokenizer("ab", special_tokens=["<|endoftext|>", "<|user|>"]).chat_template \
        is None
    with pytest.raises(DataError, match="no special token <\\|assistant\\|>"):
        CharTokenizer("ab").special_id("<|assistant|>")


def test_prepare_gives_every_built_tokenizer_eos_and_chat_tokens(tmp_path) -> None:
    from tinylm.data import prepare

    (tmp_path / "in.txt").write_text(("hello world " * 20 + "\n") * 20 + HOSTILE)
    for kind in ("char", "bpe"):
        d = prepare(tmp_path / kind, [tmp_path / "in.txt"], tokenizer=kind, vocab_size=300,
                    context_length=16, progress=False)
        tok = d.tokenizer
        assert tok.special_tokens[:len(SPECIALS)] == tuple(SPECIALS)
        assert tok.eos_id is not None and tok.chat_template == CHAT_TEMPLATE
        ids = np.concatenate([d.train, d.val])
        assert not set(ids.tolist()) & {tok.token_to_id(s) for s in SPECIALS}
        assert tok.decode(ids).endswith(HOSTILE)


# --- malformed tokenizer files: one typed line each (issue 11 items 5 and 7) --------------


@pytest.mark.parametrize("doc", [
    {"model": [None]},
    {"model": None},
    {"model": {"type": "BPE", "vocab": {"a": []}, "merges": []}, "pre_tokenizer": None,
     "decoder": {"type": "Fuse"}},
    {"model": {"type": "BPE", "vocab": {"a": 0, "<|x|>": 1}, "merges": []},
     "pre_tokenizer": None, "decoder": {"type": "Fuse"}, "added_tokens": [{"content": "<|x|>"}]},
    {"model": {"type": "BPE", "vocab": [], "merges": []}, "pre_tokenizer": None,
     "decoder": {"type": "Fuse"}},
    {"model": {"type": "BPE", "vocab": {"ab": 0}, "merges": []}, "pre_tokenizer": None,
     "decoder": {"type": "Fuse"}},
    {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": None,
     "decoder": {"type": "Fuse"}, "added_tokens": None},
    {"model": {"type": "WordLevel", "vocab": {"a": "0"}}},
    {"model": {"type": "Nope"}, "pre_tokenizer": [1]},
    {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a"]]},
     "pre_tokenizer": {"type": "ByteLevel"}},
])
def test_malformed_tokenizer_json_is_one_data_error(doc) -> None:
    with pytest.raises(DataError) as info:
        tokenizer_from_json(json.dumps(doc), "t.json")
    assert "\n" not in str(info.value) and "t.json" in str(info.value)


def test_deeply_nested_tokenizer_json_is_one_data_error() -> None:
    with pytest.raises(DataError):
        tokenizer_from_json('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")


# Values a broken or hostile file may hold where a field belongs.
JSON_VALUES = [None, True, 0, -1, 7, 2**40, 1.5, float("nan"), "", "a", "ab", "<unk>", "BPE",
               "Fuse", "ByteLevel", "WordLevel", "Sequence", [], [None], [0], ["a"],
               [["a", "b"]], ["a b"], {}, {"a": 0}, {"a": []}, {"type": "BPE"},
               {"type": "Fuse"}, {"type": "ByteLevel"}, {"type": None}, {"a": "0"},
               [{"id": 0}], [{"content": "a"}], [{"id": "0", "content": "a"}],
               [{"id": 99, "content": "<|x|>", "special": True}], {"ab": 0, "b": 1}]


FIELDS = [("model",), ("model", "vocab"), ("model", "merges"), ("model", "type"),
          ("model", "unk_token"), ("added_tokens",), ("decoder",), ("pre_tokenizer",),
          ("normalizer",), ("post_processor",), ("added_tokens", 0),
          ("added_tokens", 0, "id"), ("added_tokens", 0, "content"), ("model", "vocab", "a")]


@pytest.fixture(scope="module")
def real_docs() -> list[dict]:
    """Real tokenizer documents of both tinylm formats: char and byte-level BPE."""
    return [CharTokenizer("ab日", unknown="replace", special_tokens=SPECIALS).to_hf_json(),
            BPETokenizer.train(["ab ab abc " * 30], vocab_size=262,
                               special_tokens=SPECIALS).to_hf_json()]


def _mutate(doc: dict, changes) -> dict:
    """A deep copy of ``doc`` with each (field path, value or DELETE) applied."""
    doc = json.loads(json.dumps(doc))
    for path, value in changes:
        node = doc
        try:
            for key in path[:-1]:
                node = node[key]
            if value is DELETE:
                del node[path[-1]]
            else:
                node[path[-1]] = copy.deepcopy(value)
        except (KeyError, IndexError, TypeError):  # an earlier change removed the parent
            pass
    return doc


DELETE = object()


def _load_or_typed_error(doc: dict) -> None:
    try:
        tok = tokenizer_from_json(json.dumps(doc), "t.json")
    except TinyLMError as exc:
        assert "\n" not in str(exc)
        return
    try:  # a tokenizer that loads must encode without a raw exception too
        tok.encode("ab 日", allow_special=True)
    except TinyLMError:
        pass


def test_every_single_field_mutation_is_loaded_or_one_typed_error(real_docs) -> None:
    """Each real document with one field replaced by each hostile value or removed:
    2 x 14 x 37 = 1,036 files, each loads or is a one-line TinyLMError."""
    for doc in real_docs:
        for path in FIELDS:
            for value in [*JSON_VALUES, DELETE]:
                _load_or_typed_error(_mutate(doc, [(path, value)]))


@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 1), st.lists(st.tuples(st.sampled_from(FIELDS),
                                             st.sampled_from([*JSON_VALUES, DELETE])),
                                   min_size=2, max_size=4))
def test_fuzzed_tokenizer_files_raise_only_typed_errors(real_docs, base, changes) -> None:
    """Hypothesis: 1,500 documents with two to four fields broken at once; never a raw
    exception from json, this module or the Rust ``tokenizers`` library (no panic)."""
    _load_or_typed_error(_mutate(real_docs[base], changes))
