"""GGUF tokenizers in (tinylm.data.gguf_vocab): the ids of llama.cpp itself and of
transformers' GGUF tokenizer, for small vocabularies of both kinds written here with
``gguf.GGUFWriter`` and for the real SmolLM2-135M-Instruct file (``TINYLM_SMOLLM2_GGUF``).

Where transformers and llama.cpp disagree, tinylm follows llama.cpp (the file's own
pre-tokenizer) and the test says where and why:

- ``tokenizer.ggml.pre = "smollm"`` (and ``"default"``): transformers 5.25 has no split
  regex for these values and falls back to GPT-2's, so it does not cut digits off first;
  llama.cpp does (``\\p{N}`` then GPT-2's regex, as SmolLM2's own tokenizer.json does with
  its Digits pre-tokenizer). On SmolLM2 this shows before a digit after whitespace:
  ``"  1"`` is ``ĠĠ`` + ``1`` in llama.cpp, ``Ġ`` + ``Ġ`` + ``1`` in transformers.
- SentencePiece vocabularies: llama.cpp puts a ``▁`` before the text even when it starts
  with a space (``" hi"`` -> ``▁▁hi``) and after every special or user-defined token
  (``<think>``); transformers'
  ``LlamaTokenizer`` (``Metaspace``, ``prepend_scheme="first"``) does neither, and it
  ignores ``tokenizer.ggml.add_space_prefix = false``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tinylm.core.errors import DataError
from tinylm.data.gguf_vocab import (
    PRE_TOKENIZERS,
    special_tokens_of_gguf,
    tokenizer_from_gguf,
)
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import BPETokenizer

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

TEXT = """The quick brown fox jumps over the lazy dog. It's 12:30 and we'll leave at 1500.
def attention(q, k, v):\n    scores = q @ k.T / math.sqrt(d)  # 1/sqrt(d)
    return softmax(scores) @ v
\tTabs\tand  double  spaces,   triple   spaces and\n\n\nnewlines.\r\nWindows line.
Café, naïve, résumé, Ångström, façade, jalapeño, Zürich, São Paulo, Kraków.
注意機構は、クエリとキーの内積から重みを計算する。中文文本，日本語のテキスト。
Emoji: 😀 🎉 👍🏽 🚀 ❤️ — and “quotes”, ‘single’, «guillemets».
3.14159 2.71828 1,000,000 2024-12-04 0x1F 1e-5 42 007 99999 123456789
for i in range(10): print(i ** 2, end=', ')\nif x != y and not z: pass
"""
TRAIN = (TEXT * 8).split("\n")

CORPUS = [
    "Hello world! The quick brown fox.",
    "def f(x):\n    return x**2  # square\n",
    "12345 678 3.14159 2024-12-04 1,000,000",
    " 1 22 333 4444 ", "x 1", "a  1", "\t7",
    "a  b   c\t\td\n\n\ne   ", "  leading spaces", "trailing   ", "\n", " ", "\t\t",
    "\r\n\r\nx", "a \n b", "café naïve résumé Ångström", "e\u0301 combining",
    "日本語のテキスト 中文文本", "emoji 😀🎉👍🏽 ❤️", "I'm can't we'll THEY'RE it's",
    "<|im_start|>user\nhi<|im_end|>", "text <|im_end|> more", "<|im_start|><|im_end|>",
    "a <think>b</think> c", "no\u00a0break\u3000space", "x=1;y=[1,2,3]\r\nz",
]


def _fields(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}


def _write(path: Path, tokens: list[str], types: list[int], model: str,
           pre: str | None = None, merges: list[str] | None = None,
           scores: list[float] | None = None, **flags: Any) -> Path:
    """A GGUF file with a vocabulary and the few llama hyper-parameters llama.cpp reads
    before it (vocab_only loads no tensors)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for key, value in flags.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained with Hugging Face tokenizers on TEXT: tokens, types
    (the specials control, <think> user-defined) and merges."""
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=700, special_tokens=[*SPECIALS, "<think>", "</think>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN, trainer)
    doc = json.loads(tok.to_str())
    tokens = sorted(doc["model"]["vocab"], key=doc["model"]["vocab"].get)
    types = [3 if t in SPECIALS else 4 if "think>" in t else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    return tokens, types, merges


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, chat tokens, <think>, the 256
    byte tokens, then pieces (spaces as ▁) learned by BPE on TEXT, scored by merge rank."""
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.normalizer = tk.normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    tok.train_from_iterator(TRAIN, tk.trainers.BpeTrainer(vocab_size=500, show_progress=False))
    learned = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    head = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + byte_tokens + [t for t in learned if t not in head]
    types = [2, 3, 3, 3, 3, 4] + [6] * 256 + [1] * (len(tokens) - len(head) - 256)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(tokens) - 262)]
    return tokens, types, scores


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One GGUF file per pre-tokenizer, same vocabulary."""
    tokens, types, merges = _byte_level_vocab()
    folder = tmp_path_factory.mktemp("bpe")
    return {pre: _write(folder / f"{pre}.gguf", tokens, types, "gpt2", pre=pre, merges=merges,
                        bos_token_id=0, eos_token_id=2, chat_template="{{ messages }}")
            for pre in ("gpt-2", "default", "llama-bpe", "qwen2", "smollm")}


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The SentencePiece-style vocabulary with and without the prefix space."""
    tokens, types, scores = _spm_vocab()
    folder = tmp_path_factory.mktemp("spm")
    return {prefix: _write(folder / f"spm-{prefix}.gguf", tokens, types, "llama",
                           scores=scores, add_space_prefix=prefix)
            for prefix in (True, False)}


