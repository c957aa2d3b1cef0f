"""Input formats for ``prepare``: files, folders and globs -> a stream of documents.

Formats (by file name; compression by a trailing ``.gz`` / ``.zst``):

    text      any other file: one document per file, read in chunks
    jsonl     ``.jsonl`` / ``.ndjson`` (also ``.jsonl.gz``, ``.jsonl.zst``): one record a
              line, the document is the record's text field
    parquet   ``.parquet``: read one row group at a time, only the text column
    arrow     a Hugging Face ``datasets`` folder written by ``save_to_disk`` (a
              ``state.json`` listing Arrow stream files, or a ``dataset_dict.json`` of
              such folders), read one record batch at a time

:func:`iter_documents` yields ``(text, starts_document, source_index)``: a document
may come in several chunks (a large text file), the first flagged. A record whose
text field (``--text-field``, dotted for nested fields) is missing, null, not a
string or not valid JSON is counted in a :class:`BadRecords` with the first file and
line or row, and skipped; so is a JSONL line over ``max_record_bytes`` (default 16 MiB),
read in bounded memory (:mod:`tinylm.data.lines`). Nothing here touches the network.
"""

from __future__ import annotations

import codecs
import functools
import glob as globlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data.lines import bounded_lines, discard_rest, too_long
from tinylm.data.options import MAX_RECORD_BYTES

Progress = Callable[[int], None]
_JSONL = (".jsonl", ".ndjson")
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_GLOB_CHARS = set("*?[")
UNIT_BYTES = 8 << 20  # input bytes per unit that a worker reads on its own
MIN_UNIT_BYTES = 1 << 20  # the smallest unit near the end of the input


def display_path(path: str | Path) -> str:
    """A path as one printable line (:func:`tinylm.core.display.display_name`): bytes
    that are not UTF-8 shown as ``\\xNN``, control characters and bidi marks escaped."""
    return display_name(path)


@dataclass(frozen=True)
class Source:
    """One input: a file on disk or in-memory bytes (a built-in corpus)."""

    name: str
    path: Path | None = None
    data: bytes | None = None
    format: str = "text"  # text | jsonl | parquet | arrow
    compression: str | None = None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore[union-attr]

    def stamp(self) -> tuple[int, int] | None:
        """(size, mtime_ns) of a file, to notice an input that changes mid-run."""
        if self.path is None:
            return None
        st = self.path.stat()
        return st.st_size, st.st_mtime_ns

    def open_raw(self) -> IO[bytes]:
        return io.BytesIO(self.data) if self.data is not None else open(self.path, "rb")  # type: ignore[arg-type]


