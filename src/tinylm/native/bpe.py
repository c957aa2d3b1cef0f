"""The native byte-level BPE encoder (``csrc/bpe.c``), equal to Hugging Face tokenizers.

    encoder = tinylm.native.bpe_encoder(tokenizer)   # a NativeBPE, or None: HF encodes
    ids, lengths = encoder.encode_lengths(texts)     # uint32 ids of all, int64 per text

:func:`bpe_encoder` decides once per tokenizer: it returns None (Hugging Face encodes, as
without this package) unless the fast paths are on (``TINYLM_NATIVE=0`` and
:func:`tinylm.native.disabled` turn it off) and the tokenizer is one whose encoding
``csrc/bpe.c`` reproduces exactly (:func:`ineligible` says why not): a BPE model without
dropout, byte fallback, ``ignore_merges`` or subword affixes, every byte in the
vocabulary, no normalizer, GPT-2's ``ByteLevel(add_prefix_space=False, use_regex=True)``
pre-tokenizer, and added tokens that are all special (user text never becomes a special
id, so they are plain text to it). ``allow_special=True`` stays with Hugging Face.

GPT-2's pattern needs each code point's class (``\\p{L}``, ``\\p{N}``, ``\\s``, other);
:func:`code_point_classes` builds that table from :mod:`unicodedata` once per process,
and tests/test_native_bpe.py proves it equal to HF's regex engine on every code point.
"""

from __future__ import annotations

import ctypes
import functools
import json
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
import tokenizers

from tinylm.core.errors import DataError
from tinylm.native import ops

N_CODES = 0x110000
OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3
#: Unicode's White_Space property: what the pattern's ``\s`` matches (tested against HF).
WHITE_SPACE = (*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
               0x2029, 0x202F, 0x205F, 0x3000)
_CLASS_OF = {"L": LETTER, "N": NUMBER}
#: Planes 4-16 hold no letter or number (unassigned, tags, variation selectors, private
#: use): the table's loop stops here (tested on every code point against HF).
ASSIGNED_END = 0x40000
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


@functools.cache
def code_point_classes() -> np.ndarray:
    """One byte per code point: 1 letter (``\\p{L}``), 2 number (``\\p{N}``), 3 white
    space (``\\s``), 0 anything else (marks, punctuation, symbols, controls, unassigned).

    From :mod:`unicodedata`, except for the code points this Python's Unicode database
    does not assign (it may be older than the regex engine's): those are classed by
    Hugging Face's own engine (onig), matching their runs of ``\\p{L}``, ``\\p{N}``, ``\\s``."""
    table = bytearray(N_CODES)
    category = unicodedata.category
    unassigned = []
    for c in range(ASSIGNED_END):
        cat = category(chr(c))
        cls = _CLASS_OF.get(cat[0])
        if cls:
            table[c] = cls
        elif cat == "Cn":
            unassigned.append(c)
    classes = np.frombuffer(bytes(table), dtype=np.uint8).copy()
    classes[list(WHITE_SPACE)] = SPACE
    return _engine_classes(classes, unassigned)


def _engine_classes(classes: np.ndarray, codes: list[int]) -> np.ndarray:
    """``classes`` with ``codes`` classed by HF's regex engine: first the runs of any of
    the three classes (one scan), then each class among those few."""
    def runs(pattern: str, text: str) -> list[tuple[int, int]]:
        split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="removed")
        return [span for _, span in split.pre_tokenize_str(text)]
    found = [c for a, b in runs(r"[^\p{L}\p{N}\s]+", "".join(map(chr, codes)))
             for c in codes[a:b]]
    text, where = "".join(map(chr, found)), np.array(found, dtype=np.int64)
    for cls, outside in ((LETTER, r"[^\p{L}]+"), (NUMBER, r"[^\p{N}]+"), (SPACE, r"[^\s]+")):
        for a, b in runs(outside, text):
            classes[where[a:b]] = cls
    return classes


@functools.cache
def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pair(merge: Any) -> tuple[str, str]:
    if isinstance(merge, str):
        a, _, b = merge.partition(" ")
        return a, b
    return merge[0], merge[1]


