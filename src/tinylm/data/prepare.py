"""Prepared data: documents -> tokenizer + token shards, and batches for training.

``prepare()`` turns files (text, JSONL, Parquet, a ``datasets`` folder; see
:mod:`tinylm.data.readers`), folders and globs of them, standard input or a built-in corpus
into a folder holding

    tokenizer.json     the tokenizer (one Hugging Face tokenizers JSON, any kind)
    train-00000.bin    the training split in shards of at most ``shard_tokens`` ids
    ...                (raw little-endian uint16 when V <= 65536, else uint32)
    val-00000.bin      the validation split, likewise
    meta.json          counts (tokens, documents, skipped, duplicates), dtype, the shard
                       index, the largest id, the source and sha256 of the inputs

Each record (or text file) is one document; documents are joined with a separator,
by default the tokenizer's end-of-text token, so a window can tell where one ends.
Validation takes whole documents (every k-th, evenly along the input, or the
documents of ``val_files``); with a single document it falls back to the last
fraction of the tokens.

``prepare`` runs in phases: **scan** (pass 1: hash the inputs, count documents and bad
records, find duplicates, build the char alphabet or train BPE on a bounded sample),
**encode** (pass 2: documents cut into pieces where tokenization cannot look across
the cut (:func:`safe_split`), encoded in order by worker processes, written to
shards), **split** and **commit** (outputs staged in a temporary folder, moved in at
the end, meta.json last: a folder with meta.json is complete). Memory stays flat in
the corpus size.

Training reads the shards memory-mapped as one stream (:class:`tinylm.data.shards.TokenShards`):
:func:`get_batch` draws random windows of C+1 tokens (inputs (B, C), targets shifted by
one) from a ``torch.Generator``, and :func:`iter_windows` walks a split sequentially
so every target is scored once. Folders written by older versions (one ``train.bin``
and ``val.bin``) load too.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tinylm import acceleration
from tinylm.core.config import default_threads
from tinylm.core.errors import DataError
from tinylm.data.corpora import corpus_names, load_corpus
from tinylm.data.readers import (
    BadRecords,
    Source,
    Unit,
    count_unit,
    counted_by_metadata,
    display_path,
    iter_documents,
    iter_unit,
    iter_units,
    resolve_inputs,
    units_apply,
)
from tinylm.data.shards import DTYPES, SHARD_RE, ShardWriter, move_tail, open_split, write_all
from tinylm.data.tokenizers import (
    EOS_NAMES,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    standard_special_tokens,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "tinylm-prepared"
FORMAT_VERSION = 2  # 1: one train.bin + val.bin; 2: shards listed in meta.json
OUTPUT_NAMES = ("tokenizer.json", "meta.json")  # besides the shards
LEGACY_NAMES = ("train.bin", "val.bin")
CHUNK_BYTES = 1 << 20  # bytes read per step of a text file
PIECE_CHARS = 1 << 16  # a long document is cut into pieces of about this many chars
TASK_CHARS = 1 << 20  # chars of text per encoding task handed to a worker
TASK_PIECES = 4096  # at most this many pieces (documents) per task
SHARD_TOKENS = 100_000_000  # default --shard-tokens
PARALLEL_MIN_BYTES = 16 << 20  # smaller inputs are encoded in-process by default
MAX_META_BYTES = 16 << 20
_MAX_CARRY = 64 << 20  # chars without any safe cut point before we give up streaming
_PARALLELISM = "TOKENIZERS_PARALLELISM"


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


def _cut(buf: str, piece_chars: int) -> tuple[list[str], str]:
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


# --- the prepared folder -------------------------------------------------------------------


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared folder: each split one 1-D token sequence (a memmap for one shard, a
    :class:`tinylm.data.shards.TokenShards` over several), meta.json and the tokenizer."""

    dir: Path
    train: Any
    val: Any
    meta: dict[str, Any] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])


def _incomplete(path: Path, what: str) -> DataError:
    return DataError(f"prepared data folder {display_path(path)} is incomplete or corrupt "
                     f"({what}); run tinylm prepare --out {display_path(path)} again")


