"""Building, caching and loading the native library: nothing is loaded that tinylm did not
build, in a folder private to the user, with the sha256 recorded at build time.

Most tests run :func:`tinylm.native.build.load_library` on a one-function C source (fast
to compile) in subprocesses, so a library replaced on disk is never one this process has
mapped."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm.native import build  # noqa: E402

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on this machine")
SRC_DIR = str(Path(build.__file__).resolve().parents[2])

BUILD_PY = str(Path(build.__file__).resolve())
LOADER = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("build", BUILD_PY)
    build = importlib.util.module_from_spec(spec)  # the build module alone: no torch
    spec.loader.exec_module(build)
    sources, folder, fail = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
    def check(lib):
        if fail or lib.tl_answer() != 42:
            raise RuntimeError("wrong answer")
    try:
        build.load_library(sources, folder, check, name="tiny")
        print(json.dumps({"ok": True}))
    except build.NativeUnavailable as e:
        print(json.dumps({"ok": False, "why": str(e), "type": type(e).__name__}))
""").replace("BUILD_PY", repr(BUILD_PY))


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.h").write_text("int tl_answer(void);\n")
    (src / "tiny.c").write_text('#include "tiny.h"\nint tl_answer(void) { return 42; }\n')
    return src


def counting_compiler(tmp_path: Path, version: str = "1") -> Path:
    """A cc wrapper that logs every compile and prints a chosen --version."""
    log = tmp_path / "cc.log"
    script = tmp_path / f"cc-{version}"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo fakecc {version}; "
                      f"exit 0; fi\necho compile >> {log}\nexec {CC} \"$@\"\n")
    script.chmod(0o755)
    return script


