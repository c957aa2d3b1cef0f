"""Documents to ids: cut into pieces, gathered into encoding tasks, routed to splits.

A long document is cut into pieces where tokenization cannot look across the cut
(:func:`safe_split`, byte-level BPE) so the workers encode it in parts that join up
exactly; :class:`Tasks` gathers the pieces of consecutive documents into tasks of about
``TASK_CHARS``, :class:`Route` says which split each document goes to, and
:func:`encode_pieces` turns one task into (train ids, val ids) with the document
separator in place, as an :class:`Encoder` decided once for the run says.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tinylm import acceleration
from tinylm.core.errors import DataError
from tinylm.data.tokenizers import EOS_NAMES, BPETokenizer, CharTokenizer, Tokenizer

log = logging.getLogger(__name__)

PIECE_CHARS = 1 << 16  # a long document is cut into pieces of about this many chars
TASK_CHARS = 1 << 20  # chars of text per encoding task handed to a worker
TASK_PIECES = 4096  # at most this many pieces (documents) per task
_MAX_CARRY = 64 << 20  # chars without any safe cut point before we give up streaming


# --- cutting text for byte-level BPE -------------------------------------------------------


def safe_split(text: str, lo: int, hi: int) -> int:
    """The largest cut p in (lo, hi] at which ``text[:p]`` and ``text[p:]`` tokenize,
    with byte-level BPE (GPT-2's pre-tokenizer), exactly as ``text`` does; -1 if none.

    A cut just before a space or newline that is followed by a non-space character is
    safe: GPT-2's pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
    ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` never extends a non-space token into the
    following whitespace, and of a whitespace run before a non-space it gives the last
    character to the next token (``\\s+(?!\\S)`` backtracks by one), so a token always
    starts there and the text before ends a token whether or not more text follows.
    """
    hi = min(hi, len(text) - 2)  # p + 1 must be a character
    if hi <= lo:
        return -1
    nl = text.rfind("\n", lo + 1, hi + 1)
    sp = text.rfind(" ", lo + 1, hi + 1)
    while nl >= 0 or sp >= 0:
        p = max(nl, sp)
        if not text[p + 1].isspace():
            return p
        if p == nl:
            nl = text.rfind("\n", lo + 1, p)
        else:
            sp = text.rfind(" ", lo + 1, p)
    return -1


def cut_pieces(buf: str, piece_chars: int) -> tuple[list[str], str]:
    """Pieces of about ``piece_chars`` cut from ``buf`` at safe points, and the rest."""
    pieces, start = [], 0
    while len(buf) - start > piece_chars:
        p = safe_split(buf, start, start + piece_chars)
        if p < 0:  # no cut in this window: look further, else wait for more text
            p = safe_split(buf, start + piece_chars, len(buf))
            if p < 0:
                break
        pieces.append(buf[start:p])
        start = p
    rest = buf[start:]
    if len(rest) > _MAX_CARRY:
        raise DataError(
            f"the input has over {_MAX_CARRY:,} characters without a space or line break "
            f"before a non-space, which byte-level BPE cannot stream; is it text? "
            f"Use the char tokenizer or add line breaks"
        )
    return pieces, rest


# --- tasks and splits ---------------------------------------------------------------------


class Tasks:
    """Collects the pieces of documents into encoding tasks of about TASK_CHARS.

    A task is ``(pieces, splits, seps)``: the texts, for each its split (0 train,
    1 val), and whether a separator goes before it (a document's first piece, unless
    it is the first document of its split). Byte-level BPE documents are cut at safe
    points only; char tokenizers take any cut.
    """

    def __init__(self, bpe: bool) -> None:
        self.bpe = bpe
        self.carry, self.split, self.sep, self.emitted = "", 0, False, True
        self._reset()

    def _reset(self) -> None:
        self.pieces: list[str] = []
        self.splits, self.seps, self.chars = bytearray(), bytearray(), 0

    def _piece(self, text: str) -> None:
        self.pieces.append(text)
        self.splits.append(self.split)
        self.seps.append(self.sep)
        self.sep, self.emitted = False, True
        self.chars += len(text)

    def start(self, split: int, sep: bool) -> None:
        self.split, self.sep, self.emitted = split, sep, False

    def add(self, text: str) -> None:
        if not self.bpe:
            self._piece(text)
            return
        pieces, self.carry = cut_pieces(self.carry + text if self.carry else text, PIECE_CHARS)
        for p in pieces:
            self._piece(p)

    def end(self) -> None:
        if self.carry or not self.emitted:
            self._piece(self.carry)
        self.carry = ""

    def full(self) -> bool:
        return self.chars >= TASK_CHARS or len(self.pieces) >= TASK_PIECES

    def take(self) -> tuple[list[str], bytes, bytes]:
        task = (self.pieces, bytes(self.splits), bytes(self.seps))
        self._reset()
        return task


@dataclass(frozen=True)
class Route:
    """Which split each kept document goes to."""

    mode: str  # documents: every k-th to val; files: --val-files; tokens: cut the stream
    kept: int
    n_val: int

    def split_of(self, rank: int, val_source: bool) -> int:
        if self.mode == "files":
            return int(val_source)
        if self.mode == "tokens":
            return 0
        return int((rank + 1) * self.n_val // self.kept > rank * self.n_val // self.kept)

    def val_before(self, rank: int, val_source: bool) -> int:
        """How many of the documents ranked [0, rank) of a source like this one go to val
        (documents mode: split_of summed; files mode: all or none of them)."""
        if self.mode == "files":
            return rank if val_source else 0
        return 0 if self.mode == "tokens" else rank * self.n_val // self.kept


def route_of(kept: int, by_files: bool, val_fraction: float) -> Route:
    """The route of ``kept`` documents: by ``--val-files`` (``by_files``), every k-th
    document, or, with too few documents, the last ``val_fraction`` of the tokens."""
    if by_files:
        return Route("files", kept, 0)
    n_val = round(kept * val_fraction)
    if 0 < n_val < kept:
        return Route("documents", kept, n_val)
    log.debug("%d document(s): too few to split by documents; val is the last %g of the "
             "tokens", kept, val_fraction)
    return Route("tokens", kept, 0)


# --- the document separator -------------------------------------------------------------


def separator_text(sep: str | None, tok: Tokenizer) -> str | None:
    """The document separator ``sep`` (``--doc-separator``) as text to encode (None: a
    special token or nothing)."""
    if sep is None:
        return None if tok.eos_id is not None else "\n"
    return None if sep == "" or sep in tok.special_tokens else sep


def separator_ids(sep: str | None, tok: Tokenizer, documents: int) -> np.ndarray:
    """The ids that go between two of ``documents`` documents."""
    if documents < 2:  # nothing to separate
        return np.zeros(0, dtype=np.uint32)
    if sep is None and tok.eos_id is not None:
        return np.array([tok.eos_id], dtype=np.uint32)
    if sep is not None and sep in tok.special_tokens:
        return np.array([tok.token_to_id(sep)], dtype=np.uint32)
    if sep is not None and (sep in EOS_NAMES or (sep.startswith("<|") and sep.endswith("|>"))):
        raise DataError(f"--doc-separator {sep} is not a special token of this tokenizer; add "
                        f"it with --special-token '{sep}' (or pass plain text, or '')")
    text = separator_text(sep, tok)
    if sep is None:
        log.debug("the tokenizer has no end-of-text token: documents are separated by a line "
                 "break; add --special-token '<|endoftext|>' or pass --doc-separator")
    return tok.encode_array([text]) if text else np.zeros(0, dtype=np.uint32)


# --- encoding -----------------------------------------------------------------------------


UNBUILT = object()  # no native encoder built yet


class Encoder(NamedTuple):
    """What every encoding task needs: the tokenizer, the document separator's ids, the
    shards' dtype, whether special-token spellings in the text become special ids, and
    the native BPE encoder when there is one (:func:`tinylm.acceleration.bpe_encoder`)."""

    tok: Tokenizer
    sep: np.ndarray
    dtype: np.dtype
    allow_special: bool
    fast: Any = None


def native_encoder(tok: Tokenizer | None, allow_special: bool) -> Any:
    """The native encoder of a byte-level BPE tokenizer that it reproduces exactly
    (special tokens as plain text), else None: the tokenizer itself encodes."""
    if isinstance(tok, BPETokenizer) and not allow_special:
        return acceleration.bpe_encoder(tok)
    return None


def make_encoder(tok: Tokenizer, sep: np.ndarray, dtype: np.dtype, allow_special: bool,
                 built: Any = UNBUILT) -> Encoder:
    """The encoding of the pieces, decided once (the native encoder is ``built``, the one
    pass 1 built where :func:`tinylm.data.scan.scan_units` did, else built here)."""
    fast = built if built is not UNBUILT else native_encoder(tok, allow_special)
    return Encoder(tok, sep, dtype, allow_special, fast)


def encode_pieces(enc: Encoder, pieces: list[str], splits: bytes, seps: bytes
                  ) -> tuple[np.ndarray, np.ndarray]:
    """One task's ids: (train ids, val ids), separators in place, as ``dtype``."""
    tok, sep, dtype, special, fast = enc
    if isinstance(tok, CharTokenizer):  # one id per code point
        flat = tok.encode_array(pieces, allow_special=special)
        lengths = [len(p) for p in pieces]
    elif fast is not None:
        flat, counts = fast.encode_lengths(pieces)
        lengths = counts.tolist()
    else:
        lists = tok.encode_batch(pieces, allow_special=special)
        lengths = [len(ids) for ids in lists]
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.uint32,
                           count=sum(lengths))
    bounds = np.cumsum([0, *lengths]).tolist()
    out: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for i in range(len(pieces)):
        part = out[splits[i]]
        if seps[i]:
            part.append(sep)
        part.append(flat[bounds[i]:bounds[i + 1]])
    return tuple(np.concatenate(p).astype(dtype, copy=False) if p  # type: ignore[return-value]
                 else np.zeros(0, dtype=dtype) for p in out)


__all__ = [
    "PIECE_CHARS",
    "Encoder",
    "Route",
    "Tasks",
    "encode_pieces",
    "make_encoder",
    "route_of",
    "safe_split",
    "separator_ids",
    "separator_text",
]