def _llama(path: Path) -> Any:
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _fuzz(n: int, seed: int = 0) -> list[str]:
    """Short random strings over the characters pre-tokenizers treat differently."""
    rng = random.Random(seed)
    alphabet = [*"ab Z1 23\n\t.,'-é日😀x", "  ", "'s", "'LL", "\r\n", "\u00a0", "<|im_end|>"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _assert_same_as_llama(tok: BPETokenizer, llama: Any, texts: list[str]) -> None:
    for special in (False, True):
        for text in texts:
            want = llama.tokenize(text.encode(), add_bos=False, special=special)
            assert tok.encode(text, allow_special=special) == want, (text, special)


# --- byte-level BPE ---------------------------------------------------------------------------


@pytest.mark.parametrize("pre", ["gpt-2", "default", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_ids_equal_llama_cpp(byte_level: dict[str, Path], pre: str) -> None:
    tok = tokenizer_from_gguf(_fields(byte_level[pre]))
    _assert_same_as_llama(tok, _llama(byte_level[pre]), CORPUS + _fuzz(400))


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_byte_level_ids_equal_transformers(byte_level: dict[str, Path], pre: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = byte_level[pre]
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = tokenizer_from_gguf(_fields(path))
    for text in CORPUS + _fuzz(300, seed=1):
        # transformers always matches special tokens in the text: allow_special=True
        assert tok.encode(text, allow_special=True) == hf.encode(
            text, add_special_tokens=False), text


def test_absent_pre_is_llama_cpp_default(byte_level: dict[str, Path], tmp_path: Path) -> None:
    fields = _fields(byte_level["default"])
    path = _write(tmp_path / "nopre.gguf", fields["tokenizer.ggml.tokens"],
                  fields["tokenizer.ggml.token_type"], "gpt2",
                  merges=fields["tokenizer.ggml.merges"])
    tok = tokenizer_from_gguf(_fields(path))
    assert "tokenizer.ggml.pre" not in _fields(path)
    _assert_same_as_llama(tok, _llama(path), CORPUS + _fuzz(100, seed=8))
    default = tokenizer_from_gguf(fields)
    assert all(tok.encode(t) == default.encode(t) for t in CORPUS)


def test_pre_tokenizers_that_differ_are_told_apart(byte_level: dict[str, Path]) -> None:
    """Not a vacuous table: on this vocabulary the pre-tokenizers give different ids."""
    toks = {pre: tokenizer_from_gguf(_fields(p)) for pre, p in byte_level.items()}
    text = "x  1234567 it'S ab,\n\ncd"
    assert len({tuple(t.encode(text)) for t in toks.values()}) >= 4


def test_byte_level_round_trip_and_special_tokens(byte_level: dict[str, Path]) -> None:
    tok = tokenizer_from_gguf(_fields(byte_level["smollm"]))
    for text in CORPUS + _fuzz(200, seed=2):
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, allow_special=True)) == text
    im_start = tok.token_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>", allow_special=True) == [im_start]
    assert im_start not in tok.encode("<|im_start|>")  # ordinary text by default
    assert set(tok.special_tokens) == set(SPECIALS)  # control tokens only
    think = tok.token_to_id("<think>")  # user-defined: whole either way, as llama.cpp does
    assert tok.encode("<think>") == tok.encode("<think>", allow_special=True) == [think]
    assert tok.eos_id == tok.token_to_id("<|endoftext|>")
    assert tok.byte_level and not tok.split_safe


def test_saved_tokenizer_json_loads_back_with_the_same_ids(byte_level: dict[str, Path],
                                                           spm: dict[bool, Path],
                                                           tmp_path: Path) -> None:
    for i, path in enumerate([byte_level["llama-bpe"], spm[True]]):
        tok = tokenizer_from_gguf(_fields(path))
        again = load_tokenizer(tok.save(tmp_path / f"tok{i}.json"))
        assert again.kind == tok.kind == "file"
        for text in CORPUS:
            for special in (False, True):
                assert again.encode(text, allow_special=special) == tok.encode(
                    text, allow_special=special)


@pytest.mark.parametrize("name", ["llama-bpe", "spm"])
def test_tokenizer_json_of_transformers_loads_with_its_ids(byte_level: dict[str, Path],
                                                          spm: dict[bool, Path], name: str,
                                                          tmp_path: Path) -> None:
    """A Llama-3-shaped (Split + ByteLevel) and a Llama-2-shaped (Metaspace, byte
    fallback) tokenizer.json written by transformers, as ``convert --from-hf`` meets
    them, load as tinylm tokenizers that give transformers' ids."""
    transformers = pytest.importorskip("transformers")
    path = byte_level[name] if name != "spm" else spm[True]
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "file" and tok.byte_level == (name != "spm")
    for text in CORPUS:
        assert tok.encode(text, allow_special=True) == hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False,
                                             split_special_tokens=True)
    ids = tok.encode("Hello  world")
    assert "".join(tok.id_to_token(i) for i in ids).strip() == "Hello  world"


# --- SentencePiece-style --------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_ids_equal_llama_cpp(spm: dict[bool, Path], prefix: bool) -> None:
    tok = tokenizer_from_gguf(_fields(spm[prefix]))
    _assert_same_as_llama(tok, _llama(spm[prefix]), CORPUS + _fuzz(400, seed=3))


def test_spm_ids_equal_transformers_where_it_follows_llama_cpp(spm: dict[bool, Path]) -> None:
    """transformers agrees on text that does not start with whitespace and has no added
    token followed by text, special tokens kept as text (see the module docstring)."""
    transformers = pytest.importorskip("transformers")
    path = spm[True]
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = tokenizer_from_gguf(_fields(path))
    texts = [t for t in CORPUS + _fuzz(300, seed=4)
             if not t[:1].isspace() and "<think>" not in t]  # user-defined: always whole
    assert len(texts) > 200
    for text in texts:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False,
                                             split_special_tokens=True), text
    llama = _llama(path)  # and where they differ, tinylm is llama.cpp
    for text in (" hi", "<|im_start|>user"):
        want = llama.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text, allow_special=True) == want
        assert hf.encode(text, add_special_tokens=False, split_special_tokens=False) != want


