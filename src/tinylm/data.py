"""Prepared data: text -> tokenizer + token shards, and batches for training.

``prepare()`` turns a file, a folder of files, standard input or a built-in corpus
into a folder holding

    tokenizer.json   the tokenizer (one Hugging Face tokenizers JSON, any kind)
    train.bin        the first (1 - val_fraction) of the token stream, raw little-endian
    val.bin          the rest; uint16 when the vocabulary fits (V <= 65536), else uint32
    meta.json        counts, dtype, source, tokenizer kind, sha256 of the inputs

It streams: the input is read in chunks (two passes: one to build the char alphabet
or train the BPE and hash the input, one to encode), so memory stays flat however
large the corpus. BPE text is encoded in parallel batches of pieces cut only where
GPT-2's pre-tokenizer cannot look across the cut (:func:`safe_split`), so the shards
equal a one-shot encoding of the whole text. Outputs are written under temporary
names and renamed at the end, meta.json last: a folder with meta.json is complete.

Training reads the shards memory-mapped: :func:`get_batch` draws random windows of
C+1 tokens (inputs (B, C), targets shifted by one) from a ``torch.Generator``, and
:func:`iter_windows` walks a split sequentially so every target is scored once.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from tinylm.corpora import corpus_names, load_corpus
from tinylm.errors import DataError
from tinylm.tokenizers import (
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
FORMAT_VERSION = 1
OUTPUT_NAMES = ("tokenizer.json", "train.bin", "val.bin", "meta.json")
CHUNK_BYTES = 1 << 20  # bytes read per step of the stream (fits in cache: fastest)
PIECE_CHARS = 1 << 16  # target length of one BPE piece handed to encode_batch
BATCH_PIECES = 32  # pieces per encode_batch call (parallel over the CPU cores)
_MAX_CARRY = 64 << 20  # chars without any safe cut point before we give up streaming


# --- sources -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One input: a file on disk or in-memory bytes (a built-in corpus)."""

    name: str
    path: Path | None = None
    data: bytes | None = None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore[union-attr]

    def open(self) -> IO[bytes]:
        import io

        return io.BytesIO(self.data) if self.data is not None else open(self.path, "rb")  # type: ignore[arg-type]


def _resolve_inputs(inputs: Sequence[str | Path], glob: str, out: Path) -> list[Source]:
    """Files to read, in order; a folder's files sorted, hidden ones and --out skipped."""
    sources: list[Source] = []
    out = out.resolve()
    for raw in inputs:
        if str(raw) == "-":
            if sys.stdin is None or sys.stdin.isatty():
                raise DataError("--input - reads standard input, but nothing is piped in; "
                                "use e.g. cat file.txt | tinylm prepare --input - --out DIR")
            sources.append(Source("<stdin>"))
            continue
        path = Path(raw)
        if path.is_file():
            sources.append(Source(str(path), path=path))
        elif path.is_dir():
            found = sorted(
                p for p in path.glob(glob if glob.startswith("**") else f"**/{glob}")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and out not in p.resolve().parents
            )
            if not found:
                raise DataError(f"input folder {path} has no files matching {glob!r}; "
                                f"put text files in it or pass --glob")
            sources.extend(Source(str(p), path=p) for p in found)
        elif path.exists():
            raise DataError(f"input {path} is neither a file nor a folder; pass a text file, "
                            f"a folder of text files, or - for standard input")
        else:
            raise DataError(f"input {path} does not exist; pass a text file, a folder of text "
                            f"files, - for standard input, or --corpus python-docs")
    return sources


# --- streaming text ------------------------------------------------------------------------


def _utf8_error(src: Source, offset: int, data: bytes, start: int) -> DataError:
    byte = data[start] if start < len(data) else None
    what = f"byte 0x{byte:02x}" if byte is not None else "a truncated character"
    return DataError(
        f"{src.name} is not UTF-8 text: {what} at byte offset {offset} cannot be decoded; "
        f"convert it to UTF-8, leave it out, or pass --errors replace to substitute U+FFFD"
    )