def file_source(path: Path, fmt: str | None = None) -> Source:
    """A Source for one file, its format and compression told by its name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = _COMPRESSION.get(suffixes[-1]) if suffixes else None
    inner = suffixes[-2] if compression and len(suffixes) > 1 else (
        suffixes[-1] if suffixes and not compression else "")
    if fmt is None:
        fmt = ("jsonl" if inner in _JSONL else "parquet" if inner == ".parquet"
               else "arrow" if inner == ".arrow" else "text")
    if fmt == "text" and inner == ".json":
        raise DataError(f"{display_path(path)} is a .json file, which prepare does not read "
                        f"as text (it would learn the braces); name it .jsonl if it holds one "
                        f"record per line, or leave it out with --glob")
    if fmt in ("parquet", "arrow") and compression:
        raise DataError(f"{display_path(path)}: compressed {fmt} files are not supported; "
                        f"Parquet compresses its own columns, so decompress it first")
    return Source(display_path(path), path=path, format=fmt, compression=compression)


# --- finding the inputs ----------------------------------------------------------------------


def _dataset_sources(folder: Path) -> list[Source] | None:
    """The Arrow files of a ``save_to_disk`` folder in order, or None if it is not one."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{display_path(folder)}/dataset_dict.json is unreadable ({exc}); "
                            f"save the dataset again with save_to_disk") from None
        found: list[Source] = []
        for split in splits:
            found.extend(_dataset_sources(folder / str(split)) or [])
        return found
    if not ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        files = [f["filename"] for f in json.loads((folder / "state.json").read_text())
                 ["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{display_path(folder)}/state.json is unreadable ({exc}); save the "
                        f"dataset again with save_to_disk") from None
    sources = []
    for name in files:
        path = folder / str(name)
        if Path(str(name)).name != str(name) or not path.is_file():
            raise DataError(f"datasets folder {display_path(folder)} lists {name!r}, which is "
                            f"missing; save the dataset again with save_to_disk")
        sources.append(file_source(path, "arrow"))
    return sources


def _walk(folder: Path, pattern: str, out: Path) -> Iterator[Source]:
    """Files under ``folder`` matching ``pattern``, sorted; hidden entries and ``out``
    skipped, a ``datasets`` folder inside taken as one dataset."""
    dataset = _dataset_sources(folder)
    if dataset is not None:
        yield from dataset
        return
    for entry in sorted(os.scandir(folder), key=lambda e: os.fsencode(e.name)):
        path = Path(entry.path)
        if entry.name.startswith(".") or path.resolve() == out:
            continue
        if entry.is_dir():
            yield from _walk(path, pattern, out)
        elif entry.is_file() and path.match(pattern):
            yield file_source(path)


def resolve_inputs(inputs: Sequence[str | Path], pattern: str, out: Path) -> list[Source]:
    """Files to read, in order: files, folders (sorted), globs; ``-`` is standard input."""
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
        shown = display_path(path)
        if path.is_file():
            sources.append(file_source(path))
        elif path.is_dir():
            found = list(_walk(path, pattern.removeprefix("**/"), out))
            if not found:
                raise DataError(f"input folder {shown} has no files matching {pattern!r}; "
                                f"put text, JSONL or Parquet files in it or pass --glob")
            sources.extend(found)
        elif path.exists():
            raise DataError(f"input {shown} is neither a file nor a folder; pass a file, a "
                            f"folder, a glob, or - for standard input")
        elif _GLOB_CHARS & set(str(raw)):
            matches = sorted(globlib.glob(str(raw), recursive=True), key=os.fsencode)
            if not matches:
                raise DataError(f"input pattern {shown} matches no files; check the pattern "
                                f"(quote it so the shell does not expand it)")
            sources.extend(resolve_inputs(matches, pattern, out))
        else:
            raise DataError(f"input {shown} does not exist; pass a text/JSONL/Parquet file, a "
                            f"folder, a glob, - for standard input, or --corpus python-docs")
    return sources


# --- bad records -------------------------------------------------------------------------------


@dataclass
class BadRecords:
    """Records without usable text: how many, and where the first one is."""

    count: int = 0
    first: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, where: str, reason: str, n: int = 1) -> None:
        if self.first is None:
            self.first = f"{where}: {reason}"
        self.count += n
        self.reasons[reason.split(" (")[0]] = self.reasons.get(reason.split(" (")[0], 0) + n


# --- text ----------------------------------------------------------------------------------------


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


def _open(src: Source, on_bytes: Progress | None) -> IO[bytes]:
    """The file's bytes, decompressed; ``on_bytes`` counts the bytes read from disk."""
    raw = src.open_raw()
    if on_bytes is not None:
        raw = io.BufferedReader(_Counting(raw, on_bytes), 1 << 20)  # type: ignore[assignment]
    if src.compression == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if src.compression == "zstd":
        zstandard = _require("zstandard", "zstd-compressed JSONL")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                            closefd=True)
        return io.BufferedReader(reader, 1 << 20)  # type: ignore[arg-type]
    return raw


class _Counting(io.RawIOBase):
    def __init__(self, raw: IO[bytes], on_bytes: Progress) -> None:
        self.raw, self.on_bytes = raw, on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self.raw.readinto(b)  # type: ignore[attr-defined]
        if n:
            self.on_bytes(n)
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _text(src: Source, errors: str, chunk_bytes: int, on_bytes: Progress | None
          ) -> Iterator[str]:
    """Decoded text of one file in chunks; strict mode refuses bad UTF-8 and NUL bytes."""
    strict = errors == "strict"
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if strict else "replace")
    pos = 0
    with _open(src, on_bytes) as f:
        while True:
            raw = f.read(chunk_bytes)
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
                raise _binary_error(src, base + len(text[: text.index("\x00")].encode()))
            if text:
                yield text
            if not raw:
                break


