"""GGUF tokenizers in: a GGUF file's vocabulary metadata -> a tinylm :class:`BPETokenizer`.

A GGUF file carries no tokenizer.json: its tokenizer is metadata under llama.cpp's key
names (``tokenizer.ggml.*``). :func:`tokenizer_from_gguf` rebuilds it as a Hugging Face
``tokenizers`` object that gives the ids llama.cpp gives for the same file, and wraps it
as tinylm's :class:`~tinylm.data.tokenizers.BPETokenizer` (kind ``file``: saved, it is an
ordinary tokenizer.json and loads back as that kind). :func:`special_tokens_of_gguf`
gives the special tokens, the bos/eos flags and the chat template as the keys of Hugging
Face's ``tokenizer_config.json``.

Two vocabulary kinds (``tokenizer.ggml.model``):

``gpt2``  byte-level BPE: ``tokens``, ``merges`` (rank = position) and ``token_type``.
          Text is cut into words by the regexes llama.cpp runs for ``tokenizer.ggml.pre``
          (:data:`PRE_TOKENIZERS`; one after another, each cutting the pieces of the one
          before, text between matches kept as pieces), then each word's UTF-8 bytes are
          merged by rank. ``llama-bpe`` (Llama 3) also takes a word that is a token as is
          (llama.cpp's ``ignore_merges``). An absent ``pre`` is ``default``, as in
          llama.cpp; a value not in the table is refused.
``llama`` SentencePiece-style: ``tokens``, ``scores`` and ``token_type``. Spaces become
          ``▁``, a ``▁`` is put before the text (and after each special token) when
          ``tokenizer.ggml.add_space_prefix`` is true (the default), and the pair of
          adjacent pieces whose concatenation is the best-scoring token is merged until
          none is left (llama.cpp's SPM tokenizer); the merges are those pairs, ranked by
          the merged token's score. A character without a token is its UTF-8 bytes as
          ``<0xNN>`` tokens (byte fallback).

Token types (llama.cpp's): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte. Control and unknown tokens are special tokens: matched in the text only with
``allow_special=True``, as llama.cpp's ``parse_special``. User-defined tokens (e.g.
``<think>``) are added tokens that llama.cpp always matches whole, special or not, so they
are here too. Tokens llama.cpp treats as control by their spelling (``<|im_end|>``,
``<|eot_id|>``, ... : :data:`CONTROL_BY_NAME`) are special whatever their type says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tinylm.core.errors import DataError
from tinylm.data.tokenizers import BPETokenizer, _first_line, _require_hf_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# The regexes of llama.cpp's llama-vocab.cpp (llm_tokenizer_bpe), applied in order.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
           r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class PreTokenizer(NamedTuple):
    """What llama.cpp does for one ``tokenizer.ggml.pre`` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a token is taken whole
    add_bos: bool = False  # llama.cpp's add_bos when the file does not say


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM_PRE = PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
#: ``tokenizer.ggml.pre`` -> its pre-tokenizer, for the values llama.cpp maps to these.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), PreTokenizer((_GPT2,))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _SMOLLM_PRE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_PRE),
}

#: Spellings llama.cpp makes control tokens whatever the file's type says (its end-of-
#: turn, end-of-generation and fill-in-the-middle names).
CONTROL_BY_NAME = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<｜end▁of▁sentence｜>",
    "<end_of_utterance>", "<|eom_id|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
    "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
))
#: End-of-turn spellings, in the order :func:`special_tokens_of_gguf` prefers them when
#: the file names no ``eot_token_id`` (llama.cpp looks for the same names).
EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
             "<|endoftext|>")

_KEY = "tokenizer.ggml."
_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece-style"}


def _bad(what: str) -> DataError:
    return DataError(f"the GGUF tokenizer metadata is unusable: {what}; the file may be "
                     f"damaged or written by an old converter, convert the model again")


def _model_of(fields: Mapping[str, Any]) -> str:
    model = fields.get(_KEY + "model")
    if model is None:
        raise DataError("the GGUF file has no tokenizer (no tokenizer.ggml.model); pass a "
                        "tokenizer with --tokenizer or use a GGUF file that includes one")
    if model not in _MODELS:
        known = ", ".join(f"{k!r} ({v})" for k, v in _MODELS.items())
        raise DataError(f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not "
                        f"supported; tinylm reads {known}")
    return str(model)