def test_spm_bytes_round_trip_and_specials(spm: dict[bool, Path]) -> None:
    tok = tokenizer_from_gguf(_fields(spm[True]))
    llama = "\U0001F999".encode()  # in no piece: its UTF-8 bytes as <0xNN> tokens
    assert tok.encode("\U0001F999")[-4:] == [tok.token_to_id(f"<0x{b:02X}>") for b in llama]
    for text in CORPUS + _fuzz(200, seed=5):
        if "<think>" not in text:
            assert tok.decode(tok.encode(text)) == text
    # after an added token (always matched whole) text gets llama.cpp's prefix space, and
    # decoding shows it, as llama.cpp's detokenize does
    assert tok.decode(tok.encode("a <think>b")) == "a <think> b"
    assert tok.encode("<|im_end|>", allow_special=True) == [4]
    assert 4 not in tok.encode("<|im_end|>")
    assert set(tok.special_tokens) == {"<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"}
    assert not tok.byte_level and tok.metaspace


def test_spm_tokens_are_shown_as_text(spm: dict[bool, Path]) -> None:
    """id_to_token shows "▁" as a space and <0xNN> as its byte, as byte-level tokens are
    shown; token_to_id takes that spelling back (a byte whose character is also a piece
    gives the piece)."""
    tok = tokenizer_from_gguf(_fields(spm[True]))
    assert tok.id_to_token(tok.hf.token_to_id("\u2581\u2581")) == "  "
    assert tok.id_to_token(tok.hf.token_to_id("<0xF0>")) == "\\xf0"
    assert tok.id_to_token(tok.hf.token_to_id("<0x0A>")) == "\n"
    assert tok.id_to_token(3) == "<|im_start|>"
    for i in range(tok.vocab_size):
        shown = tok.id_to_token(i)
        j = tok.token_to_id(shown)
        assert j == i or (6 <= i < 262 and tok.id_to_token(j) == shown), (i, shown, j)


# --- special tokens and flags ----------------------------------------------------------------