def load(sources: Path, folder: Path, cc: Path | None = None, fail: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC_DIR)
    if cc is not None:
        env["CC"] = str(cc)
    out = subprocess.run([sys.executable, "-c", LOADER, str(sources), str(folder),
                          "1" if fail else "0"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def library(folder: Path) -> Path:
    (so,) = folder.glob("tiny_*.so")
    return so


def compiles(tmp_path: Path) -> int:
    log = tmp_path / "cc.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_builds_into_private_folders_and_records_the_sha256(tmp_path, tiny) -> None:
    folder = tmp_path / "cache" / "tinylm" / "kernels"
    assert load(tiny, folder) == {"ok": True}
    for part in (folder, folder.parent, folder.parent.parent):
        assert stat.S_IMODE(os.stat(part).st_mode) == 0o700, part  # created 0700
    so = library(folder)
    assert (so.parent / (so.name + ".sha256")).read_text() == build.sha256_file(so)
    assert not os.stat(so).st_mode & 0o022


@pytest.mark.parametrize("damage", ["truncate", "zero", "drop-record"])
def test_a_damaged_library_is_rebuilt_once(tmp_path, tiny, damage: str) -> None:
    folder = tmp_path / "tinylm" / "kernels"
    cc = counting_compiler(tmp_path)
    assert load(tiny, folder, cc)["ok"] and compiles(tmp_path) == 1
    assert load(tiny, folder, cc)["ok"] and compiles(tmp_path) == 1  # reused, verified
    so = library(folder)
    data = so.read_bytes()
    if damage == "truncate":
        so.write_bytes(data[:len(data) // 3])
    elif damage == "zero":
        so.write_bytes(data[:1000] + bytes(2000) + data[3000:])
    else:
        (so.parent / (so.name + ".sha256")).unlink()
    assert load(tiny, folder, cc)["ok"]
    assert compiles(tmp_path) == 2
    assert library(folder).read_bytes() == data or build.verify(library(folder)) is None


def test_failed_self_check_rebuilds_once_then_gives_up(tmp_path, tiny) -> None:
    folder = tmp_path / "tinylm" / "kernels"
    cc = counting_compiler(tmp_path)
    got = load(tiny, folder, cc, fail=True)
    assert not got["ok"] and "self-check failed" in got["why"] and "after a rebuild" in got["why"]
    assert "\n" not in got["why"]
    assert compiles(tmp_path) == 2
    assert not list(folder.glob("tiny_*.so"))  # the failing library is not left to load


def test_the_key_covers_the_compiler_version(tmp_path, tiny) -> None:
    folder = tmp_path / "tinylm" / "kernels"
    assert load(tiny, folder, counting_compiler(tmp_path, "1"))["ok"]
    assert load(tiny, folder, counting_compiler(tmp_path, "2"))["ok"]
    assert len(list(folder.glob("tiny_*.so"))) == 2
    assert build.library_key(tiny, "cc", "gcc 12") != build.library_key(tiny, "cc", "gcc 13")


def test_leftover_temporaries_are_removed(tmp_path, tiny) -> None:
    folder = build.private_folder(tmp_path / "tinylm" / "kernels")
    dead = folder / ".tmp-999999999-abc.so"  # no such process
    legacy = folder / "tmpk3j2.so"  # an old-style temporary from a killed compile
    mine = folder / f".tmp-{os.getpid()}-live.so"  # a compile still running
    for p in (dead, legacy, mine):
        p.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(legacy, (old, old))
    assert load(tiny, folder)["ok"]
    assert not dead.exists() and not legacy.exists() and mine.exists()


def test_a_group_writable_or_symlinked_folder_is_refused(tmp_path, tiny) -> None:
    folder = build.private_folder(tmp_path / "a" / "tinylm" / "kernels")
    folder.chmod(0o770)
    got = load(tiny, folder)
    assert not got["ok"] and got["type"] == "UnsafeCache" and "group or others" in got["why"]
    real = build.private_folder(tmp_path / "b" / "tinylm" / "kernels")
    link = tmp_path / "c" / "tinylm"
    link.parent.mkdir()
    link.symlink_to(real.parent)
    got = load(tiny, link / "kernels")
    assert not got["ok"] and got["type"] == "UnsafeCache"


def test_no_shared_fallback_without_a_private_cache(tmp_path) -> None:
    # XDG_CACHE_HOME is a file: no cache folder can exist. The kernels must stay off
    # (one warning), not move to a shared temporary folder.
    (tmp_path / "file").write_text("")
    code = ("import logging, torch\nlogging.basicConfig(level=logging.WARNING)\n"
            "from tinylm.native import ops\nprint(ops.load() is None)\n")
    env = dict(os.environ, PYTHONPATH=SRC_DIR, XDG_CACHE_HOME=str(tmp_path / "file"),
               TMPDIR=str(tmp_path), TINYLM_NATIVE="1")  # also under TINYLM_NATIVE=0 make test
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    warnings = [line for line in out.stderr.splitlines() if "native kernels" in line]
    assert len(warnings) == 1 and "private writable cache" in warnings[0], out.stderr
    assert not (tmp_path / "tinylm-kernels").exists()


def plant_as_another_user(evil: Path, target: Path) -> None:
    """In a forked child running as uid 12345: copy ``evil`` to ``target`` (creating its
    folders) with a matching .sha256 record, as an attacker sharing the machine would."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgid(12345)
            os.setuid(12345)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = evil.read_bytes()
            target.write_bytes(data)
            os.chmod(target, 0o755)
            target.with_name(target.name + ".sha256").write_text(
                hashlib.sha256(data).hexdigest())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "planting as uid 12345 failed"


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="planting as a second user needs root to switch to uid 12345")
def test_a_library_planted_by_another_user_never_runs(tmp_path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="tinylm-shared-", dir="/tmp"))
    try:
        shared.chmod(0o1777)  # a world-writable sticky folder, like /tmp itself
        marker = shared / "pwned"
        evil_c = tmp_path / "evil.c"
        evil_c.write_text('#include <stdio.h>\n__attribute__((constructor)) static void '
                          f'run(void) {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
        evil = shared / "evil.so"
        subprocess.run([CC, "-shared", "-fPIC", str(evil_c), "-o", str(evil)], check=True)
        evil.chmod(0o755)
        compiler = build.find_compiler()
        key = build.library_key(build.SOURCES, compiler, build.compiler_version(compiler))
        name = f"tinylm_kernels_{key}.so"  # predictable from public inputs
        victim = ("import logging\nlogging.basicConfig(level=logging.WARNING)\n"
                  "from tinylm.native import ops\nprint(ops.load() is None)\n")
        for xdg, planted in [
            (shared / "xdg", shared / "xdg" / "tinylm" / "kernels" / name),  # another's cache
            (evil_c, shared / "tinylm-kernels" / name),  # no cache: the old shared fallback
        ]:
            plant_as_another_user(evil, planted)
            assert os.stat(planted).st_uid == 12345
            env = dict(os.environ, PYTHONPATH=SRC_DIR, XDG_CACHE_HOME=str(xdg),
                       TMPDIR=str(shared), CC=compiler, TINYLM_NATIVE="1")
            out = subprocess.run([sys.executable, "-c", victim], env=env, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "True", out.stderr
            assert not marker.exists(), f"the planted library ran ({planted})"
            assert "native kernels unavailable" in out.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_the_compiler_runs_at_accelerate_never_inside_forward(tmp_path) -> None:
    log = tmp_path / "cc.log"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nexit 1\n")  # logs, then fails
    cc.chmod(0o755)
    code = textwrap.dedent(f"""
        import os, torch
        from tinylm import GPT, ModelConfig, native
        m = GPT(ModelConfig(vocab_size=11, context_length=8, n_layer=1, n_head=1, n_embd=16))
        ids = torch.tensor([[1, 2, 3]])
        m.loss(ids, ids).backward()
        with torch.no_grad():
            m(ids)
        assert not os.path.exists({str(log)!r}), "the compiler ran inside forward"
        native.accelerate(m, "cpu")
        assert os.path.exists({str(log)!r}), "accelerate did not try to build"
    """)
    env = dict(os.environ, PYTHONPATH=SRC_DIR, CC=str(cc), XDG_CACHE_HOME=str(tmp_path))
    env.pop("TINYLM_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
