"""The checkpoint folder itself: its file names, the save protocol and recovery.

A checkpoint is written to a temporary sibling folder, config.json last, and renamed into
place; a kill at any point leaves a complete checkpoint that the next load recovers
(:func:`recover_checkpoint`; docs/train.md, "The save protocol"). Reading a checkpoint is
:mod:`tinylm.io.checkpoint`'s (which imports this module, and so does the GGUF cache in
:mod:`tinylm.io.gguf_checkpoint`, which writes its conversions with the same protocol).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError
from tinylm.io.files import fsync_dir, pid_alive, umask_mode, write_error
from tinylm.layers import registry
from tinylm.layers.lora import is_adapter_key

log = logging.getLogger(__name__)

FORMAT = "tinylm"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # = tinylm.data.templates'
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
SHARDS_DIR = "shards"  # a sharded checkpoint's weights and optimizer state

# Prefixes that wrappers add to parameter names: torch.compile and DDP/FSDP.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile / DDP / FSDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def strip_wrapper_prefixes(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Remove torch.compile / DDP prefixes from state-dict keys (the one place that does)."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """Contiguous CPU copies of the weights, without the tied LM head duplicate."""
    model = unwrap_model(model)
    state = strip_wrapper_prefixes(model.state_dict())
    if getattr(model.config, "tie_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


# --- writing: the save protocol -----------------------------------------------------------
#
# save_checkpoint(DEST) performs, in this order (each step is a point where a kill may land):
#
#   1. mkdir  PARENT/.DEST.tmp-PID-XXXX                     (a private temporary folder)
#   2. write  model.safetensors, tokenizer.json, train_state.safetensors,
#             train_state.json, each fsynced, then config.json LAST (fsynced)
#   3. fsync the temporary folder
#   4. rename DEST -> PARENT/.DEST.old-PID                  (only when DEST exists)
#   5. rename .DEST.tmp-PID-XXXX -> DEST, fsync PARENT
#   6. remove .DEST.old-PID
#
# A folder whose config.json parses is complete (config.json is written last), so at every
# instant at least one complete checkpoint exists: DEST, or .DEST.old-PID and/or a complete
# .DEST.tmp-*. :func:`recover_checkpoint` (run on every load and on --resume) puts the
# newest complete one back at DEST and removes the leftovers of dead writers.

#: Called with a label before each file operation of a save (tests inject kills here).
_before_file_op: Callable[[str], None] | None = None


def _op(label: str) -> None:
    if _before_file_op is not None:
        _before_file_op(label)


def _write_json(path: Path, data: Any) -> None:
    _op(f"write {path.name}")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    _op(f"write {path.name}")
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(path))
    except Exception as exc:  # safetensors raises its own error type for I/O failures
        if isinstance(exc, OSError):
            raise
        text = str(exc)
        code = errno.ENOSPC if "os error 28" in text or "No space" in text else errno.EIO
        raise OSError(code, text) from exc
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _match_umask(folder: Path) -> None:
    """Files 0666 and the folder 0777 minus the user's umask, like any file they create
    (mkdtemp makes 0700 folders; the weights would otherwise differ from the JSON)."""
    for child in folder.iterdir():
        if child.is_dir():
            _match_umask(child)
        else:
            os.chmod(child, umask_mode(0o666))
    os.chmod(folder, umask_mode(0o777))


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    tokenizer: Any | None = None,
    *,
    extra_config: dict[str, Any] | None = None,
    train_tensors: dict[str, Tensor] | None = None,
    train_meta: dict[str, Any] | None = None,
    state: dict[str, Tensor] | None = None,
    tmp: Path | None = None,
) -> Path:
    """Write ``model`` (and optionally its tokenizer and training state) to ``path``.

    ``extra_config`` entries are merged into config.json (e.g. "train" or "lowrank");
    ``train_tensors``/``train_meta`` become train_state.safetensors/.json. Follows the
    save protocol above: a complete checkpoint is reachable at every instant, and a
    previous checkpoint at ``path`` is replaced only once the new one is on disk. A full
    disk is a :class:`~tinylm.io.files.DiskFullError` naming the file. ``state``: the
    weights to write instead of ``model``'s own (e.g. gathered from FSDP shards).
    ``tmp``: a temporary folder from :func:`new_temporary` that already holds SHARDS_DIR
    (a sharded save: no model.safetensors; ``extra_config`` carries "sharded").
    """
    dest = Path(path)
    base = unwrap_model(model)
    config = {"format": FORMAT, "version": VERSION, "model": base.config.to_dict()}
    config.update(extra_config or {})
    config.update(registry.structure_of(base))  # "lowrank", "quantize", "lora" when present
    if tmp is None:
        state = model_state(base) if state is None else _without_tied_head(base, state)
        if config.get("lora_base"):  # a LoRA run: the adapters (and grown embeddings) only
            state = _lora_own_tensors(state, config["lora_base"])
        tmp = new_temporary(dest)
    current = tmp
    try:
        for name, write in _file_writes(config, state, tokenizer, train_tensors, train_meta):
            current = tmp / name
            write(current)
        _match_umask(tmp)
        _op("fsync tmp")
        fsync_dir(tmp)
        current = dest
        _swap_in(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        shown = dest / current.name if current.parent == tmp else current
        raise write_error(shown, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _save_tokenizer(tokenizer: Any, path: Path) -> None:
    _op(f"write {TOKENIZER_FILE}")
    tokenizer.save(path)


def _file_writes(config: dict[str, Any], state: dict[str, Tensor] | None, tokenizer: Any,
                 train_tensors: dict[str, Tensor] | None, train_meta: dict[str, Any] | None
                 ) -> list[tuple[str, Callable[[Path], None]]]:
    """(file name, how to write it) for each file of a save, in order; config.json last,
    since its presence marks the folder complete."""
    writes: list[tuple[str, Callable[[Path], None]]] = []
    if not config.get("sharded"):
        writes.append((WEIGHTS_FILE, lambda p: _write_tensors(p, state)))
    if tokenizer is not None:
        writes.append((TOKENIZER_FILE, lambda p: _save_tokenizer(tokenizer, p)))
        settings = getattr(tokenizer, "settings", None)
        if settings is not None and not settings.empty:
            writes.append((TOKENIZER_CONFIG_FILE, lambda p: _write_json(p, settings.to_hf())))
    if train_tensors is not None:
        writes.append((STATE_TENSORS_FILE, lambda p: _write_tensors(p, train_tensors)))
    if train_meta is not None:
        writes.append((STATE_JSON_FILE, lambda p: _write_json(p, train_meta)))
    writes.append((CONFIG_FILE, lambda p: _write_json(p, config)))
    return writes


def _without_tied_head(base: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    state = strip_wrapper_prefixes(dict(state))
    if getattr(base.config, "tie_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


_EMBEDDINGS = ("tok_emb.weight", "lm_head.weight")


def _lora_own_tensors(state: dict[str, Tensor], base: Any) -> dict[str, Tensor]:
    """What a LoRA checkpoint stores itself: the adapters, plus the embedding rows when
    fine-tuning grew the vocabulary (new chat tokens); the rest is the base's."""
    grown = isinstance(base, dict) and base.get("grown", False)
    return {k: v for k, v in state.items() if is_adapter_key(k) or (grown and k in _EMBEDDINGS)}