# --- records ---------------------------------------------------------------------------------


def _field(record: Any, path: Sequence[str]) -> tuple[str | None, str]:
    value = record
    for i, key in enumerate(path):
        if not isinstance(value, dict):
            where = ".".join(path[:i]) or "the record"
            return None, f"{where} is not an object"
        if key not in value:
            return None, f"field {'.'.join(path[:i + 1])!r} is missing"
        value = value[key]
    if value is None:
        return None, f"field {'.'.join(path)!r} is null"
    if not isinstance(value, str):
        return None, f"field {'.'.join(path)!r} is not a string ({type(value).__name__})"
    return value, ""


def _clean(text: str, where: str, errors: str) -> str:
    """Refuse (or replace) lone surrogates, which JSON allows and UTF-8 does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if errors == "strict":
            raise DataError(f"{where}: the text holds a lone surrogate (\\ud800-\\udfff), "
                            f"which is not Unicode text; fix the record or pass --errors "
                            f"replace") from None
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def _record(line: bytes, where: str, path: Sequence[str], errors: str, bad: BadRecords
            ) -> str | None:
    """The text of one JSONL line, or None (blank, or a bad record, counted)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        if errors == "strict":
            raise DataError(f"{where} is not UTF-8; convert the file or pass "
                            f"--errors replace") from None
        record = _loads(line.decode("utf-8", "replace"), where, bad)
    except (ValueError, RecursionError):
        bad.add(where, "not valid JSON")
        return None
    text, reason = _field(record, path)
    if text is None:
        bad.add(where, reason)
        return None
    if b"\\ud" in line or b"\\uD" in line:
        text = _clean(text, where, errors)
    return text


#: json's own C scanner (what json.loads runs, without its Python wrappers)
_SCAN_ONCE = json.JSONDecoder().scan_once
_SLOW = object()  # _fast_text's "decide with _record"


def _fast_text(line: bytes, path: Sequence[str]) -> Any:
    """The text of a JSONL line by json's C scanner alone, for the common case: UTF-8,
    an object from the line's first byte to its end (trailing JSON whitespace allowed)
    whose field ``path`` holds a string, no escaped surrogate. Anything else (a blank or
    indented line, invalid JSON or UTF-8, a bad record) is ``_SLOW``: then
    :func:`_record` decides, as ``json.loads`` does, and names the line."""
    if not line.startswith(b"{") or b"\\ud" in line or b"\\uD" in line:
        return _SLOW
    try:
        s = line.decode("utf-8")
        record, end = _SCAN_ONCE(s, 0)
    except (StopIteration, ValueError, RecursionError):  # UnicodeDecodeError included
        return _SLOW
    if end != len(s) and s[end:].strip(" \t\n\r"):
        return _SLOW
    text, _ = _field(record, path)
    return _SLOW if text is None else text


def _jsonl(src: Source, path: Sequence[str], errors: str, bad: BadRecords,
           on_bytes: Progress | None, cap: int = MAX_RECORD_BYTES) -> Iterator[str]:
    with _open(src, on_bytes) as f:  # bounded_lines, inlined: the hot loop of pass 1
        for lineno, line in enumerate(iter(functools.partial(f.readline, cap + 1), b""), 1):
            if len(line) > cap and not line.endswith(b"\n"):
                bad.add(f"{src.name} line {lineno}", too_long(discard_rest(f, len(line)), cap))
                continue
            text = _fast_text(line, path)
            if text is _SLOW:
                text = _record(line, f"{src.name} line {lineno}", path, errors, bad)
            if text is not None:
                yield text


def _loads(line: str, where: str, bad: BadRecords) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        bad.add(where, "not valid JSON")
        return None


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {module.split('.')[0]} package; install "
                        f"it with pip install 'tinylm[data]'") from None