def _strings(fields: Mapping[str, Any], name: str, required: bool = True) -> list[str]:
    value = fields.get(_KEY + name)
    if value is None and not required:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise _bad(f"{_KEY}{name} is {'missing' if value is None else 'not a list of strings'}")
    return list(value)


def _numbers(fields: Mapping[str, Any], name: str, n: int, kind: type, default: Any
             ) -> list[Any]:
    """``tokenizer.ggml.NAME`` as n numbers of ``kind``, or n times ``default`` if absent."""
    value = fields.get(_KEY + name)
    if value is None:
        return [default] * n
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    if not ok or len(value) != n:
        raise _bad(f"{_KEY}{name} is not a list of {n} numbers, one per token")
    return [kind(x) for x in value]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise _bad(f"token {dup!r} appears twice in {_KEY}tokens")
    if not tokens:
        raise _bad(f"{_KEY}tokens is empty")
    return vocab


def _is_special(token: str, kind: int) -> bool:
    return kind in (CONTROL, UNKNOWN) or token in CONTROL_BY_NAME


def _added_tokens(tk: Any, tokens: Sequence[str], types: Sequence[int]
                  ) -> tuple[list[Any], list[Any]]:
    """(special, plain) added tokens: control/unknown, and user-defined."""
    special = [tk.AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=True) if _is_special(t, k)]
    plain = [tk.AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types, strict=True)
             if k == USER_DEFINED and not _is_special(t, k)]
    return special, plain


def _bpe_merges(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``"left right"`` strings as pairs (cut at the first space after the first
    character, as llama.cpp does); every part and its concatenation must be a token."""
    pairs = []
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1:]) if cut > 0 else ("", "")
        if not left or not right or left not in vocab or right not in vocab \
                or left + right not in vocab:
            raise _bad(f"merge {rank} ({merge!r}) of {_KEY}merges is not two tokens whose "
                       f"concatenation is a token")
        pairs.append((left, right))
    return pairs


def _pre_of(fields: Mapping[str, Any]) -> tuple[str, PreTokenizer]:
    name = fields.get(_KEY + "pre", "default")
    if name not in PRE_TOKENIZERS:
        raise DataError(f"GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
                        f"tinylm knows {', '.join(sorted(PRE_TOKENIZERS))}")
    return str(name), PRE_TOKENIZERS[name]


def _byte_level(fields: Mapping[str, Any], tokens: list[str], types: list[int]) -> Any:
    """The ``gpt2`` vocabulary as a ``tokenizers.Tokenizer``."""
    tk = _require_hf_tokenizers()
    vocab = _vocab(tokens)
    merges = _bpe_merges(_strings(fields, "merges"), vocab)
    _, pre = _pre_of(fields)
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizer_of(pre)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def pre_tokenizer_of(pre: PreTokenizer) -> Any:
    """The Hugging Face pre-tokenizer that cuts text as llama.cpp does for ``pre``: its
    regexes one after another, then the bytes as GPT-2's printable characters."""
    tk = _require_hf_tokenizers()
    return tk.pre_tokenizers.Sequence(
        [tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated") for r in pre.regexes]
        + [tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
                ) -> list[tuple[str, str]]:
    """The merges a score-ranked vocabulary implies: every split of a token into two
    tokens, best-scoring token first (ties: lower id, then the shorter left part)."""
    found = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, cut, left, right))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]