def _binary_error(src: Source, offset: int) -> DataError:
    return DataError(f"{src.name} looks binary: NUL byte at byte offset {offset}; pass text "
                     f"files only (see --glob), or --errors replace to keep going")


def _iter_text(sources: Sequence[Source], errors: str, chunk_bytes: int,
               on_bytes: Callable[[int], None] | None = None,
               hashes: list[Any] | None = None) -> Iterator[str]:
    """Decoded text of all sources in order, in chunks of about ``chunk_bytes``.

    A file that does not end in a newline is followed by one, so files never run
    into each other. With errors="strict", invalid UTF-8 and NUL bytes (binary files)
    raise a DataError naming the file and byte offset.
    """
    strict = errors == "strict"
    last_char = "\n"
    for k, src in enumerate(sources):
        if k and last_char != "\n":
            yield "\n"
            last_char = "\n"
        decoder = codecs.getincrementaldecoder("utf-8")("strict" if strict else "replace")
        hasher = hashes[k] if hashes is not None else None
        pos = 0
        with src.open() as f:
            while True:
                raw = f.read(chunk_bytes)
                if hasher is not None:
                    hasher.update(raw)
                pending = decoder.getstate()[0]
                base = pos - len(pending)
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as exc:
                    nul = (pending + raw).find(b"\x00", 0, exc.start)
                    if nul >= 0:
                        raise _binary_error(src, base + nul) from None
                    raise _utf8_error(src, base + exc.start, pending + raw, exc.start) from None
                pos += len(raw)
                if strict and "\x00" in text:
                    at = base + len(text[: text.index("\x00")].encode("utf-8"))
                    raise _binary_error(src, at)
                if on_bytes is not None:
                    on_bytes(len(raw))
                if text:
                    last_char = text[-1]
                    yield text
                if not raw:
                    break


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


def _bpe_pieces(chunks: Iterator[str], piece_chars: int | None = None) -> Iterator[str]:
    """Re-cut a text stream into pieces of about ``piece_chars`` at safe points only."""
    piece_chars = piece_chars or PIECE_CHARS
    carry = ""
    for chunk in chunks:
        buf = carry + chunk if carry else chunk
        start = 0
        while len(buf) - start > piece_chars:
            p = safe_split(buf, start, start + piece_chars)
            if p < 0:  # no cut in this window: look further, else wait for more text
                p = safe_split(buf, start + piece_chars, len(buf))
                if p < 0:
                    break
            yield buf[start:p]
            start = p
        carry = buf[start:]
        if len(carry) > _MAX_CARRY:
            raise DataError(
                f"the input has over {_MAX_CARRY:,} characters without a space or line break "
                f"before a non-space, which byte-level BPE cannot stream; is it text? "
                f"Use the char tokenizer or add line breaks"
            )
    if carry:
        yield carry


def _batches(pieces: Iterator[str], n: int = BATCH_PIECES) -> Iterator[list[str]]:
    batch: list[str] = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