def _count(meta: dict[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _incomplete(path, f"meta.json {key} is {value!r}, not a count")
    return value


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of a prepared folder, checked: a typed one-line error for anything
    unreadable, too large, too deeply nested, foreign, newer, or of another dtype."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise _incomplete(path, "no meta.json")
    try:
        if meta_path.stat().st_size > MAX_META_BYTES:
            raise _incomplete(path, f"meta.json is over {MAX_META_BYTES >> 20} MB")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except RecursionError:
        raise _incomplete(path, "unreadable meta.json: nested too deeply") from None
    except (OSError, ValueError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _incomplete(path, f"unreadable meta.json: {line}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{display_path(meta_path)} is not a tinylm prepared-data meta.json; "
                        f"run tinylm prepare --out {display_path(path)}")
    version = meta.get("version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DataError(f"{display_path(path)} was prepared by a newer tinylm (format "
                        f"version {version!r}); upgrade tinylm or prepare it again")
    if meta.get("dtype") not in DTYPES:
        raise _incomplete(path, f"meta.json says dtype {meta.get('dtype')!r}; prepare writes "
                                f"only {' or '.join(DTYPES)}")
    for key in ("train_tokens", "val_tokens", "vocab_size"):
        _count(meta, key, path)
    return meta


def _shard_index(path: Path, meta: dict[str, Any], split: str) -> list[dict[str, Any]]:
    if meta.get("version", 1) < 2:
        return [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]
    entries = (meta.get("shards") or {}).get(split) if isinstance(meta.get("shards"), dict) \
        else None
    if not isinstance(entries, list):
        raise _incomplete(path, f"meta.json has no shard index for {split}")
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("file"), str)
                and SHARD_RE.match(e["file"]) and e["file"].startswith(split + "-")):
            raise _incomplete(path, f"meta.json lists a bad {split} shard {e!r}")
        _count(e, "tokens", path)
    if sum(e["tokens"] for e in entries) != meta[f"{split}_tokens"]:
        raise _incomplete(path, f"the {split} shards do not add up to {split}_tokens")
    return entries


def load_prepared(path: str | Path) -> PreparedData:
    """Open a folder written by :func:`prepare` (shards memory-mapped read-only).

    Checks meta.json, every shard's size, the tokenizer's size, and that no token id
    (the largest is recorded at prepare time) reaches past the tokenizer's vocabulary.
    """
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"prepared data folder {display_path(path)} does not exist; create it "
                        f"with tinylm prepare --out {display_path(path)}")
    meta = read_meta(path)
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for split in ("train", "val"):
        entries = _shard_index(path, meta, split)
        for e in entries:
            shard = path / e["file"]
            if not shard.is_file():
                raise _incomplete(path, f"no {e['file']}")
            size = shard.stat().st_size
            if size != e["tokens"] * dtype.itemsize:
                raise _incomplete(path, f"{e['file']} has {size} bytes, meta.json says "
                                        f"{e['tokens']} {dtype.name} tokens = "
                                        f"{e['tokens'] * dtype.itemsize}")
        splits[split] = open_split(path, entries, dtype)
    if not (path / "tokenizer.json").is_file():
        raise _incomplete(path, "no tokenizer.json")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise _incomplete(path, f"tokenizer.json has {tokenizer.vocab_size} tokens, "
                                f"meta.json says {meta['vocab_size']}")
    top = meta.get("max_token_id")
    if top is None:  # format 1 did not record it: look
        top = max((int(a.max()) for a in splits.values() if len(a)), default=0)
    if isinstance(top, bool) or not isinstance(top, int) or top >= tokenizer.vocab_size:
        raise DataError(f"{display_path(path)} holds token ids up to {top!r}, outside its "
                        f"tokenizer's vocabulary of {tokenizer.vocab_size}; the shards were "
                        f"made with another tokenizer — run tinylm prepare again")
    return PreparedData(path, splits["train"], splits["val"], meta, tokenizer)


# --- prepare: options ------------------------------------------------------------------------


@dataclass
class _Options:
    """Every prepare() argument, checked; ``settings`` is what a re-run must match."""

    out: Path
    inputs: list[str | Path]
    val_files: list[str | Path]
    corpus: str | None
    tok_spec: str
    given: Tokenizer | None
    vocab_size: int
    val_fraction: float
    context_length: int
    unknown: str
    errors: str
    special_tokens: list[str]
    glob: str
    force: bool
    progress: bool | None
    bpe_train_mb: float | None
    chunk_bytes: int
    text_field: str
    skip_bad: bool
    doc_separator: str | None
    dedup: bool
    shard_tokens: int
    workers: int | None
    allow_special: bool
    settings: dict[str, Any] = field(default_factory=dict)


def _positive_int(value: Any, what: str, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{what} must be a positive integer, got {value!r}; {hint}")


def _check_args(o: _Options) -> None:
    if not isinstance(o.val_fraction, (int, float)) or not 0 < o.val_fraction < 1:
        raise DataError(f"val fraction must be between 0 and 1 (exclusive), got "
                        f"{o.val_fraction!r}; the default is 0.1")
    _positive_int(o.context_length, "context length", "the default is 256")
    _positive_int(o.shard_tokens, "--shard-tokens", f"the default is {SHARD_TOKENS:,}")
    if o.workers is not None:
        _positive_int(o.workers, "--workers", "omit it to use every core")
    if o.unknown not in ("error", "replace"):
        raise DataError(f"--unknown must be error or replace, got {o.unknown!r}")
    if o.errors not in ("strict", "replace"):
        raise DataError(f"--errors must be strict or replace, got {o.errors!r}")
    if o.tok_spec == "bpe":
        minimum = 256 + len(o.special_tokens)
        if isinstance(o.vocab_size, bool) or not isinstance(o.vocab_size, int) \
                or o.vocab_size < minimum:
            raise DataError(
                f"vocab size {o.vocab_size!r} is too small for byte-level BPE: it needs the "
                f"256 byte tokens plus {len(o.special_tokens)} special token(s), so at least "
                f"{minimum}; use --vocab-size {max(minimum, 512)} or more (default 4096)"
            )
    if o.bpe_train_mb is not None and not (isinstance(o.bpe_train_mb, (int, float))
                                           and o.bpe_train_mb > 0):
        raise DataError(f"BPE training size must be a positive number of MB, got "
                        f"{o.bpe_train_mb!r}")
    if o.inputs and o.corpus:
        raise DataError("pass either inputs or a corpus, not both")
    if o.val_files and not o.inputs:
        raise DataError("--val-files needs --input for the training documents")
    if not o.inputs and o.corpus not in corpus_names():
        raise DataError(f"unknown corpus {o.corpus!r}; built-in corpora: "
                        f"{', '.join(corpus_names())}")


def _tokenizer_settings(o: _Options) -> dict[str, Any]:
    if o.tok_spec == "char":
        return {"kind": "char", "unknown": o.unknown, "special_tokens": o.special_tokens}
    if o.tok_spec == "bpe":
        return {"kind": "bpe", "vocab_size": o.vocab_size, "special_tokens": o.special_tokens,
                "train_mb": o.bpe_train_mb}
    o.given = o.given if o.given is not None else load_tokenizer(o.tok_spec)
    where = "object" if o.tok_spec == "given" else display_path(Path(o.tok_spec).resolve())
    digest = hashlib.sha256(json.dumps(o.given.to_hf_json(), sort_keys=True).encode())
    return {"kind": o.given.kind, "path": where, "sha256": digest.hexdigest()}


def _describe(inputs: Sequence[str | Path]) -> str:
    return ", ".join(display_path(Path(x).resolve()) if str(x) != "-" else "-" for x in inputs)


def _options(out_dir: str | Path, inputs: Sequence[str | Path] | None,
             tokenizer: str | Path | Tokenizer, kw: dict[str, Any]) -> _Options:
    given = tokenizer if isinstance(tokenizer, Tokenizer) else None
    o = _Options(out=Path(out_dir), inputs=list(inputs or []),
                 val_files=list(kw.pop("val_files") or []),
                 corpus=kw.pop("corpus") or (None if inputs else "python-docs"),
                 tok_spec="given" if given is not None else str(tokenizer), given=given,
                 special_tokens=standard_special_tokens(kw.pop("special_tokens")), **kw)
    _check_args(o)
    o.settings = {
        "source": f"corpus:{o.corpus}" if o.corpus else _describe(o.inputs),
        "tokenizer": _tokenizer_settings(o), "val_fraction": o.val_fraction,
        "errors": o.errors, "text_field": o.text_field, "skip_bad": o.skip_bad,
        "doc_separator": o.doc_separator, "dedup": o.dedup, "shard_tokens": o.shard_tokens,
        "val_files": _describe(o.val_files) if o.val_files else None,
        **({"allow_special": True} if o.allow_special else {}),
    }
    return o


# --- prepare: the output folder -------------------------------------------------------------


def _is_output(name: str) -> bool:
    return name in OUTPUT_NAMES or name in LEGACY_NAMES or bool(SHARD_RE.match(name))


def _stage_name(out: Path) -> Path:
    return out / f".prepare.tmp-{os.getpid()}"


def _remove_stale_temps(out: Path) -> None:
    """Delete temporary files and folders left by prepare runs that were killed."""
    for p in out.glob(".*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        except PermissionError:
            pass


def _check_out(o: _Options) -> dict[str, Any] | None:
    """Refuse an output folder that holds something else; return its old meta, if any."""
    out, settings, force = o.out, o.settings, o.force
    if out.exists() and not out.is_dir():
        raise DataError(f"output {display_path(out)} is a file, not a folder; pass a folder "
                        f"path to --out")
    if not out.is_dir():
        return None
    old = None
    meta_path = out / "meta.json"
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            old = {}
        if not force and (not isinstance(old, dict) or old.get("format") != FORMAT):
            raise DataError(f"output folder {display_path(out)} has a meta.json that tinylm did "
                            f"not write; choose another --out, or pass --force to replace it")
        if not force and old.get("settings") != settings:
            raise DataError(
                f"output folder {display_path(out)} already holds a different dataset "
                f"({_describe_settings(old.get('settings') or {})}; this run: "
                f"{_describe_settings(settings)}); choose another --out, "
                f"or pass --force to overwrite it"
            )
    elif not force:
        foreign = sorted(p.name for p in out.iterdir()
                         if not _is_output(p.name) and ".tmp-" not in p.name)
        if foreign:
            raise DataError(f"output folder {display_path(out)} is not empty (has "
                            f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                            f"choose an empty or new --out, or pass --force to write there "
                            f"anyway")
    return old if isinstance(old, dict) else None


def _describe_settings(s: dict[str, Any]) -> str:
    tok = s.get("tokenizer", {}) if isinstance(s.get("tokenizer"), dict) else {}
    return (f"source {s.get('source', '?')}, tokenizer {tok.get('kind', '?')}"
            + (f" vocab {tok['vocab_size']}" if tok.get("vocab_size") else "")
            + f", val fraction {s.get('val_fraction', '?')}"
            + (", allow_special" if s.get("allow_special") else ""))


def _progress(total: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, dynamic_ncols=True)


class _Bar:
    """A tqdm bar over input bytes on a terminal, nothing otherwise (a callback)."""

    def __init__(self, total: int, desc: str, enabled: bool | None) -> None:
        self.bar = _progress(total, desc, enabled)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(out: Path, stage: Path, names: Sequence[str]) -> None:
    """Move the staged files into ``out``: old outputs go, meta.json comes in last."""
    for name in names:
        _fsync(stage / name)
    (out / "meta.json").unlink(missing_ok=True)  # the completeness marker goes first
    for p in out.iterdir():
        if _is_output(p.name) and p.name not in names:
            p.unlink()
    for name in sorted(names, key=lambda n: n == "meta.json"):
        os.replace(stage / name, out / name)
    try:
        dir_fd = os.open(out, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
    except OSError:  # not every platform can fsync a directory
        pass


# --- prepare: sources and the scan pass ------------------------------------------------------


def _sources(o: _Options, stage: Path) -> tuple[list[Source], list[bool]]:
    """The inputs in reading order, and for each whether it belongs to val (--val-files)."""
    if o.corpus:
        data = load_corpus(o.corpus).encode("utf-8")
        return [Source(f"corpus {o.corpus}", data=data)], [False]
    train = resolve_inputs(o.inputs, o.glob, o.out)
    val = resolve_inputs(o.val_files, o.glob, o.out) if o.val_files else []
    sources = train + val
    if any(s.name == "<stdin>" for s in sources):
        # Standard input can be read once; spool it so both passes can read it.
        with open(stage / "stdin", "wb") as f:
            shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
        sources = [Source("<stdin>", path=stage / "stdin") if s.name == "<stdin>" else s
                   for s in sources]
    return sources, [False] * len(train) + [True] * len(val)


_UNBUILT = object()


@dataclass
class _Scan:
    """What pass 1 learns: input hashes, documents, bad records, the tokenizer."""

    digests: list[str] = field(default_factory=list)
    stamps: list[Any] = field(default_factory=list)
    documents: int = 0
    duplicates: int = 0
    chars: int = 0
    read: int = 0  # input bytes read so far
    keep: bytearray | None = None  # per document: 0 = a duplicate, dropped (with dedup)
    bad: BadRecords = field(default_factory=BadRecords)
    tokenizer: Tokenizer | None = None
    trained_on: int | None = None
    units: list[Unit] | None = None  # read by the workers in both passes (else None)
    unit_docs: list[int] = field(default_factory=list)  # documents of each unit
    fast: Any = _UNBUILT  # pass 2's native encoder, where pass 1 built it (or None)


def _digest(src: Source) -> str:
    h = hashlib.sha256()
    with src.open_raw() as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _hash_sources(sources: Sequence[Source], scan: _Scan) -> None:
    for src in sources:
        scan.digests.append(_digest(src))
        scan.stamps.append(src.stamp())


def _documents_pass(o: _Options, sources: Sequence[Source], scan: _Scan, bar: _Bar
                    ) -> Iterator[str]:
    """Pass 1's reading: every chunk of text, counting documents and (with dedup) marking
    exact duplicates by a 128-bit BLAKE2 hash of their text."""
    seen: set[bytes] = set()
    hasher = None

    def on_bytes(n: int) -> None:
        scan.read += n
        bar(n)
    if o.dedup:
        scan.keep = bytearray()

    def end_document() -> None:
        if hasher is not None:
            digest = hasher.digest()
            dup = digest in seen
            seen.add(digest)
            scan.keep.append(0 if dup else 1)  # type: ignore[union-attr]
            scan.duplicates += dup

    for text, start, _ in iter_documents(sources, text_field=o.text_field, errors=o.errors,
                                         chunk_bytes=o.chunk_bytes, bad=scan.bad,
                                         on_bytes=on_bytes):
        if start:
            end_document()
            scan.documents += 1
            hasher = hashlib.blake2b(digest_size=16) if o.dedup else None
        if hasher is not None:
            hasher.update(text.encode("utf-8"))
        scan.chars += len(text)
        yield text
    end_document()


def _workers(o: _Options, sources: Sequence[Source]) -> int:
    total = sum(s.size for s in sources)
    return o.workers or (default_workers() if total >= PARALLEL_MIN_BYTES else 1)


def _scan_unit(unit: Unit) -> tuple[int, BadRecords]:
    """Pass 1 of one unit in a worker: its documents and bad records (its characters are
    counted in pass 2, which reads the texts: a Parquet unit is often counted from its
    metadata alone, see :func:`tinylm.data.readers.count_unit`)."""
    job = _WORKER
    assert isinstance(job, _UnitJob)
    bad = BadRecords()
    docs = count_unit(job.sources, unit, text_field=job.text_field, errors=job.errors,
                      bad=bad)
    return docs, bad


def _source_digest(k: int) -> str:
    """The sha256 of source ``k``, in a worker: a side task of either pass."""
    assert isinstance(_WORKER, _UnitJob)
    return _digest(_WORKER.sources[k])


def _digest_tasks(sources: Sequence[Source]) -> list[tuple[Callable[[int], str], int]]:
    return [(_source_digest, k) for k in range(len(sources))]


def _scan_units(o: _Options, sources: Sequence[Source], scan: _Scan, workers: int,
                bar: _Bar, hash_now: bool) -> None:
    """Pass 1 unit by unit (a given tokenizer, no dedup), by the workers, or in this
    process for one. The sources are hashed here only when ``hash_now`` (an output
    folder's dataset to compare with), else beside pass 2's units. Meanwhile a thread
    here builds pass 2's native BPE encoder (its class table takes ~0.2 s), which would
    otherwise wait between the passes (one worker: built first, on this core). Parquet
    files whose metadata gives every count are scanned here, without a pool: nothing to
    read."""
    assert scan.units is not None
    job = _UnitJob(list(sources), o.text_field, o.errors)
    units = scan.units
    scan.stamps = [s.stamp() for s in sources]

    def planned() -> Iterator[Unit]:  # planned while the workers read (lazily)
        for unit in iter_units(sources, parts=2 * workers):
            units.append(unit)
            yield unit
    def build() -> None:
        scan.fast = _native_encoder(o.given, o.allow_special)
    warm = threading.Thread(target=build, daemon=True)
    pool = 1 if not hash_now and counted_by_metadata(sources, o.text_field) else workers
    if pool == 1:
        build()
    results = _mapped(pool, _scan_unit, planned(), job,
                      side=_digest_tasks(sources) if hash_now else (),
                      started=warm.start if pool > 1 else None)
    for result in results:
        if isinstance(result, str):
            scan.digests.append(result)
            continue
        docs, bad = result
        unit = units[len(scan.unit_docs)]
        scan.unit_docs.append(docs)
        scan.documents += docs
        if bad.count:
            scan.bad.first = scan.bad.first or bad.first
            scan.bad.count += bad.count
            for why, n in bad.reasons.items():
                scan.bad.reasons[why] = scan.bad.reasons.get(why, 0) + n
        scan.read += unit.size
        bar(unit.size)
    if warm.ident is not None:  # pass 2's workers fork after it has finished
        warm.join()


def _scan(o: _Options, sources: Sequence[Source], hash_now: bool) -> _Scan:
    """Pass 1: hash the inputs, count documents, build the char alphabet or train BPE.
    Read in units (a given tokenizer, no dedup, uncompressed JSONL and Parquet: any
    number of workers, one included, read the same way), the inputs are hashed in pass 1
    only when ``hash_now``, else by pass 2's workers beside the encoding."""
    scan = _Scan()
    total = sum(s.size for s in sources)
    workers = _workers(o, sources)
    # A tokenizer built from pass 1's stream (char, bpe) needs it here, in one process.
    if not o.dedup and o.tok_spec not in ("char", "bpe") and units_apply(sources):
        scan.units = []
    else:
        _hash_sources(sources, scan)
    bar = _Bar(total, "train bpe" if o.tok_spec == "bpe" else "scan", o.progress)
    try:
        if scan.units is not None:
            _scan_units(o, sources, scan, workers, bar, hash_now)
            scan.tokenizer = o.given
            return scan
        texts = _documents_pass(o, sources, scan, bar)
        if o.tok_spec == "char":
            seen = np.zeros(0x110000, dtype=bool)
            for text in texts:
                CharTokenizer.seen_code_points(text, seen)
            scan.tokenizer = _char_tokenizer(o, seen, scan)
        elif o.tok_spec == "bpe":
            scan.tokenizer = _train_bpe(o, texts, total, scan)
        else:
            for _ in texts:
                pass
            scan.tokenizer = o.given
    finally:
        bar.close()
    return scan


def _char_tokenizer(o: _Options, seen: np.ndarray, scan: _Scan) -> Tokenizer:
    tok = CharTokenizer.from_code_points(seen, o.unknown, o.special_tokens)
    sep = _separator_text(o, tok)
    if scan.documents > 1 and sep and any(not seen[ord(c)] for c in sep):
        CharTokenizer.seen_code_points(sep, seen)  # the separator's characters join in
        tok = CharTokenizer.from_code_points(seen, o.unknown, o.special_tokens)
    return tok


def _train_bpe(o: _Options, texts: Iterator[str], total: int, scan: _Scan) -> Tokenizer:
    """Train on about bpe_train_mb million characters taken evenly along the input
    (bounded time and memory on huge corpora); every byte is still read and encoded."""
    budget = math.inf if o.bpe_train_mb is None else o.bpe_train_mb * 1e6
    fed = 0

    def sample() -> Iterator[str]:
        nonlocal fed
        for text in texts:  # cut points do not matter here: they only split a few words
            if fed < budget * scan.read / max(total, 1):  # keep pace with the reading
                fed += len(text)
                yield text

    tok = BPETokenizer.train(sample(), o.vocab_size, o.special_tokens)
    scan.trained_on = fed
    if tok.vocab_size < o.vocab_size:
        log.warning("BPE stopped at %d tokens (asked for %d): the training text has no more "
                    "pairs to merge", tok.vocab_size, o.vocab_size)
    return tok


# --- prepare: the encode pass ------------------------------------------------------------------


def _separator_text(o: _Options, tok: Tokenizer) -> str | None:
    """The document separator as text to encode (None: a special token or nothing)."""
    sep = o.doc_separator
    if sep is None:
        return None if tok.eos_id is not None else "\n"
    return None if sep == "" or sep in tok.special_tokens else sep


def _separator_ids(o: _Options, tok: Tokenizer, documents: int) -> np.ndarray:
    sep = o.doc_separator
    if documents < 2:  # nothing to separate
        return np.zeros(0, dtype=np.uint32)
    if sep is None and tok.eos_id is not None:
        return np.array([tok.eos_id], dtype=np.uint32)
    if sep is not None and sep in tok.special_tokens:
        return np.array([tok.token_to_id(sep)], dtype=np.uint32)
    if sep is not None and (sep in EOS_NAMES or (sep.startswith("<|") and sep.endswith("|>"))):
        raise DataError(f"--doc-separator {sep} is not a special token of this tokenizer; add "
                        f"it with --special-token '{sep}' (or pass plain text, or '')")
    text = _separator_text(o, tok)
    if sep is None:
        log.debug("the tokenizer has no end-of-text token: documents are separated by a line "
                 "break; add --special-token '<|endoftext|>' or pass --doc-separator")
    return tok.encode_array([text]) if text else np.zeros(0, dtype=np.uint32)


@dataclass
class _Route:
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


def _route(o: _Options, scan: _Scan) -> _Route:
    kept = scan.documents - scan.duplicates
    if o.val_files:
        return _Route("files", kept, 0)
    n_val = round(kept * o.val_fraction)
    if 0 < n_val < kept:
        return _Route("documents", kept, n_val)
    log.debug("%d document(s): too few to split by documents; val is the last %g of the "
             "tokens", kept, o.val_fraction)
    return _Route("tokens", kept, 0)


class _Tasks:
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
        pieces, self.carry = _cut(self.carry + text if self.carry else text, PIECE_CHARS)
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


def _task_stream(o: _Options, sources: Sequence[Source], val_source: Sequence[bool],
                 scan: _Scan, route: _Route, docs: list[int], bar: _Bar
                 ) -> Iterator[tuple[list[str], bytes, bytes]]:
    """Pass 2's reading: the documents again, routed to splits, cut into tasks."""
    tasks = _Tasks(bpe=not isinstance(scan.tokenizer, CharTokenizer))
    started = [False, False]
    doc = rank = -1
    open_doc = False
    for text, start, k in iter_documents(sources, text_field=o.text_field, errors=o.errors,
                                         chunk_bytes=o.chunk_bytes, on_bytes=bar):
        if start:
            if open_doc:
                tasks.end()
            doc += 1
            open_doc = scan.keep is None or bool(scan.keep[doc])
            if not open_doc:
                continue
            rank += 1
            split = route.split_of(rank, val_source[k])
            docs[split] += 1
            tasks.start(split, started[split])
            started[split] = True
        if open_doc:
            tasks.add(text)
            if tasks.full():
                yield tasks.take()
    if open_doc:
        tasks.end()
    if tasks.pieces:
        yield tasks.take()


class _Encoder(NamedTuple):
    """What every encoding task needs: the tokenizer, the document separator's ids, the
    shards' dtype, whether special-token spellings in the text become special ids, and
    the native BPE encoder when there is one (:func:`tinylm.acceleration.bpe_encoder`)."""

    tok: Tokenizer
    sep: np.ndarray
    dtype: np.dtype
    allow_special: bool
    fast: Any = None


def _native_encoder(tok: Tokenizer | None, allow_special: bool) -> Any:
    """The native encoder of a byte-level BPE tokenizer that it reproduces exactly
    (special tokens as plain text), else None: the tokenizer itself encodes."""
    if isinstance(tok, BPETokenizer) and not allow_special:
        return acceleration.bpe_encoder(tok)
    return None


def _encoder(tok: Tokenizer, sep: np.ndarray, dtype: np.dtype, allow_special: bool,
             scan: _Scan | None = None) -> _Encoder:
    """The encoding of the pieces, decided once (the native encoder is the one pass 1
    built where :func:`_scan_units` did, else built here)."""
    built = scan.fast if scan is not None else _UNBUILT
    fast = built if built is not _UNBUILT else _native_encoder(tok, allow_special)
    return _Encoder(tok, sep, dtype, allow_special, fast)


def _encode_pieces(enc: _Encoder, pieces: list[str], splits: bytes, seps: bytes
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


class _UnitJob(NamedTuple):
    """What a worker needs to read units (pass 1) and encode them (pass 2)."""

    sources: list[Source]
    text_field: str
    errors: str
    route: Any = None  # _Route, pass 2
    val_source: list[bool] | None = None
    enc: _Encoder | None = None


_WORKER: _Encoder | _UnitJob | None = None
_PARTS: list[Any] = [None, 0]  # a worker's stage folder and how many part files it wrote


def _init_worker(state: _Encoder | _UnitJob, stage: Path | None = None) -> None:
    global _WORKER
    os.environ[_PARALLELISM] = "false"  # one core per worker: the pool is the parallelism
    _WORKER = state
    _PARTS[:] = [stage, 0]


class _Part(NamedTuple):
    """The ids of one task or unit: in a worker, a file of the stage folder (``path``),
    ``train`` ids then ``val`` ids, that the main process appends to the shards (the
    kernel copies them: ``copy_file_range``) and deletes; in this process, the arrays
    (``ids``). Sending the arrays through the pool's pipe, pickled and unpickled, cost
    the two sides more CPU than a third of the encoding. A unit also tells how many
    documents and characters it read."""

    path: str | None
    ids: tuple[np.ndarray, np.ndarray] | None
    train: int
    val: int
    top: int
    docs: int = 0
    chars: int = 0


def _part(pair: tuple[np.ndarray, np.ndarray], docs: int = 0, chars: int = 0) -> _Part:
    top = max((int(ids.max()) for ids in pair if ids.size), default=0)
    stage, n = _PARTS
    if stage is None:  # in this process
        return _Part(None, pair, pair[0].size, pair[1].size, top, docs, chars)
    _PARTS[1] = n + 1
    path = str(stage / f".part-{os.getpid()}-{n}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for ids in pair:
            write_all(fd, ids)
    finally:
        os.close(fd)
    return _Part(path, None, pair[0].size, pair[1].size, top, docs, chars)


def _take(result: _Part, writers: Sequence[ShardWriter]) -> int:
    """Append one task's or unit's ids to the train and val writers; their largest id."""
    if result.ids is not None:
        for writer, ids in zip(writers, result.ids, strict=True):
            writer.write(ids)
        return result.top
    assert result.path is not None
    writers[0].write_from(result.path, 0, result.train)
    writers[1].write_from(result.path, result.train * writers[1].dtype.itemsize, result.val)
    os.unlink(result.path)
    return result.top


def _encode_task(task: tuple[list[str], bytes, bytes]) -> _Part:
    """Pass 2 of one task (documents read by the main process) in a worker."""
    assert isinstance(_WORKER, _Encoder)
    return _part(_encode_pieces(_WORKER, *task))


def _encode_unit(item: tuple[Unit, int, tuple[bool, bool]]) -> _Part:
    """Pass 2 of one unit in a worker: read, route (the unit's first document has rank
    ``rank``; ``started``: whether each split has documents before it), cut, encode."""
    unit, rank, started_before = item
    job = _WORKER
    assert isinstance(job, _UnitJob) and job.enc is not None and job.val_source is not None
    tasks = _Tasks(bpe=not isinstance(job.enc.tok, CharTokenizer))
    started, val = list(started_before), job.val_source[unit.source]
    out: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    docs = chars = 0

    def flush() -> None:
        for part, ids in zip(out, _encode_pieces(job.enc, *tasks.take()), strict=True):
            part.append(ids)
    for text in iter_unit(job.sources, unit, text_field=job.text_field, errors=job.errors):
        docs += 1
        chars += len(text)
        split = job.route.split_of(rank, val)
        rank += 1
        tasks.start(split, started[split])
        started[split] = True
        tasks.add(text)
        tasks.end()
        if tasks.full():
            flush()
    if tasks.pieces:
        flush()
    dtype = job.enc.dtype
    return _part(tuple(np.concatenate(p) if p else np.zeros(0, dtype)  # type: ignore[arg-type]
                       for p in out), docs, chars)


def _unit_items(scan: _Scan, route: _Route, val_source: Sequence[bool], docs: list[int],
                bar: _Bar) -> Iterator[tuple[Unit, int, tuple[bool, bool]]]:
    """Pass 2's units with the rank of their first document and which splits started
    before them; counts the documents of each split into ``docs``."""
    assert scan.units is not None
    rank = 0
    for unit, n in zip(scan.units, scan.unit_docs, strict=True):
        yield unit, rank, (docs[0] > 0, docs[1] > 0)
        vs = val_source[unit.source]
        val = route.val_before(rank + n, vs) - route.val_before(rank, vs)
        docs[0] += n - val
        docs[1] += val
        rank += n
        bar(unit.size)


def default_workers() -> int:
    """Encoding processes for a large input: the free cores
    (:func:`tinylm.core.config.default_threads`)."""
    return default_threads()


class _SerialTokenizers:
    """Within the block, Hugging Face tokenizers encode batches on one thread."""

    def __enter__(self) -> None:
        self.old = os.environ.get(_PARALLELISM)
        os.environ[_PARALLELISM] = "false"

    def __exit__(self, *exc: Any) -> None:
        if self.old is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = self.old


SideTasks = Sequence[tuple[Callable[[Any], Any], Any]]


def _mapped(workers: int, fn: Callable[[Any], Any], items: Iterator[Any],
            state: _Encoder | _UnitJob, *, side: SideTasks = (),
            started: Callable[[], None] | None = None, stage: Path | None = None
            ) -> Iterator[Any]:
    """``fn(item)`` for every item, in order, then ``f(x)`` for every ``(f, x)`` in
    ``side``: by a pool of ``workers`` processes (their ``_WORKER`` is ``state``; they
    write part files into ``stage``), or in this process for one worker. The side tasks
    (a whole input's sha256) run beside the items, outside their in-order window, so a
    long one holds no worker up; their results come after the items'. ``started()`` is
    called once the workers exist (a thread started then is not forked)."""
    if workers == 1:
        return _in_process(fn, items, state, side)
    return _pooled(workers, fn, items, state, side, started, stage)


def _in_process(fn: Callable[[Any], Any], items: Iterator[Any], state: _Encoder | _UnitJob,
                side: SideTasks) -> Iterator[Any]:
    """What :func:`_mapped` does for one worker: the same functions, on this core."""
    global _WORKER
    before = _WORKER, list(_PARTS)
    _WORKER, _PARTS[:] = state, [None, 0]
    try:
        with _SerialTokenizers():
            for item in items:
                yield fn(item)
            for f, x in side:
                yield f(x)
    finally:
        _WORKER, _PARTS[:] = before[0], before[1]


def _pooled(workers: int, fn: Callable[[Any], Any], items: Iterator[Any],
            state: _Encoder | _UnitJob, side: SideTasks,
            started: Callable[[], None] | None, stage: Path | None) -> Iterator[Any]:
    """:func:`_mapped` by a process pool: at most 2 items per worker in flight (memory
    stays flat), the side tasks queued first."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with _SerialTokenizers():  # also silences tokenizers' warning about forking
        pool = ctx.Pool(workers, _init_worker, (state, stage))
    if started is not None:
        started()
    try:
        aside = [pool.apply_async(f, (x,)) for f, x in side]
        pending: deque[Any] = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        for result in aside:
            yield result.get()
    finally:
        pool.terminate()
        pool.join()


def _write_results(results: Iterator[Any], writers: Sequence[ShardWriter], scan: _Scan,
                   sources: Sequence[Source]) -> int:
    """Pass 2's parts into the writers, in order (units: their documents checked against
    pass 1's count, their characters counted), then the side tasks' sha256s; the
    largest id."""
    top, k = 0, 0
    try:
        for result in results:
            if isinstance(result, str):
                scan.digests.append(result)
                continue
            top = max(top, _take(result, writers))
            if scan.units is not None:
                if result.docs != scan.unit_docs[k]:
                    raise DataError(
                        f"{sources[scan.units[k].source].name}: {result.docs} documents "
                        f"read where the first pass counted {scan.unit_docs[k]} (the file "
                        f"changed, or its Parquet statistics are wrong); run tinylm "
                        f"prepare again when it is not being written, or rewrite the file")
                scan.chars += result.chars
                k += 1
    finally:
        results.close()  # type: ignore[attr-defined]
    return top


@dataclass
class _Encoded:
    shards: dict[str, list[dict[str, Any]]]
    tokens: dict[str, int]
    documents: dict[str, int]
    max_id: int
    separator: list[int]
    route: str
    workers: int


def _encode(o: _Options, sources: Sequence[Source], val_source: Sequence[bool], scan: _Scan,
            stage: Path) -> _Encoded:
    """Pass 2: encode every kept document into the train/val shard writers, in order."""
    tok = scan.tokenizer
    assert tok is not None
    dtype = dtype_for_vocab(tok.vocab_size)
    sep = _separator_ids(o, tok, scan.documents - scan.duplicates)
    route = _route(o, scan)
    total = sum(s.size for s in sources)
    workers = _workers(o, sources)
    if getattr(tok, "split_safe", True) is False:
        log.warning("the tokenizer is not GPT-2 byte-level BPE; documents over %d characters "
                    "are encoded in pieces cut at spaces and line breaks", PIECE_CHARS)
    writers = [ShardWriter(stage, s, dtype, o.shard_tokens) for s in ("train", "val")]
    docs, top = [0, 0], 0
    bar = _Bar(total, f"encode {tok.kind}", o.progress)
    try:
        encoder = _encoder(tok, sep, dtype, o.allow_special, scan)
        if scan.units is not None:  # the workers read too
            job = _UnitJob(list(sources), o.text_field, o.errors, route, list(val_source),
                           encoder)
            results = _mapped(workers, _encode_unit,
                              _unit_items(scan, route, val_source, docs, bar), job,
                              side=() if scan.digests else _digest_tasks(sources),
                              stage=stage)
        else:
            tasks = _task_stream(o, sources, val_source, scan, route, docs, bar)
            results = _mapped(workers, _encode_task, tasks, encoder, stage=stage)
        top = _write_results(results, writers, scan, sources)
    finally:
        bar.close()
        entries = [w.close() for w in writers]
    if route.mode == "tokens":
        n = writers[0].tokens
        entries[0] = move_tail(stage, entries[0], n - round(n * o.val_fraction), dtype,
                               writers[1])
        writers[0].tokens = n - writers[1].tokens
        entries[1] = writers[1].close()
    return _Encoded({"train": entries[0], "val": entries[1]},
                    {"train": writers[0].tokens, "val": writers[1].tokens},
                    {"train": docs[0], "val": docs[1]}, top, sep.tolist(), route.mode, workers)


# --- prepare: checks between the phases, meta.json, and the whole ----------------------------


def _after_scan(o: _Options, sources: Sequence[Source], scan: _Scan,
                old_meta: dict[str, Any] | None) -> None:
    """Refuse what pass 1 found wrong: nothing to read, bad records, another text (read
    in units, the characters are counted in pass 2: :func:`_check_text` then)."""
    if sum(s.size for s in sources) == 0 or scan.bad.count == 0 and scan.documents == 0:
        raise DataError(f"input is empty ({o.settings['source']}); pass a file with text in it")
    if scan.units is None:
        _check_text(o, scan)
    if scan.bad.count:
        counts = ", ".join(f"{n} {why}" for why, n in scan.bad.reasons.items())
        if not o.skip_bad:
            raise DataError(f"{scan.bad.count:,} record(s) have no usable text ({counts}); "
                            f"the first: {scan.bad.first}; fix them, name the text field with "
                            f"--text-field, or pass --skip-bad to leave them out")
        log.warning("skipped %d record(s) without usable text (%s); the first: %s",
                    scan.bad.count, counts, scan.bad.first)
    if scan.documents - scan.duplicates == 0:
        raise DataError(f"no documents with text in {o.settings['source']}; check "
                        f"--text-field (now {o.text_field!r})")
    if old_meta and not o.force and old_meta.get("sha256") != _combined(scan):
        raise DataError(f"output folder {display_path(o.out)} already holds a dataset "
                        f"prepared from different input text; choose another --out, or pass "
                        f"--force to overwrite it")


def _check_text(o: _Options, scan: _Scan) -> None:
    if scan.bad.count == 0 and scan.chars == 0:
        raise DataError(f"input is empty ({o.settings['source']}); pass a file with text in it")


def _combined(scan: _Scan) -> str:
    return hashlib.sha256("".join(scan.digests).encode()).hexdigest()


def _check_lengths(o: _Options, enc: _Encoded) -> None:
    n_train, n_val = enc.tokens["train"], enc.tokens["val"]
    need = o.context_length + 1
    if min(n_train, n_val) < need:
        raise DataError(
            f"input is too short: {n_train + n_val:,} tokens split into {n_train:,} train + "
            f"{n_val:,} val, but each split needs at least context length + 1 = {need:,}; "
            f"give more text, or lower --context-length (now {o.context_length}) or "
            f"adjust --val-fraction (now {o.val_fraction})"
            + (" or --val-files" if o.val_files else "")
        )


def _meta(o: _Options, sources: Sequence[Source], scan: _Scan, enc: _Encoded) -> dict[str, Any]:
    from tinylm import __version__

    tok = scan.tokenizer
    assert tok is not None
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tinylm_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": o.settings,
        "source": o.settings["source"],
        "inputs": [{"name": s.name, "format": s.format, "bytes": s.size, "sha256": d}
                   for s, d in zip(sources, scan.digests, strict=True)],
        "sha256": _combined(scan),
        "input_bytes": sum(s.size for s in sources),
        "input_chars": scan.chars,
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                      "special_tokens": list(tok.special_tokens), "eos_id": tok.eos_id,
                      "trained_on_chars": scan.trained_on},
        "vocab_size": tok.vocab_size,
        "dtype": dtype_for_vocab(tok.vocab_size).name,
        "train_tokens": enc.tokens["train"],
        "val_tokens": enc.tokens["val"],
        "max_token_id": enc.max_id,
        "documents": {"read": scan.documents, "train": enc.documents["train"],
                      "val": enc.documents["val"], "duplicates_removed": scan.duplicates,
                      "skipped_records": scan.bad.count, "first_skipped": scan.bad.first},
        "doc_separator": enc.separator,
        "split": enc.route,
        "val_fraction": o.val_fraction,
        "shard_tokens": o.shard_tokens,
        "shards": enc.shards,
        "context_length": o.context_length,
        "errors": o.errors,
        "workers": enc.workers,
        "allow_special": o.allow_special,
    }


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The objects that exist before prepare (torch's modules and the like: ~200k) are
    left out of the garbage collector's passes until it returns (``gc.freeze``): a full
    pass over them costs ~0.2 s, and in a forked worker it would write to every page
    that holds them. Only garbage cycles made before the call wait for its end to go."""
    if gc.get_freeze_count():  # the program manages freezing itself
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _phases(o: _Options, stage: Path, old_meta: dict[str, Any] | None) -> int:
    """scan -> encode (+ split) -> commit, staged in ``stage``; returns the input bytes."""
    sources, val_source = _sources(o, stage)  # what to read
    # pass 1: count, build the tokenizer; hash the inputs now if a dataset is there to compare
    scan = _scan(o, sources, hash_now=bool(old_meta) and not o.force)
    _after_scan(o, sources, scan, old_meta)
    enc = _encode(o, sources, val_source, scan, stage)  # pass 2: encode, split
    if scan.units is not None:  # read in units, the characters were counted in pass 2
        _check_text(o, scan)
    if [s.stamp() for s in sources] != scan.stamps:
        raise DataError("an input file changed while it was being prepared; "
                        "run tinylm prepare again when it is not being written")
    _check_lengths(o, enc)
    meta = _meta(o, sources, scan, enc)
    scan.tokenizer.save(stage / "tokenizer.json")  # type: ignore[union-attr]
    (stage / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    names = ["tokenizer.json", "meta.json",
             *(e["file"] for split in enc.shards.values() for e in split)]
    _commit(o.out, stage, names)  # move in, meta.json last
    return meta["input_bytes"]


def prepare(
    out_dir: str | Path,
    inputs: Sequence[str | Path] | None = None,
    *,
    corpus: str | None = None,
    tokenizer: str | Path | Tokenizer = "char",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    val_files: Sequence[str | Path] = (),
    context_length: int = 256,
    unknown: str = "error",
    errors: str = "strict",
    special_tokens: Sequence[str] = (),
    glob: str = "*",
    force: bool = False,
    progress: bool | None = None,
    bpe_train_mb: float | None = 32.0,
    chunk_bytes: int = CHUNK_BYTES,
    text_field: str = "text",
    skip_bad: bool = False,
    doc_separator: str | None = None,
    dedup: bool = False,
    shard_tokens: int = SHARD_TOKENS,
    workers: int | None = None,
    allow_special: bool = False,
) -> PreparedData:
    """Tokenize documents into ``out_dir`` (tokenizer.json, shards, meta.json).

    inputs          files (text, .jsonl[.gz|.zst], .parquet), folders (every non-hidden
                    file matching ``glob``, sorted; a ``datasets`` save_to_disk folder),
                    globs, or "-" for standard input; with neither inputs nor ``corpus``
                    the built-in corpus python-docs is used
    tokenizer       "char" (alphabet from the input), "bpe" (trained, ``vocab_size``),
                    a path to an existing tokenizer (tokenizer.json, a folder, or
                    GPT-2's vocab.json + merges.txt), or a Tokenizer object
    val_fraction    this fraction of the documents (every k-th) goes to val; with a
                    single document, the last fraction of its tokens
    val_files       inputs whose documents form val instead (val_fraction is unused)
    context_length  C the data is meant for: each split must hold at least C + 1 tokens
    unknown         char tokenizer policy for unseen characters later ("replace" adds <unk>)
    errors          "strict" stops at invalid UTF-8 or NUL bytes; "replace" substitutes U+FFFD
    force           overwrite a folder that holds a different dataset or other files
    bpe_train_mb    train BPE on at most this many MB, taken evenly along the input
                    (None: all of it)
    text_field      the records' text field; dotted for nested fields ("meta.text")
    skip_bad        skip records whose text field is missing, null or not a string
                    (counted in meta.json) instead of refusing the input
    doc_separator   between documents: None = the tokenizer's end-of-text token (a line
                    break if it has none), "" = nothing, a special token, or any text
    dedup           drop exact duplicate documents (by hash; memory grows ~100 B per doc)
    shard_tokens    at most this many tokens per shard file
    workers         encoding processes (None: the free cores for inputs over 16 MB, else 1);
                    the output is the same for any number
    allow_special   a special token's spelling in the text (e.g. "<|endoftext|>") becomes
                    that special id; by default it is ordinary text, as every user text is

    Nothing in ``out_dir`` changes unless the whole run succeeds.
    """
    t0 = time.perf_counter()
    kw = {k: v for k, v in locals().items() if k not in ("out_dir", "inputs", "tokenizer", "t0")}
    with _frozen_heap():
        o = _options(out_dir, inputs, tokenizer, kw)
        old_meta = _check_out(o)
        created = not o.out.exists()
        o.out.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(o.out)
        stage = _stage_name(o.out)
        stage.mkdir()
        try:
            total = _phases(o, stage, old_meta)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            if created:
                shutil.rmtree(o.out, ignore_errors=True)
            raise
        shutil.rmtree(stage, ignore_errors=True)
        seconds = time.perf_counter() - t0
        log.debug("prepared %s in %.2f s (%.1f MB/s)", display_path(o.out), seconds,
                  total / 1e6 / max(seconds, 1e-9))
        return load_prepared(o.out)


# --- batches for training ------------------------------------------------------------------


def _as_tensor(block: np.ndarray, device: Any) -> torch.Tensor:
    import torch

    t = torch.from_numpy(block.astype(np.int64))
    if device is not None and torch.device(device).type != "cpu":
        if torch.device(device).type == "cuda":
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
    return t


def get_batch(tokens: np.ndarray, batch_size: int, context_length: int,
              generator: torch.Generator, device: Any = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """B random windows of C + 1 tokens -> inputs x (B, C) and targets y (B, C), int64.

    ``y[:, t] == x[:, t + 1]`` for t < C - 1: y is the window shifted by one. Window
    starts come from ``torch.randint(..., generator=generator)`` only, so restoring
    ``generator.get_state()`` replays the same batches (exact resume).
    """
    import torch

    n = len(tokens)
    if n < context_length + 1:
        raise DataError(f"split has {n:,} tokens, fewer than context length + 1 = "
                        f"{context_length + 1:,}; use a shorter context length or more text")
    starts = torch.randint(n - context_length, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(context_length + 1)  # (B, C + 1)
    block = np.asarray(tokens[idx])
    xy = _as_tensor(block, device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def iter_windows(tokens: np.ndarray, context_length: int, batch_size: int,
                 stride: int | None = None, device: Any = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Walk a split in order for exact evaluation; yields ``(x, y, mask)`` batches.

    x, y are int64 (b, C) with b <= batch_size and y the window shifted by one;
    ``mask`` is bool (b, C) and marks the targets to score. Over the whole walk every
    target ``tokens[1:]`` is marked exactly once, so summing the masked losses and
    dividing by ``len(tokens) - 1`` gives the split's exact mean loss.

    Windows start at 0, stride, 2*stride, ... (stride defaults to C: non-overlapping);
    the last window is moved back to end at the last token, so every window is full.
    Each window marks only targets no earlier window scored: with stride < C, only its
    last ``stride`` targets after the first window (sliding-window perplexity, where each
    scored token sees at least C - stride tokens of context). A split shorter than C + 1
    gives one window of len(tokens) - 1.
    """
    n = len(tokens)
    if n < 2:
        raise DataError(f"split has {n} token(s); evaluation needs at least 2")
    c = min(context_length, n - 1)
    stride = c if stride is None else stride
    if not 1 <= stride <= c:
        raise DataError(f"stride must be between 1 and the context length {c}, got {stride}")
    starts = list(range(0, n - 1 - c + 1, stride))
    if starts[-1] + c < n - 1:
        starts.append(n - 1 - c)
    offsets = np.arange(c + 1)
    scored_until = 0  # targets tokens[1 .. scored_until] are already marked
    for b in range(0, len(starts), batch_size):
        s = np.asarray(starts[b:b + batch_size])
        block = np.asarray(tokens[s[:, None] + offsets])  # (b, C + 1)
        target_pos = s[:, None] + 1 + offsets[:-1]  # (b, C) position of each target
        prev_end = np.concatenate([[scored_until], s[:-1] + c])  # last target of the window before
        mask = target_pos > prev_end[:, None]
        scored_until = int(s[-1] + c)
        import torch

        xy = _as_tensor(block, device)
        m = torch.from_numpy(mask)
        if device is not None:
            m = m.to(device)
        yield xy[:, :-1].contiguous(), xy[:, 1:].contiguous(), m


__all__ = [
    "PreparedData",
    "default_workers",
    "dtype_for_vocab",
    "get_batch",
    "iter_windows",
    "load_prepared",
    "prepare",
    "read_meta",
    "safe_split",
]