def new_temporary(dest: Path) -> Path:
    """Step 1 of the save protocol: the private temporary folder beside ``dest``."""
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _op(f"mkdir tmp for {dest.name}")
        return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise write_error(parent, exc) from exc


def _swap_in(tmp: Path, dest: Path) -> None:
    """Steps 4-6 of the protocol: dest -> .old, tmp -> dest, drop .old."""
    parent = dest.parent
    old = None
    if dest.exists():
        old = parent / f".{dest.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        _op("rename dest to old")
        os.replace(dest, old)
    try:
        _op("rename tmp to dest")
        os.replace(tmp, dest)
    except BaseException:
        if old is not None and not dest.exists():  # put the previous checkpoint back
            os.replace(old, dest)
        raise
    _op("fsync parent")
    fsync_dir(parent)
    if old is not None:
        _op("remove old")
        shutil.rmtree(old, ignore_errors=True)


#: The files a checkpoint folder may hold (what save_checkpoint writes).
CHECKPOINT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE,
                              STATE_TENSORS_FILE, STATE_JSON_FILE, SHARDS_DIR})


def check_target(path: str | os.PathLike, *, force: bool = False, flag: str = "--out") -> Path:
    """Refuse to write a checkpoint where it would lose a user's files.

    Allowed: a new path, an empty folder, or (with ``force``) an existing checkpoint
    folder holding nothing but checkpoint files — the only files a replacement deletes
    are ones tinylm wrote. A regular file, a training run folder, or a folder with any
    other file is refused, even with ``force``. Nothing is written here.
    """
    dest = Path(path)
    if not dest.exists():
        return dest
    if not dest.is_dir():
        raise CheckpointError(f"{flag} {dest} is a file; choose a new folder name (nothing "
                              f"was written)")
    names = sorted(p.name for p in dest.iterdir())
    if not names:
        return dest
    if RUN_LATEST in names or ".lock" in names or "metrics.jsonl" in names:
        raise CheckpointError(f"{flag} {dest} is a training run folder; write the checkpoint "
                              f"to a new folder (nothing was written)")
    others = [n for n in names if n not in CHECKPOINT_FILES]
    if others or not is_complete(dest):
        shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "") if others \
            else ", ".join(names[:3])
        raise CheckpointError(f"{flag} {dest} is not empty and not a tinylm checkpoint (it "
                              f"holds {shown}); choose a new or empty folder (nothing was "
                              f"written)")
    if not force:
        raise CheckpointError(f"{flag} {dest} already holds a checkpoint; pass --force to "
                              f"replace it, or choose a new folder")
    return dest