def ineligible(config: dict[str, Any]) -> str | None:
    """Why the tokenizer of this tokenizer.json document is not encoded natively (None:
    it is)."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model sets {key}"
    for key in ("byte_fallback", "ignore_merges"):
        if model.get(key):
            return f"the BPE model sets {key}"
    if config.get("normalizer") is not None:
        return "it has a normalizer"
    pre = dict(config.get("pre_tokenizer") or {})
    pre.pop("trim_offsets", None)
    if pre != _BYTE_LEVEL:
        return "the pre-tokenizer is not GPT-2's ByteLevel(add_prefix_space=False)"
    if any(not t.get("special") for t in config.get("added_tokens") or ()):
        return "it has added tokens that are not special"
    vocab = model.get("vocab") or {}
    if any(s not in vocab for s in byte_symbols().values()):
        return "not every byte is in the vocabulary"
    return None


class NativeBPE:
    """Encodes texts as the tokenizer of ``config`` (an eligible tokenizer.json document)
    does with ``allow_special=False``, in C."""

    def __init__(self, lib: ops.Library, config: dict[str, Any], kind: str = "bpe") -> None:
        why = ineligible(config)
        if why is not None:
            raise ValueError(f"not a tokenizer for the native BPE encoder: {why}")
        self._raw, self.kind = lib.raw, kind
        self._config = config
        vocab = config["model"]["vocab"]
        table = np.zeros((len(config["model"]["merges"]), 3), dtype=np.uint32)
        for rank, merge in enumerate(config["model"]["merges"]):
            a, b = _pair(merge)
            try:
                table[rank] = vocab[a], vocab[b], vocab[a + b]
            except KeyError as exc:
                raise ValueError(f"merge {a!r} {b!r} names a token not in the vocabulary"
                                 ) from exc
        symbols = byte_symbols()
        byte_ids = np.array([vocab[symbols[b]] for b in range(256)], dtype=np.uint32)
        classes = code_point_classes()
        assert classes.shape == (N_CODES,) and classes.dtype == np.uint8
        handle = self._raw.tl_bpe_new(table.ctypes.data, len(table), byte_ids.ctypes.data,
                                      classes.ctypes.data)
        if not handle:
            raise MemoryError("native BPE encoder: out of memory")
        self._handle = ctypes.c_void_p(handle)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            self._raw.tl_bpe_free(handle)
            self._handle = None

    def __reduce__(self) -> tuple[Any, ...]:  # spawned workers rebuild it
        return _rebuild, (json.dumps(self._config), self.kind)

    def _utf8(self, texts: Sequence[str]) -> tuple[bytes, np.ndarray]:
        try:
            parts = [t.encode("utf-8") for t in texts]
        except UnicodeEncodeError as exc:  # lone surrogates: what HF refuses too
            raise DataError(f"cannot encode text with this {self.kind} tokenizer: {exc}; "
                            f"pass valid Unicode text") from exc
        ends = np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)))
        return b"".join(parts), ends

    def encode_lengths(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all ``texts`` one after another (uint32), and each text's count."""
        if isinstance(texts, str):
            texts = [texts]
        data, ends = self._utf8(texts)
        out = np.empty(len(data), dtype=np.uint32)  # never more ids than bytes
        lengths = np.empty(len(texts), dtype=np.int64)
        if not len(texts):
            return out, lengths
        total = self._raw.tl_bpe_encode(self._handle, data, ends.ctypes.data, len(texts),
                                        out.ctypes.data, lengths.ctypes.data)
        if total < 0:
            raise MemoryError("native BPE encoder: out of memory")
        return out[:total], lengths

    def encode_array(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode_lengths(texts)[0].copy()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        ids, lengths = self.encode_lengths(texts)
        bounds = [0, *np.cumsum(lengths).tolist()]
        return [ids[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_lengths([text])[0].tolist()

    def split_ends(self, text: str) -> np.ndarray:
        """GPT-2's pre-tokenization of ``text``: the UTF-8 end offset of each piece."""
        data, _ = self._utf8([text])
        ends = np.empty(len(data), dtype=np.int64)
        n = self._raw.tl_bpe_split(self._handle, data, len(data), ends.ctypes.data)
        return ends[:n]

    def split(self, text: str) -> list[str]:
        """GPT-2's pre-tokenization of ``text``: its pieces (for tests)."""
        data = text.encode("utf-8")
        bounds = [0, *self.split_ends(text).tolist()]
        return [data[a:b].decode("utf-8") for a, b in zip(bounds, bounds[1:], strict=False)]


def _rebuild(config: str, kind: str) -> NativeBPE | None:
    lib = ops.load_bpe()
    if lib is None:
        raise RuntimeError("the native library is unavailable in this process")
    return NativeBPE(lib, json.loads(config), kind)


def bpe_encoder(tokenizer: Any) -> NativeBPE | None:
    """The native encoder of ``tokenizer`` (a :class:`tinylm.data.tokenizers.BPETokenizer`),
    or None where Hugging Face must encode: not eligible (:func:`ineligible`), the fast
    paths off, or no native library."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not ops.enabled():
        return None
    config = json.loads(hf.to_str())
    why = ineligible(config)
    if why is not None:
        ops.log.debug("native BPE steps aside: %s", why)
        return None
    lib = ops.load_bpe()
    return None if lib is None else NativeBPE(lib, config, getattr(tokenizer, "kind", "bpe"))