def _arrow_texts(column: Any, path: Sequence[str], where: Callable[[int], str],
                 bad: BadRecords, errors: str) -> list[str]:
    """The strings of the Arrow column ``path[0]`` (nested fields by the rest of the
    path); values that are not strings are counted as bad records."""
    pa = _require("pyarrow", "Parquet and datasets files")
    pc = _require("pyarrow.compute", "Parquet and datasets files")
    for i, key in enumerate(path[1:], 1):
        if not pa.types.is_struct(column.type) or column.type.get_field_index(key) < 0:
            bad.add(where(0), f"field {'.'.join(path[:i + 1])!r} is missing", len(column))
            return []
        column = pc.struct_field(column, key)
    name = ".".join(path)
    values = column.to_pylist()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            or str(column.type) == "string_view"):
        for j, v in enumerate(values):
            if v is not None:
                bad.add(where(j), f"field {name!r} is not a string ({column.type})",
                        len(values) - j)
                return []
        bad.add(where(0), f"field {name!r} is null", len(values))
        return []
    out = []
    for j, v in enumerate(values):
        if v is None:
            bad.add(where(j), f"field {name!r} is null")
        else:
            out.append(v)
    return out


def _parquet(src: Source, path: Sequence[str], errors: str, bad: BadRecords,
             on_bytes: Progress | None, groups: range | None = None, row: int = 0,
             threads: bool = True) -> Iterator[str]:
    """The texts of a Parquet file (of its row groups ``groups``, the first being row
    ``row``, when given); ``threads``: pyarrow may decode on its thread pool."""
    pq = _require("pyarrow.parquet", "Parquet files")
    try:
        pf = pq.ParquetFile(src.path)
    except Exception as exc:  # pyarrow raises its own error types
        raise DataError(f"{src.name} is not a readable Parquet file ({_first_line(exc)}); "
                        f"check the file or leave it out") from None
    names = pf.schema_arrow.names
    total, done = max(src.size, 1), 0
    n_rows = max(pf.metadata.num_rows, 1)
    for g in range(pf.num_row_groups) if groups is None else groups:
        size = pf.metadata.row_group(g).num_rows
        if on_bytes is not None:  # counted as the group is read, before its records
            step = total * (row + size) // n_rows - done
            done += step
            on_bytes(step)
        if path[0] not in names:
            bad.add(f"{src.name} row {row}", f"field {path[0]!r} is missing (columns: "
                    f"{', '.join(names[:8])})", size)
        else:
            column = pf.read_row_group(g, columns=[path[0]], use_threads=threads
                                       ).column(0).combine_chunks()
            yield from _arrow_texts(column, path, lambda j, r=row: f"{src.name} row {r + j}",
                                    bad, errors)
        row += size


