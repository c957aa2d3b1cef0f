"""The native byte-level BPE encoder (tinylm.native.bpe) against its oracle, Hugging Face
tokenizers: every code point's class, random and adversarial texts, a trained vocabulary
and GPT-2-style files, long words, batches; and where it steps aside."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinylm import acceleration
from tinylm.core.errors import DataError
from tinylm.data import prepare
from tinylm.data.encoding import make_encoder
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import BPETokenizer

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import bpe  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TINYLM_NATIVE") == "0",
                                reason="the native encoder is off (TINYLM_NATIVE=0)")

EOT = "<|endoftext|>"
# Characters of every class and edge: letters of several scripts, combining marks (not
# \p{L}), digits of other scripts, emoji (with ZWJ and variation selectors), CJK, every
# kind of white space (U+001C..U+001F are not \s), controls, apostrophes, symbols.
ALPHABET = ("abcxyzABCXYZ éüßøÆ ñ 0123456789 ٣४๗ ¼Ⅻ 日本語のテキストです。カタカナ ひらがな 한국어 "
            "中文字 ́̃ै ्ा 🙂👍🏽👨‍👩‍👧 ️ ✓★→ \t\n\r\x0b\x0c \x85\xa0\u1680\u2000\u2007\u200a"
            "\u2028\u2029\u202f\u205f\u3000\x1c\x1d\x1e\x1f \x00\x01\x7f\u200b\u200d\ufeff "
            "'''\"sStTrReEvVmMlLdD .,;:!?-_()[]{}<>@#$%^&*+=/\\|~`\U0001d400\U00020000\ufffd")
WORDS = ["the", "cat", "don't", "we're", "I'll", "you've", "it'd", "I'm", "'S", "'T",
         "2024", "3.14", "日本", "テスト", "🙂", "naïve", "café", "e\u0301", "  ", "\n\n",
         "\t", "hello,", "world!", "<|endoftext|>", "x" * 70, "ab" * 40]


def _texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        parts = [rng.choice(WORDS) if rng.random() < 0.7 else
                 "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12)))
                 for _ in range(rng.randint(0, 30))]
        out.append("".join(p + rng.choice([" ", "", "\n", "  ", " \n"]) for p in parts))
    return out


@pytest.fixture(scope="module")
def trained() -> BPETokenizer:
    rng = random.Random(0)
    return BPETokenizer.train(_texts(rng, 400), vocab_size=700, special_tokens=[EOT])


def _gpt2_style(tmp_path_factory) -> BPETokenizer:
    """vocab.json + merges.txt where rank order and id order disagree: abc = ab + c, with
    b c merged first, so "abc" is [a, bc] (tiktoken's rank-by-id would give [abc])."""
    sym = bpe.byte_symbols()
    vocab = {sym[b]: b for b in range(256)}
    merges = [("b", "c"), ("a", "b"), ("ab", "c"), ("Ġ", "a"), ("Ġa", "bc"), ("e", "r"),
              ("t", "h"), ("th", "e"), ("Ġ", "the"), ("x", "x"), ("xx", "xx"), ("'", "s")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[EOT] = len(vocab)
    folder = tmp_path_factory.mktemp("gpt2")
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n"
                                                                  for a, b in merges))
    return BPETokenizer.from_gpt2_files(folder / "vocab.json", folder / "merges.txt")


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory) -> BPETokenizer:
    return _gpt2_style(tmp_path_factory)


def _native(tok: BPETokenizer) -> bpe.NativeBPE:
    enc = native.bpe_encoder(tok)
    assert enc is not None, "the tokenizer should be eligible and the library available"
    return enc


def _hf_pieces(tok: BPETokenizer, text: str) -> list[str]:
    return [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str(text)]


def _byte_level(piece: str) -> str:
    sym = bpe.byte_symbols()
    return "".join(sym[b] for b in piece.encode("utf-8"))


def test_the_rank_order_example_is_hf_not_tiktoken(gpt2_style) -> None:
    enc = _native(gpt2_style)
    for text in ("abc", " abc", "abcabc", "xxxxx", "the other", "it's", ""):
        assert enc.encode(text) == gpt2_style.encode(text), text
    assert [gpt2_style.id_to_token(i) for i in enc.encode("abc")] == ["a", "bc"]


def test_every_code_point_is_classed_as_hf_does() -> None:
    """The class table against HF's regex engine (the one its ByteLevel pattern runs on),
    on every code point but the surrogates: the runs of \\p{L}, \\p{N} and \\s."""
    import tokenizers

    codes = np.r_[0:0xD800, 0xE000:0x110000]
    text = "".join(map(chr, codes.tolist()))
    want = np.zeros(0x110000, dtype=np.uint8)
    for cls, outside in ((1, r"[^\p{L}]+"), (2, r"[^\p{N}]+"), (3, r"[^\s]+")):
        split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(outside), behavior="removed")
        for _, (a, b) in split.pre_tokenize_str(text):
            want[codes[a:b]] = cls
    got = bpe.code_point_classes()
    assert np.array_equal(got, want), [hex(c) for c in np.flatnonzero(got != want)[:20]]
    assert (want == 3).sum() == 25 and got[0x301] == 0 and got[0x3000] == 3  # marks: not L


