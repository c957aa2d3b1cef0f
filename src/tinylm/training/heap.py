"""The C heap of a CPU training process: freed memory kept for the next step.

A training step allocates its activations in the forward and frees them at the end of
the backward; the next step allocates the same sizes again. glibc's malloc hands memory
freed at the top of its heap back to the kernel once more than ``M_TRIM_THRESHOLD``
bytes are free there (a threshold it adapts: twice the largest mapped block it has
freed), so the heap shrinks at the end of every step and grows again in the next, on
fresh pages: each faults on first touch and is zeroed by the kernel. That was 500–1,000
faults per 4×128 B=12 step of tinylm, 6–7 % of the step on the 2-core VM of
BENCHMARKS.md (``python benchmarks/train.py --heap 4x128:12``).

:func:`keep_freed_memory` sets the trim threshold to 2 GiB (the most ``mallopt`` takes),
so the heap keeps what the steps free and the next step reuses the same pages. Setting
it stops glibc adapting its thresholds, so the ``mmap`` threshold (blocks above it are
mapped on their own and unmapped on free, as glibc does by default) is set too, to the
largest glibc adapts it to (32 MiB). The process's peak memory is what it was; its
memory no longer drops between steps (nor after the run, until the process exits).
(Taking every block from the heap instead, ``M_MMAP_MAX`` 0, made the heap grow without
bound under repeated 100 MB tensors: not done.)

``tinylm.training`` applies it to CPU runs; ``TINYLM_HEAP=default`` leaves glibc's
behaviour as it is, and so does any ``MALLOC_*_`` / ``GLIBC_TUNABLES`` malloc setting
the user made. Only glibc is touched (through the process's own ``mallopt``: no library
is loaded); other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from tinylm.core.errors import ConfigError

log = logging.getLogger(__name__)

CHOICES = ("keep", "default")
# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEPT_TRIM = 2**31 - 1  # bytes free at the heap's top before glibc trims it (a C int)
MMAP_FROM = 32 << 20  # blocks from this size up: mmap (DEFAULT_MMAP_THRESHOLD_MAX)
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                  "MALLOC_TOP_PAD_")
_applied: list[bool] = []


def choice() -> str:
    """``TINYLM_HEAP``: "keep" (the default) or "default" (glibc's own behaviour)."""
    asked = os.environ.get("TINYLM_HEAP", "").strip().lower() or "keep"
    if asked not in CHOICES:
        raise ConfigError(f"TINYLM_HEAP={asked!r} is not a heap setting: set it to one of "
                          f"{', '.join(CHOICES)}, or unset it")
    return asked


def _user_set_malloc() -> bool:
    """Whether the user tuned glibc's malloc through its environment variables."""
    return any(name in os.environ for name in _USER_SETTINGS) or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)`` (the process's own: no library is loaded); True
    where glibc took the setting. Only for glibc processes."""
    call = ctypes.CDLL(None).mallopt
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(call(param, value))


def keep_freed_memory() -> bool:
    """Keep freed heap memory in this process from now on (see the module docstring);
    True where the setting is in effect (applied now or earlier), False where it was
    left alone: not glibc, ``TINYLM_HEAP=default``, or the user's own malloc settings."""
    wanted = choice() == "keep" and not _user_set_malloc()  # a bad TINYLM_HEAP: refused
    if _applied:
        return _applied[0]
    done = wanted and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    if done:
        done = mallopt(M_MMAP_THRESHOLD, MMAP_FROM) and mallopt(M_TRIM_THRESHOLD, KEPT_TRIM)
    log.debug("heap: freed memory %s", "kept in the process" if done else
              "returned as glibc decides")
    _applied.append(done)
    return done