def _arrow(src: Source, path: Sequence[str], errors: str, bad: BadRecords,
           on_bytes: Progress | None) -> Iterator[str]:
    pa = _require("pyarrow", "datasets folders")
    row, done = 0, 0
    with pa.memory_map(str(src.path)) as mm:
        try:
            reader = pa.ipc.open_stream(mm)
        except Exception:
            try:
                reader = pa.ipc.open_file(mm)
            except Exception as exc:
                raise DataError(f"{src.name} is not a readable Arrow file "
                                f"({_first_line(exc)}); save the dataset again") from None
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if hasattr(reader, "num_record_batches") else reader
        for batch in batches:
            if on_bytes is not None:  # counted as the batch is read, before its records
                pos = min(mm.tell(), src.size)
                on_bytes(pos - done)
                done = pos
            if path[0] not in batch.schema.names:
                bad.add(f"{src.name} row {row}", f"field {path[0]!r} is missing (columns: "
                        f"{', '.join(batch.schema.names[:8])})", batch.num_rows)
            else:
                yield from _arrow_texts(batch.column(path[0]), path,
                                        lambda j, r=row: f"{src.name} row {r + j}", bad, errors)
            row += batch.num_rows
        if on_bytes is not None and src.size > done:
            on_bytes(src.size - done)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def iter_documents(sources: Sequence[Source], *, text_field: str = "text",
                   errors: str = "strict", chunk_bytes: int = 1 << 20,
                   bad: BadRecords | None = None, on_bytes: Progress | None = None,
                   max_record_bytes: int = MAX_RECORD_BYTES
                   ) -> Iterator[tuple[str, bool, int]]:
    """``(text, starts_document, source_index)`` for every document of every source.

    A text file is one document, yielded in chunks of about ``chunk_bytes`` (the first
    flagged); every good record of a JSONL/Parquet/Arrow file is one document. A JSONL
    line over ``max_record_bytes`` is a bad record, read in bounded memory and dropped.
    """
    path = text_field.split(".")
    if not text_field or not all(path):
        raise DataError(f"--text-field must be a field name or a dotted path such as "
                        f"meta.text, got {text_field!r}")
    bad = bad if bad is not None else BadRecords()
    readers = {"jsonl": functools.partial(_jsonl, cap=max_record_bytes), "parquet": _parquet,
               "arrow": _arrow}
    for k, src in enumerate(sources):
        if src.format == "text":
            first = True
            for chunk in _damaged(src, _text(src, errors, chunk_bytes, on_bytes)):
                yield chunk, first, k
                first = False
        else:
            for text in _damaged(src, readers[src.format](src, path, errors, bad, on_bytes)):
                yield text, True, k


def _damaged(src: Source, texts: Iterator[str]) -> Iterator[str]:
    """``texts``, read from a compressed ``src``: a file cut short or corrupt (gzip's
    EOFError or BadGzipFile, zstandard's ZstdError) becomes one DataError line."""
    if src.compression is None:
        yield from texts
        return
    kinds: tuple[type[BaseException], ...] = (EOFError, OSError)
    if src.compression == "zstd":
        kinds += (_require("zstandard", "zstd-compressed JSONL").ZstdError,)
    try:
        yield from texts
    except kinds as exc:
        raise DataError(f"{src.name} is not a complete {src.compression} file "
                        f"({_first_line(exc)}); it is cut short or damaged, so compress it "
                        f"again or leave it out") from None


# --- units: parts of a source that worker processes read on their own ---------------------


@dataclass(frozen=True)
class Unit:
    """A part of source ``source`` that a worker reads by itself: bytes [start, stop) of
    an uncompressed JSONL file, whose first line is number ``first`` (None: not counted
    when planned, see :class:`_UnitLines`), or the row groups [start, stop) of a Parquet
    file, whose first row is ``first``. ``size``: the input bytes it stands for."""

    source: int
    start: int
    stop: int
    first: int | None
    size: int


def _line_end(f: IO[bytes], pos: int, size: int) -> int:
    """The offset just past the first line break at or after ``pos`` (``size`` if none)."""
    f.seek(pos)
    while pos < size:
        block = f.read(1 << 16)
        if not block:
            break
        nl = block.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(block)
    return size


def _jsonl_units(k: int, src: Source, size: Callable[[int], int]) -> Iterator[Unit]:
    """Cut at the first line break after ``size(offset)`` bytes from each unit's start
    (:func:`iter_units`), found by seeking: planning reads a few KB per unit, not the
    file. A unit's first line number is not known here (``first`` None): a worker
    counts it only to report a bad record (:class:`_LineLabel`)."""
    start, end = 0, src.size
    with src.open_raw() as f:
        while start < end:
            stop = _line_end(f, start + size(start) - 1, end)
            yield Unit(k, start, stop, None, stop - start)
            start = stop


def _parquet_units(k: int, src: Source, size_at: Callable[[int], int]) -> Iterator[Unit]:
    """Runs of whole row groups of about ``size_at(offset)`` bytes (their uncompressed
    size, as pyarrow's metadata gives it; the offset is the file's share at that row)."""
    pq = _require("pyarrow.parquet", "Parquet files")
    try:
        meta = pq.ParquetFile(src.path).metadata
    except Exception as exc:
        raise DataError(f"{src.name} is not a readable Parquet file ({_first_line(exc)}); "
                        f"check the file or leave it out") from None
    n_rows, row, g0, size, done = max(meta.num_rows, 1), 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        rows = meta.row_group(g).num_rows
        end = src.size * (row + rows) // n_rows
        if size >= size_at(done) or g == meta.num_row_groups - 1:
            yield Unit(k, g0, g + 1, row, end - done)
            g0, size, done = g + 1, 0, end
        row += rows
    return


