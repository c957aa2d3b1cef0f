"""Build, cache and load the native library, trusting nothing it did not build itself.

The C sources in ``csrc/`` are compiled with the system C compiler (``cc -O3
-march=native -fopenmp``) into one shared library in a private per-user cache folder
(``$XDG_CACHE_HOME/tinylm/kernels`` or ``~/.cache/tinylm/kernels``):

- the folders tinylm creates are made with mode 0700 and, found existing, must be
  owned by the current user, not symlinks, and not writable by group or others;
  otherwise nothing is loaded from there (no shared fallback folder) and torch's
  kernels are used, said once in a warning;
- the library's name is keyed by the sources, the compiler's path and ``--version``
  output, the flags and the CPU; its sha256 is written beside it when it is built and
  checked before every ``dlopen``; a mismatch (a truncated or altered file) or a failed
  self-check rebuilds it once, then gives up with a one-line warning;
- a compile goes to a temporary file renamed into place; temporaries left by killed
  compiles (their process gone) are removed.

:func:`load_library` is the mechanism (tests call it on small sources);
:mod:`tinylm.native.ops` calls it once for the real kernels.
"""

from __future__ import annotations

import _ctypes  # CPython's dlopen handle helpers (dlclose)
import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_TEMP_PREFIX = ".tmp-"
_LEGACY_TEMP = re.compile(r"^tmp\w+\.so$")  # mkstemp names of earlier tinylm versions
_LEGACY_AGE_S = 600


class NativeUnavailable(OSError):
    """The native library cannot be used here; the message says why (one line)."""


class UnsafeCache(NativeUnavailable):
    """The cache folder is not private to this user."""


def cache_root() -> Path:
    """The per-user cache folder of the library: ``$XDG_CACHE_HOME/tinylm/kernels``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tinylm" / "kernels"


def compile_cache_root() -> Path:
    """The per-user folder of torch.compile's artefacts (inductor's FX graph cache and
    generated code) in tinylm runs: ``$XDG_CACHE_HOME/tinylm/inductor``."""
    return cache_root().parent / "inductor"


def _check_private(path: Path) -> None:
    """Raise UnsafeCache unless ``path`` is a real folder of this user, 0700-like."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"{path} is not a plain folder")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"{path} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{path} is writable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o})")


def private_folder(folder: Path) -> Path:
    """``folder`` (…/tinylm/kernels), its missing parts created 0700, and the two parts
    tinylm owns (``tinylm`` and ``kernels``) checked private to this user."""
    ours = [folder.parent, folder]
    missing = []
    for part in (folder, *folder.parents):
        if os.path.lexists(part):
            break
        missing.append(part)
    try:
        for part in reversed(missing):
            os.mkdir(part, 0o700)
            os.chmod(part, 0o700)  # whatever the umask
        for part in ours:
            _check_private(part)
    except UnsafeCache:
        raise
    except OSError as e:
        raise NativeUnavailable(f"no private writable cache folder ({e})") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise NativeUnavailable(f"the cache folder {folder} is not writable")
    return folder


def find_compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if compiler is None:
        raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return compiler


def compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {compiler} does not run ({e})") from e
    if out.returncode != 0:
        raise NativeUnavailable(f"`{compiler} --version` failed")
    return out.stdout.decode(errors="replace")


def cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU feature flags."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
                    if line.startswith("flags"):
                        break
    except OSError:
        sig += platform.processor()
    return sig