# --- the prepared folder -------------------------------------------------------------------


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared folder: memory-mapped 1-D token arrays, meta.json and the tokenizer."""

    dir: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])


def _incomplete(path: Path, what: str) -> DataError:
    return DataError(f"prepared data folder {path} is incomplete or corrupt ({what}); "
                     f"run tinylm prepare --out {path} again")


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def load_prepared(path: str | Path) -> PreparedData:
    """Open a folder written by :func:`prepare` (shards memory-mapped read-only)."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"prepared data folder {path} does not exist; create it with "
                        f"tinylm prepare --out {path}")
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise _incomplete(path, "no meta.json")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype = np.dtype(meta["dtype"])
        counts = {"train": int(meta["train_tokens"]), "val": int(meta["val_tokens"])}
        vocab_size = int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _incomplete(path, f"unreadable meta.json: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise DataError(f"{meta_path} is not a tinylm prepared-data meta.json; "
                        f"run tinylm prepare --out {path}")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise DataError(f"{path} was prepared by a newer tinylm (format version "
                        f"{meta.get('version')}); upgrade tinylm or prepare it again")
    arrays = {}
    for split, count in counts.items():
        shard = path / f"{split}.bin"
        if not shard.is_file():
            raise _incomplete(path, f"no {split}.bin")
        size = shard.stat().st_size
        if size != count * dtype.itemsize:
            raise _incomplete(path, f"{split}.bin has {size} bytes, meta.json says "
                                    f"{count} {dtype.name} tokens = {count * dtype.itemsize}")
        arrays[split] = _map(shard, dtype, count)
    if not (path / "tokenizer.json").is_file():
        raise _incomplete(path, "no tokenizer.json")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    if tokenizer.vocab_size != vocab_size:
        raise _incomplete(path, f"tokenizer.json has {tokenizer.vocab_size} tokens, "
                                f"meta.json says {vocab_size}")
    return PreparedData(path, arrays["train"], arrays["val"], meta, tokenizer)


# --- prepare -------------------------------------------------------------------------------


def _check_args(tokenizer: str, vocab_size: int, val_fraction: float, context_length: int,
                unknown: str, errors: str, special_tokens: Sequence[str]) -> None:
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise DataError(f"val fraction must be between 0 and 1 (exclusive), got "
                        f"{val_fraction!r}; the default is 0.1")
    if isinstance(context_length, bool) or not isinstance(context_length, int) \
            or context_length < 1:
        raise DataError(f"context length must be a positive integer, got {context_length!r}")
    if unknown not in ("error", "replace"):
        raise DataError(f"--unknown must be error or replace, got {unknown!r}")
    if errors not in ("strict", "replace"):
        raise DataError(f"--errors must be strict or replace, got {errors!r}")
    if tokenizer == "bpe":
        minimum = 256 + len(set(special_tokens))
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
                or vocab_size < minimum:
            raise DataError(
                f"vocab size {vocab_size!r} is too small for byte-level BPE: it needs the 256 "
                f"byte tokens plus {len(set(special_tokens))} special token(s), so at least "
                f"{minimum}; use --vocab-size {max(minimum, 512)} or more (default 4096)"
            )


def _tmp_name(out: Path, name: str) -> Path:
    return out / f".{name}.tmp-{os.getpid()}"