def units_apply(sources: Sequence[Source]) -> bool:
    """Whether every source can be read in units: uncompressed JSONL or Parquet files."""
    return all(s.path is not None and s.compression is None
               and s.format in ("jsonl", "parquet") for s in sources)


def _unit_size(unit_bytes: int, remaining: int, parts: int) -> int:
    """A unit's bytes: ``unit_bytes``, but at most 1/``parts`` of what remains (down to
    MIN_UNIT_BYTES), so the last units are small and no worker waits long at the end."""
    return min(unit_bytes, max(remaining // parts, MIN_UNIT_BYTES))


def iter_units(sources: Sequence[Source], unit_bytes: int | None = None, parts: int = 4
               ) -> Iterator[Unit]:
    """The units of ``sources`` (see :func:`units_apply`) in reading order, of about
    ``unit_bytes`` (default UNIT_BYTES) each, smaller near the end (``parts``: the
    workers that share the tail, times two or so)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    sizes = [s.size for s in sources]
    for k, src in enumerate(sources):
        after = sum(sizes[k + 1:])

        def size(offset: int, after: int = after, src_size: int = sizes[k]) -> int:
            return _unit_size(unit_bytes, src_size - offset + after, parts)
        if src.format == "jsonl":
            yield from _jsonl_units(k, src, size)
        else:
            yield from _parquet_units(k, src, size)


#: (path, stamp) -> (offset, line breaks before it): where this process last counted.
_LINE_MARKS: dict[tuple[str, Any], tuple[int, int]] = {}


class _UnitLines:
    """Line numbers of a JSONL unit whose first line number is not known yet: counted
    (once, from the last count made in this process) only when a label is shown."""

    def __init__(self, src: Source, unit: Unit) -> None:
        self.src, self.start, self._first = src, unit.start, unit.first

    def first(self) -> int:
        if self._first is None:
            key = (str(self.src.path), self.src.stamp())
            offset, lines = _LINE_MARKS.get(key, (0, 0))
            if offset > self.start:
                offset, lines = 0, 0
            with self.src.open_raw() as f:
                f.seek(offset)
                while offset < self.start:
                    block = f.read(min(1 << 20, self.start - offset))
                    if not block:
                        break
                    lines += block.count(b"\n")
                    offset += len(block)
            _LINE_MARKS[key] = (offset, lines)
            self._first = lines + 1
        return self._first


class _LineLabel:
    """``"{file} line {n}"`` for line ``index`` of a unit, formatted only when shown."""

    __slots__ = ("lines", "index")

    def __init__(self, lines: _UnitLines, index: int) -> None:
        self.lines, self.index = lines, index

    def __str__(self) -> str:
        return f"{self.lines.src.name} line {self.lines.first() + self.index}"



def _long_unit_lines(src: Source, unit: Unit, cap: int) -> Iterator[bytes | int]:
    """:func:`bounded_lines` of a unit, up to its end (a line break: no line crosses it)."""
    size, done = unit.stop - unit.start, 0
    with src.open_raw() as f:
        f.seek(unit.start)
        for line in bounded_lines(f, cap):
            yield line
            done += line if isinstance(line, int) else len(line)
            if done >= size:
                return


def _unit_lines(src: Source, unit: Unit, cap: int) -> Iterator[bytes | int]:
    """The lines of a JSONL unit as :func:`_lines` gives them (a line over ``cap``
    bytes: its size). A unit of up to ``cap`` + UNIT_BYTES bytes is read at once and
    split, the fast way; a longer one (it holds a line over the cap: units are cut at
    the first line break after UNIT_BYTES) is read a line at a time."""
    size = unit.stop - unit.start
    if size > cap + UNIT_BYTES:
        return _long_unit_lines(src, unit, cap)
    with src.open_raw() as f:
        f.seek(unit.start)
        data = f.read(size)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    if lines and max(map(len, lines)) > cap:
        return iter([line if len(line) <= cap else len(line) + 1 for line in lines])
    return iter(lines)


def iter_unit(sources: Sequence[Source], unit: Unit, *, text_field: str = "text",
              errors: str = "strict", bad: BadRecords | None = None,
              max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[str]:
    """The documents of one unit (what :func:`iter_documents` yields for that part), read
    on the calling thread alone: a worker process is one core of a pool."""
    src, path = sources[unit.source], text_field.split(".")
    bad = bad if bad is not None else BadRecords()
    if src.format == "parquet":
        yield from _parquet(src, path, errors, bad, None, range(unit.start, unit.stop),
                            unit.first or 0, threads=False)
        return
    numbers = _UnitLines(src, unit)
    for i, line in enumerate(_unit_lines(src, unit, max_record_bytes)):
        if isinstance(line, int):
            label: Any = _LineLabel(numbers, i)  # formatted only where shown
            bad.add(label, too_long(line, max_record_bytes))
            continue
        text = _fast_text(line, path)
        if text is _SLOW:
            text = _record(line, _LineLabel(numbers, i), path, errors, bad)  # type: ignore[arg-type]
        if text is not None:
            yield text


def _rows_without_nulls(src: Source, path: Sequence[str], groups: range | None = None
                        ) -> int | None:
    """The rows of Parquet row groups ``groups`` (None: all) when the file's metadata
    alone shows that every one holds a document: the text is a top-level string column
    whose statistics count no null in any of these groups. None when it does not tell
    (then read)."""
    pq = _require("pyarrow.parquet", "Parquet files")
    pa = _require("pyarrow", "Parquet files")
    try:
        pf = pq.ParquetFile(src.path)
    except Exception:  # the reading path names the error
        return None
    schema = pf.schema_arrow
    i = schema.get_field_index(path[0]) if len(path) == 1 else -1
    kind = schema.field(i).type if i >= 0 else None
    if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return None
    meta, rows = pf.metadata, 0
    for g in range(meta.num_row_groups) if groups is None else groups:
        group = meta.row_group(g)
        chunk = next((group.column(c) for c in range(group.num_columns)
                      if group.column(c).path_in_schema == path[0]), None)
        stats = chunk.statistics if chunk is not None else None
        if stats is None or not stats.has_null_count or stats.null_count != 0:
            return None
        rows += group.num_rows
    return rows


def counted_by_metadata(sources: Sequence[Source], text_field: str = "text") -> bool:
    """Whether every source is a Parquet file whose metadata alone gives its documents
    (:func:`count_unit` reads nothing for any of its units)."""
    path = text_field.split(".")
    return all(src.format == "parquet" and _rows_without_nulls(src, path) is not None
               for src in sources)


def count_unit(sources: Sequence[Source], unit: Unit, *, text_field: str = "text",
               errors: str = "strict", bad: BadRecords | None = None,
               max_record_bytes: int = MAX_RECORD_BYTES) -> int:
    """How many documents :func:`iter_unit` yields for ``unit`` (bad records counted into
    ``bad``). A Parquet unit whose metadata shows every row to be a document is counted
    from it alone, nothing decoded (pass 2 checks the count as it reads the texts)."""
    src = sources[unit.source]
    if src.format == "parquet":
        rows = _rows_without_nulls(src, text_field.split("."), range(unit.start, unit.stop))
        if rows is not None:
            return rows
    return sum(1 for _ in iter_unit(sources, unit, text_field=text_field, errors=errors,
                                    bad=bad, max_record_bytes=max_record_bytes))


__all__ = ["BadRecords", "Source", "Unit", "count_unit", "counted_by_metadata", "display_path",
           "file_source", "iter_documents", "iter_unit", "iter_units", "resolve_inputs",
           "units_apply"]