def library_key(sources: Path, compiler: str, version: str) -> str:
    h = hashlib.sha256()
    for src in sorted(sources.iterdir()):
        if src.suffix in (".c", ".h"):
            h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    for part in (compiler, version, cpu_signature(), " ".join(FLAGS)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    # tinylm.io.files.sha256_file's twin: this module imports the standard library only, so
    # a test (and a build in a bare interpreter) can load it on its own.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pid_alive(pid: int) -> bool:
    # Its own copy of tinylm.io.files.pid_alive on purpose: this file imports only the
    # standard library (tests load it alone, and a build must not need torch or io/).
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_temporaries(folder: Path) -> list[str]:
    """Delete compile temporaries whose process is gone (and old-style ``tmp*.so``
    older than ten minutes); returns their names."""
    removed = []
    now = time.time()
    for entry in os.scandir(folder):
        name = entry.name
        stale = False
        if name.startswith(_TEMP_PREFIX):
            pid = name[len(_TEMP_PREFIX):].split("-", 1)[0]
            stale = not pid.isdigit() or not _pid_alive(int(pid))
        elif _LEGACY_TEMP.match(name):
            stale = now - entry.stat(follow_symlinks=False).st_mtime > _LEGACY_AGE_S
        if stale:
            try:
                os.unlink(entry.path)
                removed.append(name)
            except OSError:
                pass
    return removed


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile_library(sources: Path, compiler: str, out: Path) -> None:
    """Compile every ``.c`` of ``sources`` into ``out``, and record its sha256 in
    ``out.sha256`` (the library goes to a temporary file, then renamed into place)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-", suffix=".so",
                               dir=out.parent)
    os.close(fd)
    try:
        files = [str(p) for p in sorted(sources.glob("*.c"))]
        done = subprocess.run([compiler, *FLAGS, *files, "-o", tmp, "-lm"],
                              capture_output=True, timeout=300)
        if done.returncode != 0:
            raise NativeUnavailable("the native kernels did not compile: "
                                    + done.stderr.decode(errors="replace")[:200].strip())
        os.chmod(tmp, 0o700)
        _write_atomic(out.with_name(out.name + ".sha256"), sha256_file(Path(tmp)).encode())
        os.replace(tmp, out)
    except subprocess.SubprocessError as e:
        raise NativeUnavailable(f"the native kernels did not compile ({e})") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def verify(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded, or None when it may: a regular file
    of this user, not writable by others, whose sha256 is the one recorded at build."""
    try:
        st = os.lstat(path)
        record = path.with_name(path.name + ".sha256")
        rst = os.lstat(record)
        if not (stat.S_ISREG(st.st_mode) and stat.S_ISREG(rst.st_mode)):
            return "not a regular file"
        if st.st_uid != os.getuid() or rst.st_uid != os.getuid():
            return "owned by another user"
        if (st.st_mode | rst.st_mode) & 0o022:
            return "writable by group or others"
        if sha256_file(path) != record.read_text(encoding="ascii").strip():
            return "its sha256 differs from the one recorded when it was built"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable ({e.__class__.__name__})"
    return None


def _close(lib: ctypes.CDLL) -> None:
    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        close(lib._handle)


def _discard(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".sha256")):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def load_library(sources: Path, folder: Path, self_check: Callable[[ctypes.CDLL], None],
                 name: str = "tinylm_kernels") -> ctypes.CDLL:
    """Build (or reuse) the library of ``sources`` in the private ``folder``, verify it,
    load it and run ``self_check`` on it (which raises on a wrong result). A library
    that fails verification or the self-check is rebuilt once. Raises NativeUnavailable
    with a one-line reason when no verified, self-checked library can be had."""
    folder = private_folder(folder)
    remove_temporaries(folder)
    compiler = find_compiler()
    path = folder / f"{name}_{library_key(sources, compiler, compiler_version(compiler))}.so"
    problem = None
    for attempt in range(2):
        reason = verify(path) if os.path.lexists(path) else "not built"
        if reason is not None:
            if attempt == 1 or reason != "not built":
                problem = problem or f"the cached library {reason}"
            _discard(path)
            compile_library(sources, compiler, path)
            reason = verify(path)
            if reason is not None:
                raise NativeUnavailable(f"the library just built {reason}")
        lib = ctypes.CDLL(str(path))
        try:
            self_check(lib)
            return lib
        except Exception as e:  # noqa: BLE001 - any failure of the check means: do not use
            _close(lib)
            _discard(path)
            problem = f"the self-check failed ({e})"
    raise NativeUnavailable(f"{problem}, also after a rebuild")