def _sentencepiece(fields: Mapping[str, Any], tokens: list[str], types: list[int]) -> Any:
    """The ``llama`` vocabulary as a ``tokenizers.Tokenizer``."""
    tk = _require_hf_tokenizers()
    vocab = _vocab(tokens)
    scores = _numbers(fields, "scores", len(tokens), float, 0.0)
    unk_id = fields.get(_KEY + "unknown_token_id", 0)
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    model = tk.models.BPE(vocab, _spm_merges(tokens, scores, vocab), unk_token=unk,
                          fuse_unk=True, byte_fallback=BYTE in types)
    tok = tk.Tokenizer(model)
    prefix = fields.get(_KEY + "add_space_prefix", True) is not False
    steps = [tk.normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = tk.normalizers.Sequence([*steps, tk.normalizers.Replace(" ", SPACE)])
    decode = [tk.decoders.Replace(SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    if prefix:
        decode.append(tk.decoders.Strip(" ", 1, 0))
    tok.decoder = tk.decoders.Sequence(decode)
    return tok


def tokenizer_from_gguf(fields: Mapping[str, Any]) -> BPETokenizer:
    """The tokenizer a GGUF file describes, from its metadata.

    ``fields`` maps GGUF metadata keys to plain Python values (str, int, float, bool,
    lists), as ``gguf.GGUFReader`` gives them decoded; only ``tokenizer.ggml.*`` keys are
    read. A vocabulary tinylm cannot rebuild exactly (another ``tokenizer.ggml.model``, an
    unknown ``tokenizer.ggml.pre``, malformed lists) is a one-line DataError naming it.
    """
    model = _model_of(fields)
    tokens = _strings(fields, "tokens")
    types = _numbers(fields, "token_type", len(tokens), int, NORMAL)
    build = _byte_level if model == "gpt2" else _sentencepiece
    try:
        tok = build(fields, tokens, types)
        special, plain = _added_tokens(_require_hf_tokenizers(), tokens, types)
        tok.add_special_tokens(special)
        tok.add_tokens(plain)
    except DataError:
        raise
    except Exception as exc:  # the Rust library's refusals
        raise _bad(f"tokenizers cannot build it ({_first_line(exc)})") from exc
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise _bad(f"its added tokens give {tok.get_vocab_size(with_added_tokens=True)} ids "
                   f"for {len(tokens)} tokens")
    return BPETokenizer(tok, kind="file")


def _token_at(fields: Mapping[str, Any], tokens: Sequence[str], key: str,
              default: int | None = None) -> str | None:
    i = fields.get(_KEY + key, default)
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens):
        return None  # llama.cpp ignores an id outside the vocabulary too
    return tokens[i]


def _flag(fields: Mapping[str, Any], key: str, default: bool) -> bool:
    value = fields.get(_KEY + key)
    return value if isinstance(value, bool) else default


def special_tokens_of_gguf(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The special tokens and flags of a GGUF tokenizer, under the key names of Hugging
    Face's ``tokenizer_config.json``.

    ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` (token strings or None, from
    ``tokenizer.ggml.bos_token_id``, ...; for a ``llama`` vocabulary that names none,
    llama.cpp's defaults 1, 2 and 0), ``eot_token`` (``eot_token_id``, else
    ``eom_token_id``, else the first of :data:`EOT_NAMES` in the vocabulary),
    ``add_bos_token``/``add_eos_token`` (the file's flags, else llama.cpp's defaults: a
    ``llama`` vocabulary and ``llama-bpe`` add bos, the others nothing) and
    ``chat_template`` (``tokenizer.chat_template`` or None).
    """
    model = _model_of(fields)
    tokens = _strings(fields, "tokens")
    spm = model == "llama"
    eot = _token_at(fields, tokens, "eot_token_id") or _token_at(fields, tokens, "eom_token_id")
    if eot is None:
        present = set(tokens)
        eot = next((t for t in EOT_NAMES if t in present), None)
    add_bos = True if spm else _pre_of(fields)[1].add_bos
    template = fields.get("tokenizer.chat_template")
    return {
        "bos_token": _token_at(fields, tokens, "bos_token_id", 1 if spm else None),
        "eos_token": _token_at(fields, tokens, "eos_token_id", 2 if spm else None),
        "unk_token": _token_at(fields, tokens, "unknown_token_id", 0 if spm else None),
        "pad_token": _token_at(fields, tokens, "padding_token_id"),
        "eot_token": eot,
        "add_bos_token": _flag(fields, "add_bos_token", add_bos),
        "add_eos_token": _flag(fields, "add_eos_token", False),
        "chat_template": template if isinstance(template, str) else None,
    }


__all__ = [
    "CONTROL_BY_NAME",
    "EOT_NAMES",
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "pre_tokenizer_of",
    "special_tokens_of_gguf",
    "tokenizer_from_gguf",
]