def test_gpt2_pattern_over_probes_of_many_code_points(trained) -> None:
    """HF's ByteLevel pre-tokenizer itself over probes of each code point below U+3400
    and every 5th above (to U+40000, and some in the higher planes): a wrong class changes
    the pieces (letters join "a", numbers "1", others " ", white space splits)."""
    enc = _native(trained)
    codes = [*range(0x3400), *range(0x3400, 0x40000, 5), *range(0x40000, 0x110000, 997)]
    codes = [c for c in codes if not 0xD800 <= c <= 0xDFFF]
    for i in range(0, len(codes), 1 << 14):
        text = "".join(f"a{c}1{c} {c}" for c in map(chr, codes[i:i + (1 << 14)]))
        want = np.cumsum([len(p) for p, _ in trained.hf.pre_tokenizer.pre_tokenize_str(text)])
        assert np.array_equal(enc.split_ends(text), want), f"from U+{codes[i]:04X}"


def test_adversarial_texts_equal_hf(trained, gpt2_style) -> None:
    texts = ["", " ", "  ", "\n", "\n\n", " \n ", "a\n\nb", "a   b", "a \u3000b", "\xa0x",
             "x\xa0", "don't 'S 'T 'Re 'LL it's we'RE", "'''s", " 's", "'", "'ll've'd'm",
             "e\u0301\u0301", " \u0301", "123456789012", "١٢٣ ४५", "🙂🙂🙂 👨‍👩‍👧",
             "日本語の文章。",
             "\x00\x01\x02", "\t\t\tx", "a\r\nb", "   \n", "x" * 5000, "ab" * 3000,
             " " * 3000 + "x", "日" * 2000, "q" * 49 + " " + "w" * 65, EOT, f"a{EOT}b"]
    for tok in (trained, gpt2_style):
        enc = _native(tok)
        assert enc.encode_batch(texts) == tok.encode_batch(texts)
        for t in texts:
            assert enc.encode(t) == tok.encode(t), repr(t)
            assert [_byte_level(p) for p in enc.split(t)] == _hf_pieces(tok, t), repr(t)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(alphabet=st.sampled_from(ALPHABET), max_size=80)
                | st.text(max_size=40), max_size=6))  # st.text: any code point but surrogates
def test_random_batches_equal_hf(trained, texts) -> None:
    enc = _native(trained)
    assert enc.encode_batch(texts) == trained.encode_batch(texts)
    ids, lengths = enc.encode_lengths(texts)
    assert ids.dtype == np.uint32 and lengths.tolist() == [len(trained.encode(t))
                                                           for t in texts]


def test_generated_documents_and_the_word_cache_equal_hf(trained) -> None:
    texts = _texts(random.Random(1), 300)
    enc = _native(trained)
    want = trained.encode_batch(texts)
    assert enc.encode_batch(texts) == want
    assert enc.encode_batch(texts) == want  # now from the cache
    copy = pickle.loads(pickle.dumps(enc))  # what a spawned worker gets
    assert copy.encode_batch(texts[:20]) == want[:20]


def test_lone_surrogates_are_refused_as_hf_refuses_them(trained) -> None:
    with pytest.raises(DataError, match="valid Unicode"):
        _native(trained).encode_lengths(["ok", "bad \ud800"])
    with pytest.raises(DataError, match="valid Unicode"):
        trained.encode_batch(["bad \ud800"])


def test_it_steps_aside_for_what_it_does_not_reproduce(trained, monkeypatch) -> None:
    import tokenizers

    hf = tokenizers.Tokenizer.from_str(trained.hf.to_str())
    hf.normalizer = tokenizers.normalizers.NFC()
    assert native.bpe_encoder(BPETokenizer(hf)) is None
    hf = tokenizers.Tokenizer.from_str(trained.hf.to_str())
    hf.add_tokens(["hello"])  # an added token that is not special is split out by HF
    assert native.bpe_encoder(BPETokenizer(hf)) is None
    hf = tokenizers.Tokenizer.from_str(trained.hf.to_str())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert native.bpe_encoder(BPETokenizer(hf)) is None
    sep = np.zeros(0, dtype=np.uint32)
    assert make_encoder(trained, sep, np.dtype(np.uint16), True).fast is None  # allow_special
    assert make_encoder(trained, sep, np.dtype(np.uint16), False).fast is not None
    with native.disabled():
        assert acceleration.bpe_encoder(trained) is None
    monkeypatch.setenv("TINYLM_NATIVE", "0")
    assert acceleration.bpe_encoder(trained) is None


def test_prepare_is_the_same_with_the_native_encoder_on_and_off(trained, tmp_path,
                                                                monkeypatch) -> None:
    docs = _texts(random.Random(2), 200)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    trained.save(tmp_path / "tok.json")
    tok = load_tokenizer(tmp_path / "tok.json")
    assert make_encoder(tok, np.zeros(0, np.uint32), np.dtype(np.uint16), False).fast is not None
    on = prepare(tmp_path / "on", [src], tokenizer=tmp_path / "tok.json", workers=2,
                 context_length=8, progress=False)
    monkeypatch.setenv("TINYLM_NATIVE", "0")
    off = prepare(tmp_path / "off", [src], tokenizer=tmp_path / "tok.json", workers=1,
                  context_length=8, progress=False)
    assert np.array_equal(on.train, off.train) and np.array_equal(on.val, off.val)
    want = trained.encode_array(docs[:1])
    assert np.array_equal(np.asarray(on.train[:len(want)]), want)