# --- recovery ------------------------------------------------------------------------------


RUN_LATEST = "latest"  # a training run folder's newest checkpoint (tinylm train --out)
RUN_BEST = "best"  # the run's checkpoint with the lowest periodic validation estimate


def _writer_pid(name: str) -> int | None:
    """The pid in ``.D.tmp-PID-XXXX`` / ``.D.old-PID`` (None when it has none)."""
    tail = name.rsplit(".tmp-", 1)[-1] if ".tmp-" in name else name.rsplit(".old-", 1)[-1]
    try:
        return int(tail.split("-")[0])
    except ValueError:
        return None


def _writer_alive(name: str) -> bool:
    pid = _writer_pid(name)
    return pid is not None and pid_alive(pid)


def _saved_step(folder: Path) -> tuple[int, int]:
    """(training step, config.json mtime) of a complete checkpoint folder: its age."""
    step = -1
    try:
        step = int(json.loads((folder / STATE_JSON_FILE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            cfg = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
            step = int(cfg["best"]["step"])
    try:
        mtime = (folder / CONFIG_FILE).stat().st_mtime_ns
    except OSError:
        mtime = 0
    return step, mtime


def is_complete(folder: Path) -> bool:
    """Whether a checkpoint folder was fully written (its config.json, written last,
    parses as a tinylm config and the weights are there)."""
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not (isinstance(cfg, dict) and cfg.get("format") == FORMAT):
        return False
    if cfg.get("sharded"):
        return (folder / SHARDS_DIR).is_dir()
    return (folder / WEIGHTS_FILE).is_file()


def leftovers(dest: Path) -> list[Path]:
    """Temporary and previous copies of ``dest`` left beside it by saves (any writer)."""
    parent = dest.parent
    if not parent.is_dir():
        return []
    prefixes = (f".{dest.name}.tmp-", f".{dest.name}.old-")
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes) and p.is_dir())


def recover_checkpoint(dest: str | os.PathLike) -> Path | None:
    """Make ``dest`` the newest complete checkpoint among it and its leftovers.

    Leftovers of live writers (their pid runs) are never touched. When a complete
    leftover is newer than ``dest`` (or ``dest`` is gone), it is renamed into place and
    one line says so; the other leftovers of dead writers are removed. Returns ``dest``
    when it now holds a complete checkpoint, else None.
    """
    dest = Path(dest)
    dead = [p for p in leftovers(dest) if not _writer_alive(p.name)]
    complete = [p for p in dead if is_complete(p)]
    current = _saved_step(dest) if is_complete(dest) else None
    newest = max(complete, key=_saved_step, default=None)
    try:
        if newest is not None and (current is None or _saved_step(newest) > current):
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(newest, dest)
            fsync_dir(dest.parent)
            step = _saved_step(dest)[0]
            log.warning("recovered %s from %s%s, left by an interrupted save", dest,
                        newest.name, f" (step {step})" if step >= 0 else "")
        for p in dead:
            if p.exists():
                shutil.rmtree(p, ignore_errors=True)
    except OSError as exc:
        log.warning("could not tidy the leftovers of an interrupted save beside %s (%s)",
                    dest, exc.strerror or exc)
        return dest if is_complete(dest) else newest
    return dest if is_complete(dest) else None
