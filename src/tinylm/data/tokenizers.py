"""Tokenizers: text <-> token ids, three kinds behind one interface, one JSON format.

Kinds
    char   one token per Unicode code point seen in the corpus (Japanese, emoji and
           accents are single tokens). Unseen characters raise a DataError that names
           them, or map to an ``<unk>`` token when the tokenizer was built with
           ``unknown="replace"``. Encoding is a dense code-point lookup table in numpy.
    bpe    byte-level BPE trained on the corpus with Hugging Face ``tokenizers``;
           lossless on any text because every byte is in the base alphabet.
    gpt2   GPT-2's own files (vocab.json + merges.txt, or a GPT-2 tokenizer.json)
           loaded from disk; nothing is ever downloaded.
    file   any other Hugging Face tokenizer.json a user already has.

One file format: ``save(path)`` always writes a single Hugging Face ``tokenizers``
JSON (a char tokenizer is a BPE model with no merges and a Fuse decoder), so
``tokenizers.Tokenizer.from_file`` and ``transformers`` can read every tinylm
tokenizer, and :func:`load_tokenizer` reads any of them back and recognises the kind.

Special tokens only on purpose: ``encode(text)`` never adds special tokens and never
turns text into a special id, even when the text contains a special token's literal
spelling such as ``<|endoftext|>`` (it is encoded as ordinary characters or bytes);
``encode(text, allow_special=True)`` matches the spellings in the text instead. The
caller decides where an end-of-text token goes (``eos_id``).

Chat: :data:`STANDARD_SPECIALS` are the end-of-text token and the chat format's role
tokens (``<|system|>``, ``<|user|>``, ``<|assistant|>``) and end of turn (``<|end|>``);
``tinylm prepare`` gives every tokenizer it builds these. A tokenizer that has the role
tokens has a :attr:`Tokenizer.chat_template` (:data:`CHAT_TEMPLATE`, Jinja2, the one
exported as Hugging Face ``chat_template``); :mod:`tinylm.data.chat` renders conversations.

A tokenizer may carry a model's own :class:`~tinylm.data.templates.TokenizerSettings`
(chat template, bos/eos/pad/unk, ``add_bos_token``, end-of-turn tokens;
:meth:`Tokenizer.with_settings`), kept beside its tokenizer.json as ``tokenizer_config.json``
(:mod:`tinylm.data.templates`) and read back by :func:`load_tokenizer`.
"""

from __future__ import annotations

import codecs
import copy
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data.templates import TokenizerSettings, end_of_turn_tokens

log = logging.getLogger(__name__)

UNK = "<unk>"
#: Names recognised as the end-of-text token, in order of preference.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>")
UNKNOWN_POLICIES = ("error", "replace")

EOS = "<|endoftext|>"
#: The chat format's role tokens, one per role, and the token that ends every turn.
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END_OF_TURN)
#: The special tokens ``tinylm prepare`` gives every tokenizer it builds, in id order.
STANDARD_SPECIALS = (EOS, *CHAT_TOKENS)
#: The chat template (Jinja2, as Hugging Face ``apply_chat_template`` runs it): each turn
#: is its role token, the content, then <|end|>; the generation prompt is <|assistant|>.
#: No spaces or newlines are added, so a turn's ids are exactly
#: ``[role] + encode(content) + [end]`` for every tokenizer kind.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat roles are system, user and assistant') -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def standard_special_tokens(extra: Sequence[str] = ()) -> list[str]:
    """:data:`STANDARD_SPECIALS` followed by ``extra`` (duplicates dropped)."""
    return list(dict.fromkeys([*STANDARD_SPECIALS, *extra]))