def _remove_stale_temps(out: Path) -> None:
    """Delete temporary files left by prepare runs that were killed."""
    for p in out.glob(".*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except PermissionError:
            pass


def _check_out(out: Path, settings: dict[str, Any], force: bool) -> dict[str, Any] | None:
    """Refuse an output folder that holds something else; return its old meta, if any."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file, not a folder; pass a folder path to --out")
    if not out.is_dir():
        return None
    old = None
    meta_path = out / "meta.json"
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        if not force and (not isinstance(old, dict) or old.get("format") != FORMAT):
            raise DataError(f"output folder {out} has a meta.json that tinylm did not write; "
                            f"choose another --out, or pass --force to replace it")
        if not force and old.get("settings") != settings:
            raise DataError(
                f"output folder {out} already holds a different dataset "
                f"({_describe_settings(old.get('settings') or {})}; this run: "
                f"{_describe_settings(settings)}); choose another --out, "
                f"or pass --force to overwrite it"
            )
    elif not force:
        foreign = sorted(p.name for p in out.iterdir()
                         if p.name not in OUTPUT_NAMES and ".tmp-" not in p.name)
        if foreign:
            raise DataError(f"output folder {out} is not empty (has {', '.join(foreign[:3])}"
                            f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new "
                            f"--out, or pass --force to write there anyway")
    return old


def _describe_settings(s: dict[str, Any]) -> str:
    tok = s.get("tokenizer", {})
    return (f"source {s.get('source', '?')}, tokenizer {tok.get('kind', '?')}"
            + (f" vocab {tok['vocab_size']}" if tok.get("vocab_size") else "")
            + f", val fraction {s.get('val_fraction', '?')}")


def _progress(total: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, dynamic_ncols=True)


class _Bar:
    """A tqdm bar on a terminal, nothing otherwise; used as a byte counter callback."""

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


def prepare(
    out_dir: str | Path,
    inputs: Sequence[str | Path] | None = None,
    *,
    corpus: str | None = None,
    tokenizer: str | Path | Tokenizer = "char",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    context_length: int = 256,
    unknown: str = "error",
    errors: str = "strict",
    special_tokens: Sequence[str] = (),
    allow_special: bool = False,
    glob: str = "*",
    force: bool = False,
    progress: bool | None = None,
    bpe_train_mb: float | None = 32.0,
    chunk_bytes: int = CHUNK_BYTES,
) -> PreparedData:
    """Tokenize text into ``out_dir`` (tokenizer.json, train.bin, val.bin, meta.json).

    inputs          files, folders (every non-hidden file matching ``glob``, sorted) or
                    "-" for standard input; with neither inputs nor ``corpus`` the
                    built-in corpus python-docs is used
    tokenizer       "char" (alphabet from the input), "bpe" (trained, ``vocab_size``),
                    a path to an existing tokenizer (tokenizer.json, a folder, or
                    GPT-2's vocab.json + merges.txt), or a Tokenizer object
    val_fraction    the last fraction of the token stream goes to val.bin
    context_length  C the data is meant for: each split must hold at least C + 1 tokens
    unknown         char tokenizer policy for unseen characters later ("replace" adds <unk>)
    special_tokens  extra special tokens for a char or bpe tokenizer, after the standard
                    ones it always gets (tokenizers.STANDARD_SPECIALS: end-of-text and
                    the chat format's role and end-of-turn tokens)
    allow_special   encode special tokens' spellings in the text as those tokens (by
                    default they are ordinary text and never become special ids)
    errors          "strict" stops at invalid UTF-8 or NUL bytes; "replace" substitutes U+FFFD
    force           overwrite a folder that holds a different dataset or other files
    bpe_train_mb    train BPE on at most this many MB, taken evenly along the input
                    (None: all of it). Merges for a few thousand tokens settle after a
                    few MB; the cap bounds training time and memory on huge corpora

    Nothing in ``out_dir`` changes unless the whole run succeeds.
    """
    t0 = time.perf_counter()
    tok_spec = "given" if isinstance(tokenizer, Tokenizer) else str(tokenizer)
    special_tokens = standard_special_tokens(special_tokens)
    _check_args(tok_spec, vocab_size, val_fraction, context_length, unknown, errors,
                special_tokens)
    if bpe_train_mb is not None and not (isinstance(bpe_train_mb, (int, float))
                                         and bpe_train_mb > 0):
        raise DataError(f"BPE training size must be a positive number of MB, got "
                        f"{bpe_train_mb!r}")
    if inputs and corpus:
        raise DataError("pass either inputs or a corpus, not both")
    if not inputs:
        corpus = corpus or "python-docs"
        if corpus not in corpus_names():
            raise DataError(f"unknown corpus {corpus!r}; built-in corpora: "
                            f"{', '.join(corpus_names())}")
    out = Path(out_dir)

    given: Tokenizer | None = None
    tok_settings: dict[str, Any]
    if tok_spec == "char":
        tok_settings = {"kind": "char", "unknown": unknown, "special_tokens": special_tokens}
    elif tok_spec == "bpe":
        tok_settings = {"kind": "bpe", "vocab_size": vocab_size, "special_tokens": special_tokens,
                        "train_mb": bpe_train_mb}
    else:
        given = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tok_spec)
        where = "object" if tok_spec == "given" else str(Path(tok_spec).resolve())
        tok_settings = {"kind": given.kind, "path": where,
                        "sha256": hashlib.sha256(
                            json.dumps(given.to_hf_json(), sort_keys=True).encode()).hexdigest()}

    sources = _resolve_inputs(inputs, glob, out) if inputs else []
    source_desc = (f"corpus:{corpus}" if corpus else
                   ", ".join(str(Path(x).resolve()) if str(x) != "-" else "-" for x in inputs))
    settings = {"source": source_desc, "tokenizer": tok_settings,
                "val_fraction": val_fraction, "errors": errors}
    if allow_special:
        settings["allow_special"] = True
    old_meta = _check_out(out, settings, force)

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    temps = {name: _tmp_name(out, name) for name in (*OUTPUT_NAMES, "stdin")}
    ok = False
    try:
        if corpus:
            sources = [Source(f"corpus {corpus}", data=load_corpus(corpus).encode("utf-8"))]
        elif any(s.name == "<stdin>" for s in sources):
            # Standard input can be read once; spool it so both passes can read it.
            with open(temps["stdin"], "wb") as f:
                shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
            sources = [Source("<stdin>", path=temps["stdin"]) if s.name == "<stdin>" else s
                       for s in sources]
        total_bytes = sum(s.size for s in sources)
        if total_bytes == 0:
            raise DataError(f"input is empty ({source_desc}); pass a file with text in it")

        # Pass 1: hash the input and build the char alphabet or train the BPE.
        hashes = [hashlib.sha256() for _ in sources]
        bar = _Bar(total_bytes, "scan" if tok_spec != "bpe" else "train bpe", progress)
        n_chars = 0
        trained_on = None
        try:
            if tok_spec == "char":
                seen = np.zeros(0x110000, dtype=bool)
                for text in _iter_text(sources, errors, chunk_bytes, bar, hashes):
                    n_chars += len(text)
                    CharTokenizer.seen_code_points(text, seen)
                tok: Tokenizer = CharTokenizer.from_code_points(seen, unknown, special_tokens)
            elif tok_spec == "bpe":
                # Train on at most bpe_train_mb, taken evenly along the input, so memory
                # stays bounded on huge corpora; every byte is still hashed and encoded.
                budget = total_bytes if bpe_train_mb is None else int(bpe_train_mb * 1e6)
                share = min(1.0, max(budget, 1) / total_bytes)
                counts = {"chars": 0, "read": 0, "fed": 0}

                def on_bytes(n: int) -> None:
                    bar(n)
                    counts["read"] += n

                def training_text() -> Iterator[str]:
                    # Cut points do not matter here: they only split a few word counts.
                    last = 0
                    for text in _iter_text(sources, errors, chunk_bytes, on_bytes, hashes):
                        counts["chars"] += len(text)
                        new, last = counts["read"] - last, counts["read"]
                        if counts["fed"] < counts["read"] * share:
                            counts["fed"] += new
                            yield text

                tok = BPETokenizer.train(training_text(), vocab_size, special_tokens)
                n_chars = counts["chars"]
                trained_on = counts["fed"]
                if tok.vocab_size < vocab_size:
                    log.warning("BPE stopped at %d tokens (asked for %d): the training text "
                                "has no more pairs to merge", tok.vocab_size, vocab_size)
            else:
                assert given is not None
                tok = given
                for text in _iter_text(sources, errors, chunk_bytes, bar, hashes):
                    n_chars += len(text)
        finally:
            bar.close()
        if n_chars == 0:
            raise DataError(f"input is empty ({source_desc}); pass a file with text in it")
        digests = [h.hexdigest() for h in hashes]
        combined = hashlib.sha256("".join(digests).encode()).hexdigest()
        if old_meta and not force and old_meta.get("sha256") != combined:
            raise DataError(f"output folder {out} already holds a dataset prepared from "
                            f"different input text; choose another --out, or pass --force "
                            f"to overwrite it")

        # Pass 2: encode into one token file, re-hashing to catch inputs that change.
        dtype = dtype_for_vocab(tok.vocab_size)
        hashes2 = [hashlib.sha256() for _ in sources]
        bar = _Bar(total_bytes, f"encode {tok.kind}", progress)
        n_tokens = 0
        try:
            with open(temps["train.bin"], "wb") as f:
                chunks = _iter_text(sources, errors, chunk_bytes, bar, hashes2)
                if isinstance(tok, CharTokenizer):
                    batches: Iterator[Sequence[str]] = ([c] for c in chunks)
                else:
                    if not getattr(tok, "split_safe", False):
                        log.warning("tokenizer %s is not GPT-2 byte-level BPE; the input is "
                                    "encoded in pieces cut at spaces and line breaks",
                                    tok_spec)
                    batches = _batches(_bpe_pieces(chunks))
                for batch in batches:
                    ids = tok.encode_array(batch, allow_special=allow_special)
                    f.write(ids.astype(dtype, copy=False).tobytes())
                    n_tokens += ids.size
        finally:
            bar.close()
        if [h.hexdigest() for h in hashes2] != digests:
            raise DataError("an input file changed while it was being prepared; "
                            "run tinylm prepare again when it is not being written")

        n_val = int(round(n_tokens * val_fraction))
        n_train = n_tokens - n_val
        need = context_length + 1
        if min(n_train, n_val) < need:
            raise DataError(
                f"input is too short: {n_tokens:,} tokens split into {n_train:,} train + "
                f"{n_val:,} val, but each split needs at least context length + 1 = {need:,}; "
                f"give more text, or lower --context-length (now {context_length}) or "
                f"adjust --val-fraction (now {val_fraction})"
            )
        # The last n_val tokens become val.bin; train.bin is truncated in place.
        with open(temps["train.bin"], "r+b") as src, open(temps["val.bin"], "wb") as dst:
            src.seek(n_train * dtype.itemsize)
            shutil.copyfileobj(src, dst, 16 << 20)
            src.truncate(n_train * dtype.itemsize)
        tok.save(temps["tokenizer.json"])

        from tinylm import __version__

        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tinylm_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": settings,
            "source": source_desc,
            "inputs": [{"name": s.name, "bytes": s.size, "sha256": d}
                       for s, d in zip(sources, digests, strict=True)],
            "sha256": combined,
            "input_bytes": total_bytes,
            "input_chars": n_chars,
            "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                          "special_tokens": list(tok.special_tokens), "eos_id": tok.eos_id,
                          "trained_on_bytes": trained_on},
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "train_tokens": n_train,
            "val_tokens": n_val,
            "val_fraction": val_fraction,
            "context_length": context_length,
            "errors": errors,
        }
        temps["meta.json"].write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
        for name in OUTPUT_NAMES:
            _fsync(temps[name])
        # Commit: drop the old completeness marker first, meta.json goes in last.
        (out / "meta.json").unlink(missing_ok=True)
        for name in OUTPUT_NAMES:
            os.replace(temps[name], out / name)
        try:
            dir_fd = os.open(out, os.O_RDONLY)
            os.fsync(dir_fd)
            os.close(dir_fd)
        except OSError:  # not every platform can fsync a directory
            pass
        ok = True
    finally:
        for p in temps.values():
            p.unlink(missing_ok=True)
        if not ok and created:
            try:
                out.rmdir()
            except OSError:
                pass
    seconds = time.perf_counter() - t0
    log.debug("prepared %s in %.2f s (%.1f MB/s)", out, seconds, total_bytes / 1e6 / seconds)
    return load_prepared(out)


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
    "dtype_for_vocab",
    "get_batch",
    "iter_windows",
    "load_prepared",
    "prepare",
    "safe_split",
]