def test_special_tokens_of_gguf(byte_level: dict[str, Path], spm: dict[bool, Path]) -> None:
    got = special_tokens_of_gguf(_fields(byte_level["gpt-2"]))
    assert got == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": None,
                   "pad_token": None, "eot_token": "<|im_end|>", "add_bos_token": False,
                   "add_eos_token": False, "chat_template": "{{ messages }}"}
    assert special_tokens_of_gguf(_fields(byte_level["llama-bpe"]))["add_bos_token"] is True
    got = special_tokens_of_gguf(_fields(spm[True]))  # llama.cpp's defaults for SPM
    assert (got["bos_token"], got["eos_token"], got["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert got["add_bos_token"] is True and got["chat_template"] is None
    fields = {**_fields(spm[False]), "tokenizer.ggml.add_bos_token": False,
              "tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.padding_token_id": 99999}
    got = special_tokens_of_gguf(fields)
    assert (got["add_bos_token"], got["eot_token"], got["pad_token"]) == (
        False, "<|im_start|>", None)


# --- refusals --------------------------------------------------------------------------------


def _refusal(fields: dict[str, Any]) -> str:
    with pytest.raises(DataError) as info:
        tokenizer_from_gguf(fields)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line_naming_the_problem(byte_level: dict[str, Path]) -> None:
    fields = _fields(byte_level["gpt-2"])
    assert "'bert'" in _refusal({**fields, "tokenizer.ggml.model": "bert"})
    assert "'chameleon'" in _refusal({**fields, "tokenizer.ggml.pre": "chameleon"})
    assert "tokenizer.ggml.model" in _refusal({"general.architecture": "llama"})
    tokens = fields["tokenizer.ggml.tokens"]
    assert "twice" in _refusal({**fields, "tokenizer.ggml.tokens": [*tokens[:-1], tokens[0]]})
    assert "merge 0" in _refusal({**fields, "tokenizer.ggml.merges": ["nosuch token"]})
    assert "token_type" in _refusal({**fields, "tokenizer.ggml.token_type": [1, 1]})
    assert "tokenizer.ggml.tokens" in _refusal({**fields, "tokenizer.ggml.tokens": "abc"})
    assert set(PRE_TOKENIZERS) >= {"default", "gpt-2", "llama-bpe", "smollm", "qwen2"}


# --- the real SmolLM2-135M-Instruct GGUF ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def smollm2_fields(smollm2: Path) -> dict[str, Any]:
    return _fields(smollm2)


def test_smollm2_ids_equal_llama_cpp(smollm2: Path, smollm2_fields: dict[str, Any]) -> None:
    fields = smollm2_fields
    assert fields["tokenizer.ggml.pre"] == "smollm"
    tok = tokenizer_from_gguf(fields)
    assert tok.vocab_size == 49152 and len(tok.special_tokens) == 17
    _assert_same_as_llama(tok, _llama(smollm2), CORPUS + TRAIN + _fuzz(1500, seed=6))


def test_smollm2_ids_equal_transformers_but_digits_after_spaces(
        smollm2: Path, smollm2_fields: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    tok = tokenizer_from_gguf(smollm2_fields)
    texts = CORPUS + TRAIN + _fuzz(1500, seed=7)
    differ = [t for t in texts
              if tok.encode(t, allow_special=True) != hf.encode(t, add_special_tokens=False)]
    # transformers has no "smollm" split (see the module docstring): it differs exactly
    # where two or more whitespace characters come before a digit
    digit_after_spaces = [t for t in texts if _space_run_before_digit(t)]
    assert differ and set(differ) <= set(digit_after_spaces)
    llama = _llama(smollm2)
    assert tok.encode("  1") == llama.tokenize(b"  1", add_bos=False, special=False) == [
        tok.token_to_id("  "), tok.token_to_id("1")]
    assert hf.encode("  1", add_special_tokens=False) == [tok.token_to_id(" ")] * 2 + [
        tok.token_to_id("1")]


def _space_run_before_digit(text: str) -> bool:
    return any(text[i].isdigit() and text[i - 2:i].isspace() for i in range(2, len(text)))


def test_smollm2_special_tokens_and_template(smollm2: Path,
                                            smollm2_fields: dict[str, Any]) -> None:
    got = special_tokens_of_gguf(smollm2_fields)
    pytest.importorskip("transformers")
    from transformers.integrations.gguf import get_gguf_tokenizer

    _, _, config = get_gguf_tokenizer(str(smollm2))  # transformers' own reading
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token",
                "chat_template"):
        assert got[key] == config[key], key
    assert got["bos_token"] == "<|im_start|>" and got["eos_token"] == "<|im_end|>"
    assert got["unk_token"] == "<|endoftext|>" and got["pad_token"] == "<|im_end|>"
    assert got["eot_token"] == "<|im_end|>"
    assert got["add_bos_token"] is False and got["add_eos_token"] is False
    assert got["chat_template"].startswith("{% for message in messages %}")
    assert "<|im_start|>assistant" in got["chat_template"]