class Tokenizer(ABC):
    """The interface every tokenizer kind implements.

    ``encode`` maps text to ids and ``decode`` maps them back; for char (without
    unknown characters), bpe and gpt2 tokenizers ``decode(encode(s)) == s``.
    """

    kind: str
    #: The model's own chat template and special-token roles (empty: tinylm's defaults).
    _settings: TokenizerSettings = TokenizerSettings()

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """V, the number of distinct ids (the model's embedding rows)."""

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; no special tokens added, and a special token's spelling
        in the text is ordinary text unless ``allow_special``."""

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False
                     ) -> list[list[int]]:
        """``[encode(t) for t in texts]``, done in parallel where the kind allows."""
        return [self.encode(t, allow_special=allow_special) for t in texts]

    @abstractmethod
    def encode_array(self, texts: Sequence[str], *, allow_special: bool = False
                     ) -> np.ndarray:
        """The ids of the concatenation of ``texts`` as one uint32 array (fast path).

        Callers must split the text only where tokenization does not look across the
        cut (see :func:`tinylm.data.encoding.safe_split`); for char tokenizers any cut works.
        """

    @abstractmethod
    def encode_offsets(self, text: str, *, allow_special: bool = False
                       ) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each token's (start, end) character span in ``text`` (as
        Hugging Face ``tokenizers`` reports them; what a chat template's mask needs)."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""

    @abstractmethod
    def id_to_token(self, i: int) -> str:
        """A display string for one token: its text, with bytes that are not whole
        UTF-8 characters shown as ``\\xNN`` escapes."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a token given as :meth:`id_to_token` shows it, or None."""

    def token_bytes(self, i: int) -> bytes | None:
        """The bytes token ``i`` adds to decoded text, or None for a special token (what
        a grammar engine matches generated text against, byte by byte)."""
        if self.id_to_token(i) in self.special_tokens:
            return None
        return self.decode([i]).encode("utf-8")

    @abstractmethod
    def to_hf_json(self) -> dict[str, Any]:
        """The Hugging Face ``tokenizers`` JSON document of this tokenizer."""

    @property
    @abstractmethod
    def special_tokens(self) -> tuple[str, ...]:
        """Special tokens (e.g. ``<|endoftext|>``, ``<unk>``), possibly empty."""

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-text token: the settings' eos_token, else the first of
        :data:`EOS_NAMES` the vocabulary has as a special token, else None."""
        if self._settings.eos_token is not None:
            return self.token_to_id(self._settings.eos_token)
        for name in EOS_NAMES:
            if name in self.special_tokens:
                return self.token_to_id(name)
        return None

    @property
    def bos_id(self) -> int | None:
        """Id of the settings' bos_token, or None."""
        bos = self._settings.bos_token
        return None if bos is None else self.token_to_id(bos)

    @property
    def settings(self) -> TokenizerSettings:
        """The model's chat template and special-token roles (see the module docstring)."""
        return self._settings

    def with_settings(self, settings: TokenizerSettings) -> Tokenizer:
        """A copy carrying ``settings``; a DataError when it names a token that is not
        in the vocabulary."""
        missing = settings.missing_tokens(self.token_to_id)
        if missing:
            raise DataError(f"the tokenizer config names {missing[0]}, which is not in this "
                            f"{self.kind} tokenizer's vocabulary; fix the config")
        new = copy.copy(self)  # the vocabulary is shared: settings change no id
        new._settings = settings
        return new

    def encode_prompt(self, text: str, *, allow_special: bool = False) -> list[int]:
        """The ids of a prompt for generation or evaluation: bos first when the model
        asks for it (``add_bos_token``), then ``encode(text)``."""
        return self.prompt_prefix() + self.encode(text, allow_special=allow_special)

    def prompt_prefix(self) -> list[int]:
        """``[bos]`` when the model's prompts start with it (``add_bos_token``), else []."""
        bos = self.bos_id
        return [bos] if self._settings.add_bos_token and bos is not None else []

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template, else :data:`CHAT_TEMPLATE` when the vocabulary
        has every chat token, else None."""
        if self._settings.chat_template is not None:
            return self._settings.chat_template
        return CHAT_TEMPLATE if set(CHAT_TOKENS) <= set(self.special_tokens) else None

    @property
    def own_template(self) -> str | None:
        """The model's chat template when it is not tinylm's own format, else None."""
        template = self._settings.chat_template
        return None if template in (None, CHAT_TEMPLATE) else template

    @property
    def end_of_turn_ids(self) -> list[int]:
        """Ids that end an answer in the model's own template: eos and its end-of-turn
        tokens (:func:`tinylm.data.templates.end_of_turn_tokens`)."""
        found = end_of_turn_tokens(self._settings, self.special_tokens)
        return list(dict.fromkeys(i for i in [*map(self.token_to_id, found), self.eos_id]
                                  if i is not None))

    def special_id(self, token: str) -> int:
        """The id of special token ``token``; a DataError naming the fix if absent."""
        if token not in self.special_tokens:
            raise DataError(f"this {self.kind} tokenizer has no special token {token}; "
                            f"prepare the data again with tinylm prepare (it adds "
                            f"{', '.join(STANDARD_SPECIALS)})")
        found = self.token_to_id(token)
        assert found is not None
        return found

    @abstractmethod
    def with_special_tokens(self, tokens: Sequence[str]) -> Tokenizer:
        """A copy with ``tokens`` that it lacks added as special tokens, with new ids
        after every existing id (so ids a model already knows keep their meaning)."""

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as one ``tokenizer.json`` (a file path or a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.write_text(json.dumps(self.to_hf_json(), ensure_ascii=False), encoding="utf-8")
        return path

    def _keeping(self, other: Tokenizer) -> Tokenizer:
        """``self`` with ``other``'s settings (a copy of a tokenizer keeps them)."""
        self._settings = other._settings
        return self

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][:5].tolist()
            raise DataError(
                f"token id(s) {bad} out of range for this {self.kind} tokenizer with "
                f"vocab_size {self.vocab_size}; the ids come from a different tokenizer"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _split_specials(text: str, specials: Sequence[str]) -> list[str]:
    """``text`` cut at special-token spellings: [text, special, text, ..., text]
    (the longest spelling wins where several match)."""
    pattern = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
    return re.split(f"({pattern})", text)


def _char_label(c: str) -> str:
    return f"{c!r} (U+{ord(c):04X})"


class CharTokenizer(Tokenizer):
    """One token per Unicode code point, ids in code-point order.

    ``chars`` is the alphabet; ``unknown`` says what encoding an unseen character
    does: "error" raises a DataError naming it, "replace" maps it to ``<unk>`` (an
    extra special token, decoded as the text ``<unk>``). Extra ``special_tokens``
    get ids after the characters; they are never produced by encoding text.
    """

    kind = "char"

    def __init__(self, chars: Iterable[str], unknown: str = "error",
                 special_tokens: Sequence[str] = ()) -> None:
        if unknown not in UNKNOWN_POLICIES:
            raise DataError(f"unknown-character policy must be 'error' or 'replace', "
                            f"got {unknown!r}")
        alphabet = sorted(set(chars), key=ord)
        if any(len(c) != 1 for c in alphabet):
            raise DataError("a char tokenizer's alphabet must be single characters")
        # <unk> keeps the place it is given (it comes last unless listed); without
        # "replace" there is no <unk>.
        specials = [s for s in dict.fromkeys(special_tokens) if s != UNK or unknown == "replace"]
        if unknown == "replace" and UNK not in specials:
            specials.append(UNK)
        if any(not isinstance(s, str) or len(s) < 2 for s in specials):
            raise DataError("special tokens must be strings of two or more characters")
        if set(specials) & set(alphabet):
            raise DataError(f"special tokens {sorted(set(specials) & set(alphabet))} clash "
                            f"with characters; use multi-character special tokens")
        self.unknown = unknown
        self._chars = alphabet
        self._specials = tuple(specials)
        self._itos = alphabet + list(specials)
        self._stoi = {s: i for i, s in enumerate(self._itos)}
        self._unk_id = self._stoi.get(UNK) if unknown == "replace" else None
        top = ord(alphabet[-1]) + 1 if alphabet else 1
        # Dense code point -> id table; -1 marks characters outside the alphabet.
        self._table = np.full(top, -1, dtype=np.int32)
        if alphabet:
            self._table[[ord(c) for c in alphabet]] = np.arange(len(alphabet), dtype=np.int32)
        self._itos_arr = np.array(self._itos, dtype=object)

    @classmethod
    def from_code_points(cls, seen: np.ndarray, unknown: str = "error",
                         special_tokens: Sequence[str] = ()) -> CharTokenizer:
        """Build from a boolean mask over code points (what a streaming scan collects)."""
        chars = [chr(int(cp)) for cp in np.flatnonzero(seen)]
        return cls(chars, unknown=unknown, special_tokens=special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def chars(self) -> list[str]:
        return list(self._chars)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self._specials

    def _lookup(self, code_points: np.ndarray) -> np.ndarray:
        table = self._table
        if not code_points.size or int(code_points.max()) < table.size:
            ids = table[code_points]
        else:
            inside = code_points < table.size
            ids = np.full(code_points.shape, -1, dtype=np.int32)
            ids[inside] = table[code_points[inside]]
        if ids.size and ids.min() < 0:
            missing = ids < 0
            if self._unk_id is not None:
                ids[missing] = self._unk_id
            else:
                bad = np.unique(code_points[missing])
                shown = ", ".join(_char_label(chr(int(c))) for c in bad[:10])
                more = f" and {bad.size - 10} more" if bad.size > 10 else ""
                raise DataError(
                    f"text has {bad.size} character(s) this char tokenizer never saw: "
                    f"{shown}{more}; remove them from the text, or re-prepare the data "
                    f"with 'tinylm prepare --unknown replace' to map them to {UNK}"
                )
        return ids

    @staticmethod
    def code_points(text: str) -> np.ndarray:
        """The code points of ``text`` as a uint32 array (one per character)."""
        if text.isascii():
            return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.uint32)
        try:
            raw = text.encode("utf-32-le")
        except UnicodeEncodeError as exc:  # lone surrogates from a Python caller
            raise DataError(f"text contains an unpaired surrogate at index {exc.start}; "
                            f"pass valid Unicode text") from exc
        return np.frombuffer(raw, dtype=np.uint32)

    @staticmethod
    def seen_code_points(text: str, seen: np.ndarray) -> None:
        """Mark the code points of ``text`` in the boolean mask ``seen`` (0x110000,)."""
        cp = CharTokenizer.code_points(text)
        if cp.size:
            counts = np.bincount(cp, minlength=1)
            seen[: counts.size] |= counts > 0

    def encode_array(self, texts: Sequence[str], *, allow_special: bool = False
                     ) -> np.ndarray:
        text = texts if isinstance(texts, str) else "".join(texts)
        if allow_special and self._specials:
            parts = [np.asarray([self._stoi[p]], dtype=np.int32) if i % 2 else
                     self._lookup(self.code_points(p))
                     for i, p in enumerate(_split_specials(text, self._specials))]
            return np.concatenate(parts).view(np.uint32)
        # Special tokens are several characters long and encoding is per character,
        # so text never becomes a special id here.
        return self._lookup(self.code_points(text)).view(np.uint32)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return self.encode_array(text, allow_special=allow_special).tolist()

    def encode_offsets(self, text: str, *, allow_special: bool = False
                       ) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self.encode(text, allow_special=allow_special)
        pieces = _split_specials(text, self._specials) if allow_special and self._specials \
            else [text]
        offsets, pos = [], 0
        for i, piece in enumerate(pieces):
            spans = [(pos, pos + len(piece))] if i % 2 else \
                [(pos + j, pos + j + 1) for j in range(len(piece))]
            offsets += spans
            pos += len(piece)
        return ids, offsets

    def with_special_tokens(self, tokens: Sequence[str]) -> CharTokenizer:
        new = [t for t in dict.fromkeys(tokens) if t not in self._stoi]
        return CharTokenizer(self._chars, unknown=self.unknown,
                             special_tokens=[*self._specials, *new])._keeping(self)

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        self._check_ids(arr)
        return "".join(self._itos_arr[arr].tolist())

    def id_to_token(self, i: int) -> str:
        return self._itos[int(i)]

    def token_to_id(self, token: str) -> int | None:
        return self._stoi.get(token)

    def to_hf_json(self) -> dict[str, Any]:
        # A BPE model without merges is exactly a character lookup in HF tokenizers;
        # the Fuse decoder concatenates tokens without spaces.
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": self._stoi[s], "content": s, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True}
                for s in self._specials
            ],
            "normalizer": None,
            "pre_tokenizer": None,
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {
                "type": "BPE", "dropout": None,
                "unk_token": UNK if self.unknown == "replace" else None,
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": dict(self._stoi), "merges": [],
            },
        }


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, character -> byte direction."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_ENCODER = {b: c for c, b in _BYTE_DECODER.items()}
_SPM_SPACE = "\u2581"  # SentencePiece's visible space
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _require_hf_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # a core dependency, but say so clearly
        raise DataError("the 'tokenizers' package is missing; reinstall tinylm "
                        "(pip install -e .)") from exc
    return tokenizers


class BPETokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer: trained byte-level BPE, GPT-2 files,
    or any tokenizer.json. ``kind`` is "bpe", "gpt2" or "file"."""

    def __init__(self, hf_tokenizer: Any, kind: str = "bpe") -> None:
        self._tok = hf_tokenizer
        self.kind = kind
        cfg = json.loads(hf_tokenizer.to_str())
        pre = cfg.get("pre_tokenizer") or {}
        self.byte_level = pre.get("type") == "ByteLevel" or (
            pre.get("type") == "Sequence"
            and any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers", []))
        )
        #: True when the JSON pre-tokenizer is exactly GPT-2's (cutting text at a
        #: space/newline before a non-space never changes the tokens).
        self.split_safe = pre == {"type": "ByteLevel", "add_prefix_space": False,
                                  "trim_offsets": pre.get("trim_offsets", True),
                                  "use_regex": True} and cfg.get("normalizer") is None
        self._specials = tuple(t["content"] for t in cfg.get("added_tokens", [])
                               if t.get("special"))
        #: True for a SentencePiece-style vocabulary (spaces spelled "▁", bytes as
        #: <0xNN> tokens): id_to_token shows both as text, as it does byte-level tokens.
        self.metaspace = not self.byte_level and _SPM_SPACE in json.dumps(
            cfg.get("decoder"), ensure_ascii=False)
        # User text never becomes a special id: special tokens' spellings are encoded
        # as ordinary text unless a call asks otherwise (allow_special).
        self._tok.encode_special_tokens = True

    # --- construction -------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096,
              special_tokens: Sequence[str] = (), length: int | None = None) -> BPETokenizer:
        """Train byte-level BPE (GPT-2's pre-tokenization, 256 byte base alphabet)."""
        tk = _require_hf_tokenizers()
        specials = list(dict.fromkeys(special_tokens))
        minimum = 256 + len(specials)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
            raise DataError(
                f"vocab size {vocab_size!r} is too small for byte-level BPE: it needs the "
                f"256 byte tokens plus {len(specials)} special token(s), so at least "
                f"{minimum}; use --vocab-size {max(minimum, 512)} or more (default 4096)"
            )
        if vocab_size > 2**32 - 1:
            raise DataError(f"vocab size {vocab_size} is too large; use at most 4294967295")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer, length=length)
        return cls(tok, kind="bpe")

    @classmethod
    def from_gpt2_files(cls, vocab: str | Path, merges: str | Path) -> BPETokenizer:
        """GPT-2 style vocab.json + merges.txt (byte-level BPE) from local files."""
        tk = _require_hf_tokenizers()
        try:
            model = tk.models.BPE.from_file(str(vocab), str(merges))
        except Exception as exc:
            raise DataError(f"cannot read GPT-2 tokenizer files {display_name(vocab)} and "
                            f"{display_name(merges)}: {_first_line(exc)}; check they are "
                            f"vocab.json and merges.txt from the same tokenizer") from exc
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        vocab_map = tok.get_vocab()
        tok.add_special_tokens([t for t in STANDARD_SPECIALS if t in vocab_map])
        return cls(tok, kind="gpt2")

    # --- interface ----------------------------------------------------------------------

    @property
    def hf(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self._specials

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return self._encode_batch([text], allow_special)[0].ids

    def _encode_batch(self, texts: Sequence[str], allow_special: bool = False,
                      offsets: bool = False) -> list[Any]:
        fast = self._tok.encode_batch if offsets else \
            getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        try:
            if not allow_special:
                return fast(list(texts), add_special_tokens=False)
            self._tok.encode_special_tokens = False
            try:
                return fast(list(texts), add_special_tokens=False)
            finally:
                self._tok.encode_special_tokens = True
        except Exception as exc:  # e.g. lone surrogates cannot cross into Rust
            raise DataError(f"cannot encode text with this {self.kind} tokenizer: "
                            f"{_first_line(exc)}; pass valid Unicode text") from exc

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False
                     ) -> list[list[int]]:
        return [e.ids for e in self._encode_batch(texts, allow_special)]

    def encode_offsets(self, text: str, *, allow_special: bool = False
                       ) -> tuple[list[int], list[tuple[int, int]]]:
        e = self._encode_batch([text], allow_special, offsets=True)[0]
        return list(e.ids), [tuple(o) for o in e.offsets]

    def encode_array(self, texts: Sequence[str], *, allow_special: bool = False
                     ) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        parts = [np.asarray(e.ids, dtype=np.uint32)
                 for e in self._encode_batch(texts, allow_special)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def with_special_tokens(self, tokens: Sequence[str]) -> BPETokenizer:
        tk = _require_hf_tokenizers()
        copy = tk.Tokenizer.from_str(self._tok.to_str())
        # A token already in the vocabulary as ordinary text keeps its id and becomes special.
        copy.add_special_tokens([t for t in dict.fromkeys(tokens) if t not in self._specials])
        return BPETokenizer(copy, kind=self.kind)._keeping(self)

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        self._check_ids(arr)
        return self._tok.decode(arr.tolist(), skip_special_tokens=False)

    def _token_bytes(self, token: str) -> bytes | None:
        if token in self._specials or not (self.byte_level or self.metaspace):
            return None
        if self.metaspace:
            byte = _SPM_BYTE.fullmatch(token)
            return bytes([int(byte[1], 16)]) if byte else token.replace(_SPM_SPACE, " ").encode()
        try:
            return bytes(_BYTE_DECODER[c] for c in token)
        except KeyError:
            return None

    def token_bytes(self, i: int) -> bytes | None:
        token = self._tok.id_to_token(int(i))
        if token is None or token in self._specials:
            return None
        raw = self._token_bytes(token)  # a byte-level or SentencePiece token's own bytes
        return raw if raw is not None else self._tok.decode([int(i)]).encode("utf-8")

    def id_to_token(self, i: int) -> str:
        token = self._tok.id_to_token(int(i))
        if token is None:
            raise DataError(f"token id {i} out of range for vocab_size {self.vocab_size}")
        raw = self._token_bytes(token)
        return token if raw is None else raw.decode("utf-8", errors="backslashreplace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials or not (self.byte_level or self.metaspace):
            return self._tok.token_to_id(token)
        candidates = [token.encode("utf-8")]
        if "\\x" in token:
            try:
                candidates.append(codecs.escape_decode(token.encode("utf-8"))[0])
            except ValueError:
                pass
        if self.metaspace:
            return self._spm_token_to_id(token, candidates)
        for raw in candidates:
            found = self._tok.token_to_id("".join(_BYTE_ENCODER[b] for b in raw))
            if found is not None:
                return found
        return self._tok.token_to_id(token)  # the raw byte-level spelling, e.g. "Ġthe"

    def _spm_token_to_id(self, token: str, candidates: list[bytes]) -> int | None:
        """A piece (spaces as "▁") whose text is the token, else a byte token <0xNN>."""
        for raw in candidates:
            try:
                found = self._tok.token_to_id(raw.decode("utf-8").replace(" ", _SPM_SPACE))
            except UnicodeDecodeError:
                found = None
            if found is None and len(raw) == 1:
                found = self._tok.token_to_id(f"<0x{raw[0]:02X}>")
            if found is not None:
                return found
        return self._tok.token_to_id(token)  # the raw spelling, e.g. "▁the" or "<0x0A>"

    def to_hf_json(self) -> dict[str, Any]:
        return json.loads(self._tok.to_str())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TOKENS",
    "END_OF_TURN",
    "EOS",
    "EOS_NAMES",
    "ROLE_TOKENS",
    "STANDARD_SPECIALS",
    "UNK",
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "standard_special_tokens",
]
