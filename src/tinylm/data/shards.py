"""Token shards: fixed-size files of raw little-endian ids, written and read back.

A prepared split is a list of shard files ``{split}-00000.bin``, ``{split}-00001.bin``,
... of at most ``shard_tokens`` ids each (uint16 or uint32), listed in meta.json's
``"shards"`` index with their token counts. :class:`ShardWriter` fills them in order;
:class:`TokenShards` reads any number of them memory-mapped as one 1-D sequence:
``len``, integer, slice and integer-array indexing, the same values as the
concatenation, so the batch sampler and evaluation see one stream whatever the
sharding (a window may run across a shard boundary, exactly as in one file).
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: What prepare writes; a meta.json naming any other dtype is refused.
DTYPES = ("uint16", "uint32")
SHARD_RE = re.compile(r"^(train|val)-\d{5}\.bin$")


#: A shard's bytes go to disk in the background every this many bytes written (and when
#: it is full), so the fsync before the commit finds little left to write.
SYNC_BYTES = 16 << 20


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class _SyncBehind:
    """fsyncs of written files, one at a time in a background thread: the disk writes
    while the caller goes on. :meth:`wait` re-raises the first error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def start(self, path: Path) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # one in flight is enough: the next call or the commit catches up
        self._thread = threading.Thread(target=self._sync, args=(path,), daemon=True)
        self._thread.start()

    def _sync(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._error = self._error or exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def write_all(fd: int, data: Any) -> None:
    """Write every byte of ``data`` (bytes or a contiguous array) to file descriptor
    ``fd`` at its position (a write may take less than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


#: copy_file_range's errors that mean "not here" (another file system, an old kernel):
#: the bytes are then read and written instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Append ``nbytes`` of file ``src`` from byte ``offset`` to ``dst`` at its position:
    copied by the kernel (``os.copy_file_range``) where it can, else read and written."""
    kernel = getattr(os, "copy_file_range", None)
    while nbytes:
        n = 0
        if kernel is not None:
            try:
                n = kernel(src, dst, nbytes, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = None
                continue
        else:
            block = os.pread(src, min(nbytes, 8 << 20), offset)
            write_all(dst, block)
            n = len(block)
        if n == 0:
            raise OSError(errno.EIO, f"a part file ended {nbytes} bytes early")
        offset += n
        nbytes -= n


class ShardWriter:
    """Appends ids to ``folder/{split}-NNNNN.bin``, a new file every ``shard_tokens``:
    arrays (:meth:`write`) or ranges of another file of ids (:meth:`write_from`)."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype = folder, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.counts: list[int] = []
        self._fd: int | None = None
        self.tokens = 0
        self._unsynced = 0
        self._sync = _SyncBehind()

    def _path(self) -> Path:
        return self.folder / shard_name(self.split, len(self.counts) - 1)

    def _sync_behind(self) -> None:
        self._sync.start(self._path())
        self._unsynced = 0

    def _roll(self) -> None:
        if self._fd is not None:
            self._sync_behind()
            os.close(self._fd)
        self.counts.append(0)
        self._fd = os.open(self._path(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def _append(self, count: int, put: Any) -> None:
        """Append ``count`` ids, ``put(fd, first, n)`` writing ids [first, first + n)."""
        done = 0
        while done < count:
            if self._fd is None or self.counts[-1] >= self.shard_tokens:
                self._roll()
            take = min(count - done, self.shard_tokens - self.counts[-1])
            put(self._fd, done, take)
            self.counts[-1] += take
            self._unsynced += take * self.dtype.itemsize
            done += take
        self.tokens += count
        if self._unsynced >= SYNC_BYTES:
            self._sync_behind()

    def write(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids.astype(self.dtype, copy=False))
        self._append(ids.size, lambda fd, i, n: write_all(fd, ids[i:i + n]))

    def write_from(self, path: str | Path, offset: int, count: int) -> None:
        """Append ``count`` ids of this writer's dtype stored at byte ``offset`` of
        ``path`` (a worker's part file), copied by the kernel where it can."""
        size = self.dtype.itemsize
        src = os.open(path, os.O_RDONLY)
        try:
            self._append(count, lambda fd, i, n: copy_range(src, fd, offset + i * size,
                                                            n * size))
        finally:
            os.close(src)

    def close(self) -> list[dict[str, Any]]:
        """The index entries ``[{"file": name, "tokens": n}, ...]`` of the shards written."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._sync.wait()
        return [{"file": shard_name(self.split, i), "tokens": n}
                for i, n in enumerate(self.counts)]


def move_tail(folder: Path, entries: list[dict[str, Any]], keep: int, dtype: np.dtype,
              dest: ShardWriter) -> list[dict[str, Any]]:
    """Move the ids after the first ``keep`` of a written split into ``dest``; returns
    the split's shortened index (shards past the cut are deleted, the cut one truncated)."""
    itemsize = np.dtype(dtype).itemsize
    kept: list[dict[str, Any]] = []
    seen = 0
    for entry in entries:
        path, n = folder / entry["file"], entry["tokens"]
        cut = max(0, min(n, keep - seen))
        if cut < n:
            tail = np.fromfile(path, dtype=dtype, offset=cut * itemsize)
            dest.write(tail)
            del tail
        if cut == n:
            kept.append(entry)
        elif cut > 0:
            with open(path, "r+b") as f:
                f.truncate(cut * itemsize)
            kept.append({"file": entry["file"], "tokens": cut})
        else:
            path.unlink()
        seen += n
    return kept


class TokenShards:
    """Memory-mapped shards read as one 1-D array of token ids (read-only)."""

    ndim = 1

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = [a for a in arrays if len(a)]
        self.dtype = np.dtype(arrays[0].dtype) if arrays else np.dtype(np.uint16)
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"TokenShards({len(self.arrays)} shards, {len(self):,} {self.dtype.name} tokens)"

    def _range(self, start: int, stop: int) -> np.ndarray:
        parts = []
        for k, a in enumerate(self.arrays):
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            if hi > start and lo < stop:
                parts.append(np.asarray(a[max(start, lo) - lo:min(stop, hi) - lo]))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def __getitem__(self, key: Any) -> Any:
        n = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} is out of bounds for {n} tokens")
            k = int(np.searchsorted(self.offsets, i, side="right")) - 1
            return self.arrays[k][i - self.offsets[k]]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._range(start, max(start, stop))
            return self[np.arange(start, stop, step)]
        idx = np.asarray(key)
        if idx.dtype == bool or not np.issubdtype(idx.dtype, np.integer):
            raise IndexError("TokenShards takes integer, slice or integer-array indices")
        flat = idx.astype(np.int64).ravel()
        flat = np.where(flat < 0, flat + n, flat)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of bounds for {n} tokens")
        which = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.arrays[k][flat[sel] - self.offsets[k]]
        return out.reshape(idx.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._range(0, len(self))
        return out if dtype is None else out.astype(dtype)

    def max(self) -> int:
        return max(int(a.max()) for a in self.arrays) if self.arrays else 0


def open_split(folder: Path, entries: Sequence[dict[str, Any]], dtype: np.dtype
               ) -> np.ndarray | TokenShards:
    """The split as one array: the memmap itself for one shard, else :class:`TokenShards`."""
    arrays = [np.memmap(folder / e["file"], dtype=dtype, mode="r", shape=(e["tokens"],))
              if e["tokens"] else np.zeros(0, dtype=dtype) for e in entries]
    if len(arrays) == 1:
        return arrays[0]
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return TokenShards(arrays)


__all__ = ["DTYPES", "SHARD_RE", "ShardWriter", "TokenShards", "move_tail", "open_split",
           "shard_name"]
