"""GGUF tokenizers out: a tinylm tokenizer as llama.cpp's ``tokenizer.ggml.*`` metadata.

The inverse of :mod:`tinylm.data.gguf_vocab`: :func:`gguf_vocab_fields` gives the keys a
GGUF file needs for llama.cpp to cut text into the ids tinylm's tokenizer gives, and to
know its special tokens and chat template. Two vocabulary kinds, as llama.cpp reads them,
for three kinds of tinylm tokenizer:

byte-level BPE (``bpe``, ``gpt2``, and ``file`` tokenizers that are byte-level BPE)
    ``tokenizer.ggml.model = "gpt2"``: the tokens in their byte-level spelling (``Ġthe``),
    the merges as ``"left right"`` in rank order, and ``tokenizer.ggml.pre``, the name of
    llama.cpp's pre-tokenizer that cuts text as the tokenizer's own does
    (:func:`pre_tokenizer_name`): GPT-2's regex (``ByteLevel`` with its regex, what
    ``tinylm prepare`` trains) is ``gpt-2``; ``Digits`` then GPT-2's is ``smollm``
    (SmolLM2's tokenizer.json); a tokenizer read from a GGUF file has the regexes of one
    entry of :data:`~tinylm.data.gguf_vocab.PRE_TOKENIZERS`, written back under that
    entry's first name. Any other pre-tokenizer, a normalizer, or a decoder other than
    ``ByteLevel`` is refused by name (llama.cpp would cut the text differently).
SentencePiece-style (``file`` tokenizers read from a GGUF ``llama`` vocabulary, or alike)
    ``tokenizer.ggml.model = "llama"``: the pieces (``▁the``, ``<0x0A>``), their types
    (byte pieces of a byte-fallback vocabulary are type 6), ``add_space_prefix`` from the
    normalizer, and scores in the merges' order: llama.cpp merges the neighbours whose
    concatenation scores best, which is Hugging Face's merge order when the merges are
    every split of a token into two tokens, each token's splits together (how
    :mod:`tinylm.data.gguf_vocab` builds them); other merges, normalizers or a
    pre-tokenizer are refused.
char (one token per Unicode character)
    llama.cpp has no character vocabulary, but its SentencePiece tokenizer
    (``tokenizer.ggml.model = "llama"``) is one when no token is the concatenation of
    two others: it cuts the text into characters, merges adjacent pieces only when their
    concatenation is a token, and looks each piece up. So the characters are written as
    SentencePiece pieces (the space as ``▁``, as llama.cpp spells it), with
    ``add_space_prefix = false`` and equal scores. A character llama.cpp would spell
    differently (``▁`` itself) or a special token that is two others joined (which
    llama.cpp would merge) is refused. Text with a character the tokenizer never saw is
    an error in tinylm (unless ``--unknown replace``) and in llama.cpp alike.

Token types are llama.cpp's: special tokens are control (3; ``<unk>`` unknown, 2),
non-special added tokens user-defined (4), the rest normal (1). When the model has more
embedding rows than the tokenizer has tokens, the extra rows get ``[PAD<i>]`` tokens of
type unused (5), as llama.cpp's own converter writes them.

Special tokens: bos (the tokenizer's own, else its end-of-text token, as GPT-2 has it),
eos, unk, pad, end of turn (its own, else tinylm's ``<|end|>`` when the chat template is
tinylm's), ``add_bos_token`` (the tokenizer's setting, default false), ``add_eos_token``
false, and ``tokenizer.chat_template`` (:attr:`Tokenizer.chat_template`: the model's own
template, else tinylm's when the vocabulary has the chat tokens).

Values are plain Python: a bool, an int (written as uint32), a str, or a list of str,
int (int32) or float (float32); the writer (:mod:`tinylm.io.gguf_out`) types them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinylm.core.errors import DataError
from tinylm.data.gguf_vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    SPACE,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    pre_tokenizer_of,
)
from tinylm.data.tokenizers import (
    CHAT_TEMPLATE,
    END_OF_TURN,
    UNK,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    _require_hf_tokenizers,
)

_KEY = "tokenizer.ggml."
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")

# Hugging Face pre-tokenizers (as tokenizer.json spells them, offsets settings aside) that
# cut text as one of llama.cpp's named pre-tokenizers does.
_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_HF_PRE = {
    "gpt-2": _GPT2_BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _GPT2_BYTE_LEVEL]},
}


def _without_offsets(value: Any) -> Any:
    """A pre-tokenizer's JSON without ``trim_offsets`` (it changes spans, not ids)."""
    if isinstance(value, dict):
        return {k: _without_offsets(v) for k, v in value.items() if k != "trim_offsets"}
    if isinstance(value, list):
        return [_without_offsets(v) for v in value]
    return value


