"""Pass 1 of ``prepare``, the scan: hash the inputs, count documents and bad records,
find duplicates, build the char alphabet or train BPE on a bounded sample.

Inputs are read as one stream of documents here (:func:`tinylm.data.readers.iter_documents`),
or, with a given tokenizer and no dedup, in units by the workers
(:func:`scan_units`), which then also read them in pass 2. :class:`Scan` is what pass 1
learns, for pass 2 (:func:`tinylm.data.pipeline.prepare`'s encode phase).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinylm.data.encoding import UNBUILT, native_encoder, separator_text
from tinylm.data.options import PrepareOptions
from tinylm.data.plan import Plan
from tinylm.data.pool import (
    UnitJob,
    default_workers,
    digest,
    digest_tasks,
    mapped,
    scan_unit,
)
from tinylm.data.readers import (
    BadRecords,
    Source,
    Unit,
    counted_by_metadata,
    iter_documents,
    iter_units,
    units_apply,
)
from tinylm.data.tokenizers import BPETokenizer, CharTokenizer, Tokenizer

log = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 16 << 20  # smaller inputs are encoded in-process by default


def _progress(total: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, dynamic_ncols=True)


class Bar:
    """A tqdm bar over input bytes on a terminal, nothing otherwise (a callback)."""

    def __init__(self, total: int, desc: str, enabled: bool | None) -> None:
        self.bar = _progress(total, desc, enabled)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def workers_for(o: PrepareOptions, sources: Sequence[Source]) -> int:
    """The encoding processes for these inputs: ``workers``, else the free cores for
    large inputs (PARALLEL_MIN_BYTES), else 1."""
    total = sum(s.size for s in sources)
    return o.workers or (default_workers() if total >= PARALLEL_MIN_BYTES else 1)


@dataclass
class Scan:
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
    fast: Any = UNBUILT  # pass 2's native encoder, where pass 1 built it (or None)


def _hash_sources(sources: Sequence[Source], scan: Scan) -> None:
    for src in sources:
        scan.digests.append(digest(src))
        scan.stamps.append(src.stamp())


def _documents_pass(o: PrepareOptions, sources: Sequence[Source], scan: Scan, bar: Bar
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
            key = hasher.digest()
            dup = key in seen
            seen.add(key)
            scan.keep.append(0 if dup else 1)  # type: ignore[union-attr]
            scan.duplicates += dup

    for text, start, _ in iter_documents(sources, text_field=o.text_field, errors=o.errors,
                                         chunk_bytes=o.chunk_bytes, bad=scan.bad,
                                         on_bytes=on_bytes,
                                         max_record_bytes=o.max_record_bytes):
        if start:
            end_document()
            scan.documents += 1
            hasher = hashlib.blake2b(digest_size=16) if o.dedup else None
        if hasher is not None:
            hasher.update(text.encode("utf-8"))
        scan.chars += len(text)
        yield text
    end_document()


def scan_units(plan: Plan, sources: Sequence[Source], scan: Scan, workers: int,
               bar: Bar, hash_now: bool) -> None:
    """Pass 1 unit by unit (a given tokenizer, no dedup), by the workers, or in this
    process for one. The sources are hashed here only when ``hash_now`` (an output
    folder's dataset to compare with), else beside pass 2's units. Meanwhile a thread
    here builds pass 2's native BPE encoder (its class table takes ~0.2 s), which would
    otherwise wait between the passes (one worker: built first, on this core). Parquet
    files whose metadata gives every count are scanned here, without a pool: nothing to
    read."""
    assert scan.units is not None
    o = plan.opts
    job = UnitJob(list(sources), o.text_field, o.errors, max_record_bytes=o.max_record_bytes)
    units = scan.units
    scan.stamps = [s.stamp() for s in sources]

    def planned() -> Iterator[Unit]:  # planned while the workers read (lazily)
        for unit in iter_units(sources, parts=2 * workers):
            units.append(unit)
            yield unit
    def build() -> None:
        scan.fast = native_encoder(plan.given, o.allow_special)
    warm = threading.Thread(target=build, daemon=True)
    pool = 1 if not hash_now and counted_by_metadata(sources, o.text_field) else workers
    if pool == 1:
        build()
    results = mapped(pool, scan_unit, planned(), job,
                     side=digest_tasks(sources) if hash_now else (),
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


def scan_inputs(plan: Plan, sources: Sequence[Source], hash_now: bool) -> Scan:
    """Pass 1: hash the inputs, count documents, build the char alphabet or train BPE.
    Read in units (a given tokenizer, no dedup, uncompressed JSONL and Parquet: any
    number of workers, one included, read the same way), the inputs are hashed in pass 1
    only when ``hash_now``, else by pass 2's workers beside the encoding."""
    o, scan = plan.opts, Scan()
    total = sum(s.size for s in sources)
    workers = workers_for(o, sources)
    # A tokenizer built from pass 1's stream (char, bpe) needs it here, in one process.
    if not o.dedup and not plan.builds_tokenizer and units_apply(sources):
        scan.units = []
    else:
        _hash_sources(sources, scan)
    bar = Bar(total, "train bpe" if plan.tok_spec == "bpe" else "scan", o.progress)
    try:
        if scan.units is not None:
            scan_units(plan, sources, scan, workers, bar, hash_now)
            scan.tokenizer = plan.given
            return scan
        texts = _documents_pass(o, sources, scan, bar)
        if plan.tok_spec == "char":
            seen = np.zeros(0x110000, dtype=bool)
            for text in texts:
                CharTokenizer.seen_code_points(text, seen)
            scan.tokenizer = _char_tokenizer(o, seen, scan)
        elif plan.tok_spec == "bpe":
            scan.tokenizer = _train_bpe(o, texts, total, scan)
        else:
            for _ in texts:
                pass
            scan.tokenizer = plan.given
    finally:
        bar.close()
    return scan


def _char_tokenizer(o: PrepareOptions, seen: np.ndarray, scan: Scan) -> Tokenizer:
    tok = CharTokenizer.from_code_points(seen, o.unknown, o.special_tokens)
    sep = separator_text(o.doc_separator, tok)
    if scan.documents > 1 and sep and any(not seen[ord(c)] for c in sep):
        CharTokenizer.seen_code_points(sep, seen)  # the separator's characters join in
        tok = CharTokenizer.from_code_points(seen, o.unknown, o.special_tokens)
    return tok


def _train_bpe(o: PrepareOptions, texts: Iterator[str], total: int, scan: Scan) -> Tokenizer:
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


__all__ = ["PARALLEL_MIN_BYTES", "Bar", "Scan", "scan_inputs", "scan_units", "workers_for"]
