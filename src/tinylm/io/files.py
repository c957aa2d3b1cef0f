"""Writing files safely: atomic replacement, fsync, "disk full" errors, folder locks.

* :func:`atomic_write` is the one way tinylm replaces a small file (metrics, run.toml,
  plots): the bytes go to a hidden temporary sibling that is fsynced and renamed over
  the target, so a reader or a crash sees the old file or the new one, never half.
  :func:`atomic_write_with` does the same for a writer that wants a file name (a
  figure's ``savefig``, a page's ``write_text``).
* :func:`disk_errors` turns an ``OSError`` (ENOSPC, EDQUOT, EACCES, ...) raised while
  writing into a one-line :class:`~tinylm.core.errors.TinyLMError` naming the path.
* :class:`FolderLock` is an OS lock (``fcntl.flock``) on ``FOLDER/.lock`` held for the
  life of a run: a second writer is refused with the holder's pid; a lock left by a
  dead process is no lock at all (the OS drops it with the process).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tinylm.core.errors import ConfigError, TinyLMError

try:  # POSIX; elsewhere FolderLock falls back to an exclusive-create file + pid check
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class DiskFullError(TinyLMError):
    """A write failed because the disk (or the user's quota) is full."""


class FolderBusyError(TinyLMError):
    """Another live process holds the folder's lock."""


def write_error(path: str | os.PathLike, exc: OSError, what: str = "write") -> TinyLMError:
    """The one-line error for an OSError raised while writing ``path``."""
    if exc.errno in _FULL:
        return DiskFullError(f"disk full while writing {path}; free disk space (or choose "
                             f"another folder) and run again — what was saved before is kept")
    reason = exc.strerror or str(exc)
    return TinyLMError(f"cannot {what} {path} ({reason}); check the folder's permissions "
                       f"or choose another one")


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike, what: str = "write") -> Iterator[None]:
    """Re-raise an OSError inside the block as :func:`write_error` for ``path``."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc, what) from exc


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside ``path`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` as the user's umask would leave it for a newly created file."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _replace_with(path: Path, write: Callable[[str], object]) -> None:
    """``write(tmp)`` on a hidden temporary sibling of ``path``, fsync it, give it the
    user's umask (like ``open(path, "w")``, not mkstemp's private 0600) and rename it
    over ``path``. An OSError propagates; the temporary never stays behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace ``path`` by ``data`` atomically (temporary sibling, fsync, rename).

    The file gets the user's umask (like ``open(path, "w")``), and an OSError becomes a
    one-line error naming the path (:func:`write_error`); a failed write leaves the old
    file as it was and no temporary behind.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if path.is_dir():
        raise TinyLMError(f"{path} is a folder; pass a file name")
    with disk_errors(path):
        _replace_with(path, lambda tmp: Path(tmp).write_bytes(raw))
    return path


def atomic_write_with(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place
    (as :func:`atomic_write`; missing parent folders are made first): a failure leaves no
    half-written file and keeps what was there. An OSError becomes a one-line
    :class:`~tinylm.core.errors.ConfigError` naming the path."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _replace_with(out, write)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}; choose a writable path") from exc
    return out


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(folder: str | os.PathLike) -> int | None:
    """The pid recorded in ``folder/.lock`` (None when absent or unreadable)."""
    try:
        return int((Path(folder) / LOCK_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class FolderLock:
    """An exclusive lock on ``folder`` held until :meth:`release` (or process exit).

    ``acquire`` raises :class:`FolderBusyError` naming the holder's pid when another
    live process holds it. With ``fcntl`` the lock is the kernel's, so a SIGKILLed
    holder releases it automatically (its stale ``.lock`` file is simply reused).
    """

    def __init__(self, folder: str | os.PathLike, what: str = "run folder") -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        with disk_errors(self.path, "lock"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, umask_mode())
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                self._busy()
        else:  # pragma: no cover - Windows: trust a recorded pid only while it lives
            holder = read_holder(self.folder)
            if holder is not None and holder != os.getpid() and pid_alive(holder):
                os.close(fd)
                self._busy()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def _busy(self) -> None:
        holder = read_holder(self.folder)
        who = f"pid {holder}" if holder is not None else "another process"
        raise FolderBusyError(f"{self.what} {self.folder} is in use by {who} (a training "
                              f"writing to it); wait for it to end, or choose another --out")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_locked(folder: str | os.PathLike) -> bool:
    """Whether a live process other than this one holds ``folder``'s lock."""
    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return False
    if fcntl is None:  # pragma: no cover
        holder = read_holder(folder)
        return holder is not None and holder != os.getpid() and pid_alive(holder)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_holder(folder) != os.getpid()
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