def _llama_cpp_pres() -> dict[str, Any]:
    """The first name of each distinct pre-tokenizer of PRE_TOKENIZERS -> (its JSON,
    ignore_merges), as :mod:`tinylm.data.gguf_vocab` builds it."""
    tk = _require_hf_tokenizers()
    found: dict[str, Any] = {}
    for name, pre in PRE_TOKENIZERS.items():
        if any(spec == pre for _, spec in found.values()):
            continue
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = pre_tokenizer_of(pre)
        found[name] = (_without_offsets(json.loads(tok.to_str())["pre_tokenizer"]), pre)
    return found


def pre_tokenizer_name(tokenizer: BPETokenizer) -> str:
    """``tokenizer.ggml.pre`` for a byte-level BPE tokenizer: llama.cpp's name for the
    pre-tokenizer that cuts text as ``tokenizer``'s does; a DataError naming it if none."""
    cfg = tokenizer.to_hf_json()
    pre = _without_offsets(cfg.get("pre_tokenizer"))
    ignore_merges = bool((cfg.get("model") or {}).get("ignore_merges", False))
    what = f"this {tokenizer.kind} tokenizer"
    if cfg.get("normalizer") is not None:
        kind = (cfg["normalizer"] or {}).get("type", "?")
        raise DataError(f"{what} has a {kind} normalizer, which llama.cpp does not run; it "
                        f"has no GGUF form (nothing was written)")
    if (cfg.get("decoder") or {}).get("type") != "ByteLevel":
        raise DataError(f"{what} is not byte-level BPE (its decoder is not ByteLevel); "
                        f"tinylm writes byte-level BPE and char tokenizers to GGUF")
    for name, want in _HF_PRE.items():
        if pre == want and not ignore_merges:
            return name
    for name, (want, spec) in _llama_cpp_pres().items():
        if pre == want and ignore_merges == spec.ignore_merges:
            return name
    shown = json.dumps(pre)[:120]
    raise DataError(f"{what}'s pre-tokenizer ({shown}) matches none of llama.cpp's "
                    f"(tinylm writes gpt-2, smollm and those of GGUF files it read); it "
                    f"has no GGUF form (nothing was written)")


def _merges(tokenizer: BPETokenizer) -> list[str]:
    merges = (tokenizer.to_hf_json().get("model") or {}).get("merges") or []
    out = [m if isinstance(m, str) else " ".join(m) for m in merges]
    bad = next((m for m in merges if not isinstance(m, str) and any(" " in p for p in m)),
               None)
    if bad is not None:
        raise DataError(f"merge {bad!r} has a space inside a token, which GGUF's "
                        f"\"left right\" merges cannot spell (nothing was written)")
    return out


