"""The worker pool of ``prepare``: what a worker does, and the pool that runs it.

:func:`mapped` runs a function over a stream of items in order, by a pool of forked
processes (at most 2 items per worker in flight, so memory stays flat) or in this
process for one worker; both run the same functions on the same state (``_WORKER``).
A worker reads units of the inputs (:class:`tinylm.data.readers.Unit`) and counts them
(pass 1, :func:`scan_unit`), encodes tasks the main process read (:func:`encode_task`)
or units it reads itself (:func:`encode_unit`), and hashes whole inputs beside them
(:func:`digest_tasks`). A worker writes its ids to a part file of the stage folder
(:class:`Part`) that the main process appends to the shards (:func:`take`).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tinylm.core.config import default_threads
from tinylm.data.encoding import Encoder, Route, Tasks, encode_pieces
from tinylm.data.options import MAX_RECORD_BYTES
from tinylm.data.readers import BadRecords, Source, Unit, count_unit, iter_unit
from tinylm.data.shards import ShardWriter, write_all
from tinylm.data.tokenizers import CharTokenizer

_PARALLELISM = "TOKENIZERS_PARALLELISM"


def default_workers() -> int:
    """Encoding processes for a large input: the free cores
    (:func:`tinylm.core.config.default_threads`)."""
    return default_threads()


# --- a worker's state ------------------------------------------------------------------------


class UnitJob(NamedTuple):
    """What a worker needs to read units (pass 1) and encode them (pass 2)."""

    sources: list[Source]
    text_field: str
    errors: str
    route: Route | None = None  # pass 2
    val_source: list[bool] | None = None
    enc: Encoder | None = None
    max_record_bytes: int = MAX_RECORD_BYTES


_WORKER: Encoder | UnitJob | None = None
_PARTS: list[Any] = [None, 0]  # a worker's stage folder and how many part files it wrote


def _init_worker(state: Encoder | UnitJob, stage: Path | None = None) -> None:
    global _WORKER
    os.environ[_PARALLELISM] = "false"  # one core per worker: the pool is the parallelism
    _WORKER = state
    _PARTS[:] = [stage, 0]


class Part(NamedTuple):
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


def _part(pair: tuple[np.ndarray, np.ndarray], docs: int = 0, chars: int = 0) -> Part:
    top = max((int(ids.max()) for ids in pair if ids.size), default=0)
    stage, n = _PARTS
    if stage is None:  # in this process
        return Part(None, pair, pair[0].size, pair[1].size, top, docs, chars)
    _PARTS[1] = n + 1
    path = str(stage / f".part-{os.getpid()}-{n}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for ids in pair:
            write_all(fd, ids)
    finally:
        os.close(fd)
    return Part(path, None, pair[0].size, pair[1].size, top, docs, chars)


def take(result: Part, writers: Sequence[ShardWriter]) -> int:
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


# --- what a worker does ---------------------------------------------------------------------


def digest(src: Source) -> str:
    """The sha256 of a source's raw bytes."""
    h = hashlib.sha256()
    with src.open_raw() as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _source_digest(k: int) -> str:
    """The sha256 of source ``k``, in a worker: a side task of either pass."""
    assert isinstance(_WORKER, UnitJob)
    return digest(_WORKER.sources[k])


def digest_tasks(sources: Sequence[Source]) -> list[tuple[Callable[[int], str], int]]:
    """Side tasks for :func:`mapped` that hash every source in the workers."""
    return [(_source_digest, k) for k in range(len(sources))]


def scan_unit(unit: Unit) -> tuple[int, BadRecords]:
    """Pass 1 of one unit in a worker: its documents and bad records (its characters are
    counted in pass 2, which reads the texts: a Parquet unit is often counted from its
    metadata alone, see :func:`tinylm.data.readers.count_unit`)."""
    job = _WORKER
    assert isinstance(job, UnitJob)
    bad = BadRecords()
    docs = count_unit(job.sources, unit, text_field=job.text_field, errors=job.errors,
                      bad=bad, max_record_bytes=job.max_record_bytes)
    return docs, bad


def encode_task(task: tuple[list[str], bytes, bytes]) -> Part:
    """Pass 2 of one task (documents read by the main process) in a worker."""
    assert isinstance(_WORKER, Encoder)
    return _part(encode_pieces(_WORKER, *task))


def encode_unit(item: tuple[Unit, int, tuple[bool, bool]]) -> Part:
    """Pass 2 of one unit in a worker: read, route (the unit's first document has rank
    ``rank``; ``started``: whether each split has documents before it), cut, encode."""
    unit, rank, started_before = item
    job = _WORKER
    assert isinstance(job, UnitJob) and job.enc is not None and job.val_source is not None
    tasks = Tasks(bpe=not isinstance(job.enc.tok, CharTokenizer))
    started, val = list(started_before), job.val_source[unit.source]
    out: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    docs = chars = 0

    def flush() -> None:
        for part, ids in zip(out, encode_pieces(job.enc, *tasks.take()), strict=True):
            part.append(ids)
    for text in iter_unit(job.sources, unit, text_field=job.text_field, errors=job.errors,
                          max_record_bytes=job.max_record_bytes):
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


# --- the pool -------------------------------------------------------------------------------


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


def mapped(workers: int, fn: Callable[[Any], Any], items: Iterator[Any],
           state: Encoder | UnitJob, *, side: SideTasks = (),
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


def _in_process(fn: Callable[[Any], Any], items: Iterator[Any], state: Encoder | UnitJob,
                side: SideTasks) -> Iterator[Any]:
    """What :func:`mapped` does for one worker: the same functions, on this core."""
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
            state: Encoder | UnitJob, side: SideTasks,
            started: Callable[[], None] | None, stage: Path | None) -> Iterator[Any]:
    """:func:`mapped` by a process pool: at most 2 items per worker in flight (memory
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


__all__ = [
    "Part",
    "UnitJob",
    "default_workers",
    "digest",
    "digest_tasks",
    "encode_task",
    "encode_unit",
    "mapped",
    "scan_unit",
    "take",
]