def _byte_level(tokenizer: BPETokenizer) -> dict[str, Any]:
    """tokens, types, merges and pre of a byte-level BPE tokenizer."""
    hf = tokenizer.hf
    tokens = [hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    if any(t is None for t in tokens):
        missing = tokens.index(None)
        raise DataError(f"this {tokenizer.kind} tokenizer has no token with id {missing} "
                        f"(its ids have gaps), so it cannot be written as a GGUF token list")
    cfg = tokenizer.to_hf_json()
    added = {t["content"]: t.get("special", False) for t in cfg.get("added_tokens", [])}
    types = [(CONTROL if added[t] else USER_DEFINED) if t in added else NORMAL
             for t in tokens]
    return {"model": "gpt2", "pre": pre_tokenizer_name(tokenizer), "tokens": tokens,
            "token_type": types, "merges": _merges(tokenizer)}


def _char_level(tokenizer: CharTokenizer) -> dict[str, Any]:
    """The characters as SentencePiece pieces that llama.cpp never merges."""
    if SPACE in tokenizer.chars:
        raise DataError(f"this char tokenizer has the character {SPACE!r} (U+2581), which "
                        f"llama.cpp's SentencePiece vocabulary uses for the space; it has "
                        f"no GGUF form (nothing was written)")
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    vocab = set(tokens)
    for special in tokenizer.special_tokens:
        cut = next((i for i in range(1, len(special))
                    if special[:i] in vocab and special[i:] in vocab), None)
        if cut is not None:
            raise DataError(f"special token {special!r} is {special[:cut]!r} + "
                            f"{special[cut:]!r}, two tokens that llama.cpp would merge into "
                            f"it; rename the special token (nothing was written)")
    specials = set(tokenizer.special_tokens)
    types = [(UNKNOWN if t == UNK else CONTROL) if t in specials else NORMAL for t in tokens]
    pieces = [t if t in specials else t.replace(" ", SPACE) for t in tokens]
    return {"model": "llama", "tokens": pieces, "token_type": types,
            "scores": [0.0] * len(tokens), "add_space_prefix": False}


def _spm_normalizer(prefix: bool) -> Any:
    """The normalizer JSON :mod:`tinylm.data.gguf_vocab` gives a SentencePiece vocabulary
    (``▁`` before the text when ``prefix``, spaces as ``▁``)."""
    tk = _require_hf_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    steps = [tk.normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = tk.normalizers.Sequence([*steps, tk.normalizers.Replace(" ", SPACE)])
    return json.loads(tok.to_str())["normalizer"]


def _spm_scores(tokens: list[str], merges: list[tuple[str, ...]]) -> list[float]:
    """Scores whose order is the merges' order: llama.cpp's SentencePiece tokenizer merges
    the neighbours whose concatenation scores best, Hugging Face's BPE the best-ranked
    pair; they agree when the merges are every split of a token into two tokens, a
    token's splits together (as :mod:`tinylm.data.gguf_vocab` builds them). Anything
    else is a DataError."""
    vocab = set(tokens)
    splits = {(t[:i], t[i:]) for t in tokens for i in range(1, len(t))
              if t[:i] in vocab and t[i:] in vocab}
    order: dict[str, int] = {}
    last = None
    for merge in merges:
        token = "".join(merge)
        if token in order and token != last:
            raise DataError(f"this SentencePiece-style tokenizer's merges for {token!r} are "
                            f"not together, so no token scores give llama.cpp its merge "
                            f"order (nothing was written)")
        order.setdefault(token, len(order))
        last = token
    if set(merges) != splits:
        raise DataError("this SentencePiece-style tokenizer's merges are not every split of "
                        "a token into two tokens, which is what llama.cpp's SentencePiece "
                        "tokenizer merges; it has no GGUF form (nothing was written)")
    return [-1.0 - order[t] if t in order else 0.0 for t in tokens]


def _sentencepiece(tokenizer: BPETokenizer) -> dict[str, Any]:
    """tokens, types, scores and the space prefix of a SentencePiece-style tokenizer of
    the shape :mod:`tinylm.data.gguf_vocab` reads (a GGUF ``llama`` vocabulary)."""
    cfg = tokenizer.to_hf_json()
    model = cfg.get("model") or {}
    prefix = next((p for p in (True, False) if cfg.get("normalizer") == _spm_normalizer(p)),
                  None)
    if prefix is None or cfg.get("pre_tokenizer") is not None or model.get("type") != "BPE":
        raise DataError(f"this {tokenizer.kind} tokenizer is SentencePiece-style (▁ for "
                        f"spaces) but not as llama.cpp runs one (a normalizer that puts ▁ "
                        f"before the text and for each space, no pre-tokenizer); it has no "
                        f"GGUF form (nothing was written)")
    tokens = [tokenizer.hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    if any(t is None for t in tokens):
        raise DataError(f"this {tokenizer.kind} tokenizer's ids have gaps, so it cannot be "
                        f"written as a GGUF token list")
    added = {t["content"]: t.get("special", False) for t in cfg.get("added_tokens", [])}
    unk, fallback = model.get("unk_token"), bool(model.get("byte_fallback"))

    def kind(t: str) -> int:
        if t == unk:
            return UNKNOWN
        if t in added:
            return CONTROL if added[t] else USER_DEFINED
        return BYTE if fallback and _BYTE_PIECE.fullmatch(t) else NORMAL

    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in model.get("merges") or []]
    return {"model": "llama", "tokens": tokens, "token_type": [kind(t) for t in tokens],
            "scores": _spm_scores(tokens, merges), "add_space_prefix": prefix}


def _vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    if isinstance(tokenizer, CharTokenizer):
        return _char_level(tokenizer)
    if isinstance(tokenizer, BPETokenizer) and tokenizer.byte_level:
        return _byte_level(tokenizer)
    if isinstance(tokenizer, BPETokenizer) and tokenizer.metaspace:
        return _sentencepiece(tokenizer)
    raise DataError(f"this {tokenizer.kind} tokenizer is neither byte-level BPE, nor "
                    f"SentencePiece-style, nor a char tokenizer; tinylm writes those kinds "
                    f"to GGUF (nothing was written)")


def _padded(vocab: dict[str, Any], n_rows: int) -> None:
    """Extra embedding rows as ``[PAD<i>]`` tokens of type unused (in place)."""
    n = len(vocab["tokens"])
    if n > n_rows:
        raise DataError(f"the tokenizer has {n} tokens but the model only {n_rows} embedding "
                        f"rows; the checkpoint mixes a model and another tokenizer")
    taken = set(vocab["tokens"])
    extra = [f"[PAD{i}]" for i in range(n, n_rows)]
    if taken & set(extra):
        raise DataError(f"the tokenizer already has a token {sorted(taken & set(extra))[0]}; "
                        f"tinylm names the model's extra rows so (nothing was written)")
    vocab["tokens"] += extra
    vocab["token_type"] += [UNUSED] * len(extra)
    if "scores" in vocab:
        vocab["scores"] += [0.0] * len(extra)


def _end_of_turn(tokenizer: Tokenizer) -> int | None:
    """The end-of-turn id llama.cpp stops at besides eos: the model's own, else
    tinylm's ``<|end|>`` under tinylm's chat template."""
    own = [t for t in tokenizer.settings.end_of_turn if t != tokenizer.settings.eos_token]
    if own:
        return tokenizer.token_to_id(own[0])
    if tokenizer.chat_template == CHAT_TEMPLATE and END_OF_TURN in tokenizer.special_tokens:
        return tokenizer.token_to_id(END_OF_TURN)
    return None


def _special_ids(tokenizer: Tokenizer) -> dict[str, Any]:
    s = tokenizer.settings
    ids = {"bos_token_id": tokenizer.bos_id if tokenizer.bos_id is not None
           else tokenizer.eos_id,
           "eos_token_id": tokenizer.eos_id,
           "unknown_token_id": tokenizer.token_to_id(s.unk_token) if s.unk_token
           else tokenizer.token_to_id(UNK) if UNK in tokenizer.special_tokens else None,
           "padding_token_id": tokenizer.token_to_id(s.pad_token) if s.pad_token else None,
           "eot_token_id": _end_of_turn(tokenizer)}
    out: dict[str, Any] = {k: v for k, v in ids.items() if v is not None}
    out["add_bos_token"] = bool(s.add_bos_token)
    out["add_eos_token"] = False
    return out


def gguf_vocab_fields(tokenizer: Tokenizer, n_rows: int) -> dict[str, Any]:
    """The GGUF metadata (full key names -> plain values) of ``tokenizer`` for a model of
    ``n_rows`` embedding rows: the vocabulary, its special tokens and the chat template.
    A tokenizer llama.cpp cannot reproduce is a one-line DataError saying why."""
    vocab = _vocabulary(tokenizer)
    _padded(vocab, n_rows)
    fields = {_KEY + k: v for k, v in vocab.items()}
    fields.update({_KEY + k: v for k, v in _special_ids(tokenizer).items()})
    template = tokenizer.chat_template
    if template is not None:
        fields["tokenizer.chat_template"] = template
    return fields


__all__ = ["gguf_vocab_fields", "pre_tokenizer_name"]
