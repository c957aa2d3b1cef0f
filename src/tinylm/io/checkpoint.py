"""Checkpoints: a folder of safetensors + JSON, written atomically, never pickled.

Layout of a checkpoint folder::

    config.json              {"format": "tinylm", "version": 1, "model": ModelConfig, ...}
    model.safetensors        the weights (a tied LM head is stored once, as tok_emb)
    tokenizer.json           the tokenizer, when one is known
    tokenizer_config.json    its own chat template and special-token roles, when it has
                             them (Hugging Face's keys; a model trained here has none)
    train_state.safetensors  optional: optimizer moments, RNG states (tensors)
    train_state.json         optional: step, data position, best loss ... (JSON)

A *sharded* checkpoint (``tinylm train --strategy fsdp|zero1``) has no model.safetensors:
its weights and optimizer state are in ``shards/`` (one safetensors file per rank, written
by torch.distributed.checkpoint with each shard's offsets in the file's JSON header) and
config.json says ``"sharded": {...}``. ``tinylm export-checkpoint`` turns one into the
ordinary layout above.

Writes follow the save protocol below: a temporary sibling folder, config.json last,
renamed into place; a kill at any point leaves a complete checkpoint that the next load
recovers (docs/train.md, "The save protocol").
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

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tinylm.core.config import ModelConfig, check_model_fits
from tinylm.core.errors import CheckpointError, ConfigError, TinyLMError
from tinylm.core.model import GPT
from tinylm.io.files import fsync_dir, is_locked, pid_alive, sha256_file, umask_mode, write_error
from tinylm.io.jsonio import read_json
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


def is_sharded(folder: Path) -> bool:
    """Whether ``folder`` is a complete sharded checkpoint (``--strategy fsdp|zero1``)."""
    return is_complete(folder) and bool(read_config(folder).get("sharded"))


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


# --- reading ------------------------------------------------------------------------------


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names: itself, or ``path/latest`` for a run folder.

    ``tinylm train --out RUN`` writes RUN/latest and RUN/best; passing RUN wherever a
    checkpoint is expected means RUN/latest. This is the one place that decides it, and
    it first recovers a checkpoint whose save was interrupted (:func:`recover_checkpoint`).
    A ``.gguf`` file stands for its conversion, made once into a private cache
    (:func:`tinylm.io.gguf_checkpoint.cached_checkpoint`).
    """
    folder = Path(path)
    if folder.suffix.lower() == ".gguf" and not folder.is_dir():  # llama.cpp's format
        from tinylm.io.gguf_checkpoint import cached_checkpoint

        return cached_checkpoint(folder)
    if folder.is_file():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder; pass the folder "
                              f"that holds config.json (or a tinylm train --out folder, or a "
                              f".gguf file)")
    if (folder / CONFIG_FILE).is_file():
        return folder
    if folder.is_dir() and ((folder / RUN_LATEST).exists() or leftovers(folder / RUN_LATEST)):
        if is_locked(folder):  # a live training owns the folder: read, never tidy
            if is_complete(folder / RUN_LATEST):
                return folder / RUN_LATEST
            done = [p for p in leftovers(folder / RUN_LATEST) if is_complete(p)]
            if done:  # mid-swap: the previous checkpoint, read where it is
                return max(done, key=_saved_step)
        recover_checkpoint(folder / RUN_LATEST)
        if is_complete(folder / RUN_LATEST):
            return folder / RUN_LATEST
    elif not folder.exists() and leftovers(folder):
        recover_checkpoint(folder)
    if folder.is_dir() and not (folder / RUN_LATEST).exists() and is_complete(folder / RUN_BEST):
        raise CheckpointError(f"{folder} has no latest/ checkpoint, but best/ beside it is "
                              f"complete; pass {folder / RUN_BEST}")
    return folder


#: config.json sections that hold JSON objects when present (others are free-form).
_OBJECT_SECTIONS = ("train", "lowrank", "compress", "sharded")
#: The largest config.json read (tinylm's are a few kB; a lowrank map of a huge model
#: stays far below this).
CONFIG_MAX_BYTES = 16 * 1024 * 1024


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a checkpoint folder (or run folder), checked for format and version."""
    folder = resolve_checkpoint_dir(path)
    if not folder.is_dir():
        hint = " (it is a file; pass the folder that holds config.json)" if folder.exists() else ""
        raise CheckpointError(f"checkpoint folder {folder} does not exist{hint}; pass the --out "
                              f"folder of 'tinylm train' or 'tinylm convert'")
    cfg_path = folder / CONFIG_FILE
    try:
        data = read_json(cfg_path, error=CheckpointError, max_bytes=CONFIG_MAX_BYTES,
                         fix="the checkpoint is corrupt, restore it or retrain")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{cfg_path} is missing: {folder} is not a complete tinylm "
                              f"checkpoint") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
        raise CheckpointError(f"{cfg_path} is not a tinylm checkpoint config; for a Hugging "
                              f"Face folder use 'tinylm convert --from-hf'")
    version = data.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{cfg_path} has format version {version!r}, not a whole number "
                              f"such as {VERSION}; the checkpoint is corrupt, restore it or "
                              f"retrain")
    if version > VERSION:
        raise CheckpointError(f"{folder} was written by a newer tinylm (format version "
                              f"{version}); upgrade tinylm")
    for section in ("model", *_OBJECT_SECTIONS):
        if section in data and not isinstance(data[section], dict):
            raise CheckpointError(f"{cfg_path}: \"{section}\" must be a JSON object, got "
                                  f"{type(data[section]).__name__}; the checkpoint is corrupt, "
                                  f"restore it or retrain")
    return data


def read_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a safetensors file; a corrupt file becomes a CheckpointError."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p} is missing; the checkpoint is incomplete")
    try:
        try:
            str(p).encode("utf-8")
        except UnicodeEncodeError:  # safetensors takes UTF-8 paths only: read the bytes
            from safetensors.torch import load as load_bytes

            return load_bytes(p.read_bytes())
        return load_file(str(p))
    except Exception as exc:  # safetensors raises several types for corrupt headers/data
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{p} is corrupt or not a safetensors file ({reason}); restore "
                              f"it or retrain") from None


def build_model(config: dict[str, Any]) -> GPT:
    """An uninitialised-weights model with the structure described by config.json."""
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"config.json has an invalid model config: {exc}") from exc
    try:  # estimated before allocating: a hostile n_layer must not eat the machine
        check_model_fits(model_config, "cpu")
    except ConfigError as exc:
        raise CheckpointError(f"config.json describes a model too large to load: {exc}") \
            from None
    return registry.apply_structure(GPT(model_config), config)


_EMBEDDINGS = ("tok_emb.weight", "lm_head.weight")


def _lora_own_tensors(state: dict[str, Tensor], base: Any) -> dict[str, Tensor]:
    """What a LoRA checkpoint stores itself: the adapters, plus the embedding rows when
    fine-tuning grew the vocabulary (new chat tokens); the rest is the base's."""
    grown = isinstance(base, dict) and base.get("grown", False)
    return {k: v for k, v in state.items() if is_adapter_key(k) or (grown and k in _EMBEDDINGS)}


def _lora_base_state(base: Any, where: Path) -> dict[str, Tensor]:
    """The base checkpoint's weights that a LoRA checkpoint at ``where`` refers to."""
    if not isinstance(base, dict) or not isinstance(base.get("path"), str):
        raise CheckpointError(f"{where}/config.json's \"lora_base\" entry is malformed; the "
                              f"checkpoint is corrupt")
    folder = Path(base["path"])
    try:
        weights = resolve_checkpoint_dir(folder) / WEIGHTS_FILE
        digest = sha256_file(weights)
    except (OSError, TinyLMError) as exc:
        raise CheckpointError(f"{where} holds LoRA adapters for the base model {folder}, which "
                              f"cannot be read ({exc}); put the base back, or use a merged "
                              f"checkpoint (tinylm merge)") from None
    if base.get("sha256") not in (None, digest):
        raise CheckpointError(f"{where} holds LoRA adapters for the base model {folder}, whose "
                              f"weights have changed since; restore that base, or merge the "
                              f"adapters while it is intact (tinylm merge)")
    return read_tensors(weights)


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", *,
               allow_nonfinite: bool = False) -> GPT:
    """The model stored in a checkpoint folder, in eval mode, on ``device``.

    Weights stored in another float dtype (float16, bfloat16, float64) are cast to the
    model's with a note; integer or bool weights are refused, and so are NaN/infinite
    weights unless ``allow_nonfinite``.
    """
    path = resolve_checkpoint_dir(path)
    config = read_config(path)
    if config.get("sharded"):
        raise CheckpointError(f"{path} is a sharded checkpoint (tinylm train --strategy "
                              f"{config['sharded'].get('strategy', 'fsdp')}); consolidate it "
                              f"first: tinylm export-checkpoint {path} --out DIR")
    model = build_model(config)
    state = strip_wrapper_prefixes(read_tensors(path / WEIGHTS_FILE))
    if config.get("lora_base"):  # adapters only: the frozen weights come from the base
        own = state
        state = {k: v for k, v in strip_wrapper_prefixes(
            _lora_base_state(config["lora_base"], path)).items() if k not in own}
        state.update(own)
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model_state(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match config.json (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); the folder mixes files from different models"
        )
    own = model.state_dict()
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"{path}: weight {key} has shape {tuple(value.shape)} but config.json implies "
                f"{tuple(own[key].shape)}; the folder mixes files from different models"
            )
    state = _check_weights(path, state, own, allow_nonfinite)
    model.load_state_dict(state, strict=False)
    return model.to(device).eval()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_weights(path: Path, state: dict[str, Tensor], own: dict[str, Tensor],
                   allow_nonfinite: bool) -> dict[str, Tensor]:
    """``state`` cast to the model's dtypes; refuses non-float and (unless allowed)
    non-finite weights. One pass over the tensors."""
    cast: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    bad, first = 0, None
    out = {}
    for key, value in state.items():
        want = own[key].dtype
        if value.dtype != want:
            if not value.is_floating_point() or not want.is_floating_point:
                raise CheckpointError(
                    f"{path}: weight {key} is stored as {_dtype_name(value.dtype)} but the "
                    f"model's weights are {_dtype_name(want)}; the file was relabelled or "
                    f"damaged, restore it or retrain")
            cast.setdefault(key, (value.dtype, want))
            value = value.to(want)
        if not allow_nonfinite and value.is_floating_point():
            n = value.numel() - int(torch.isfinite(value).sum())
            if n and first is None:
                first = key
            bad += n
        out[key] = value
    if bad:
        raise CheckpointError(
            f"{path}: {bad:,} weights are NaN or infinite (the first in {first}); training "
            f"diverged or the file is damaged: use an earlier checkpoint (e.g. the run's "
            f"best/), or load them anyway with eval/sample --allow-nonfinite")
    if cast:
        kinds = sorted({_dtype_name(a) for a, _ in cast.values()})
        log.warning("note: %s: %d weight tensors stored as %s were cast to %s", path,
                    len(cast), "/".join(kinds), _dtype_name(next(iter(cast.values()))[1]))
    return out


def load_tokenizer_of(path: str | os.PathLike):
    """The checkpoint's tokenizer (with the chat template and special-token roles of
    its tokenizer_config.json / chat_template.jinja, when there), or None when the
    folder has none."""
    tok_path = resolve_checkpoint_dir(path) / TOKENIZER_FILE
    if not tok_path.is_file():
        return None
    from tinylm.data.tokenizer_files import load_tokenizer

    try:
        return load_tokenizer(tok_path)
    except TinyLMError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{tok_path} is corrupt ({exc}); restore it or re-run "
                              f"'tinylm prepare'") from exc


def require_tokenizer_of(path: str | os.PathLike, needed_for: str):
    """The checkpoint's tokenizer; a one-line CheckpointError when it has none.

    ``needed_for`` completes the sentence: "<path> has no tokenizer.json; <needed_for>"
    (say which command needs it and how to get one)."""
    tokenizer = load_tokenizer_of(path)
    if tokenizer is None:
        raise CheckpointError(f"{path} has no tokenizer.json; {needed_for}")
    return tokenizer


def load_checkpoint(path: str | os.PathLike, device: torch.device | str = "cpu", *,
                    allow_nonfinite: bool = False):
    """(model, tokenizer or None) from a checkpoint folder (see :func:`load_model`)."""
    return load_model(path, device, allow_nonfinite=allow_nonfinite), load_tokenizer_of(path)


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tinylm info`` shows about a checkpoint or run folder, as JSON-ready values.

    Keys: folder, model (config fields), parameters, nonfinite (count of NaN/inf
    weights), tokenizer ({kind, vocab_size, eos} or None), step and val_loss (from the
    training state, the best/ record or the run's metrics.jsonl; None when unknown),
    lowrank ({layer: rank}, empty when none), source (where a converted checkpoint came
    from: config.json's ``source``, e.g. the GGUF file's name, size and architecture; None
    for a model trained here).
    """
    folder = resolve_checkpoint_dir(path)
    config = read_config(folder)
    model = load_model(folder, allow_nonfinite=True)
    nonfinite = sum(p.numel() - int(torch.isfinite(p).sum()) for p in model.parameters())
    tok = load_tokenizer_of(folder)
    tokenizer = None
    if tok is not None:
        eos = tok.eos_id
        tokenizer = {"kind": tok.kind, "vocab_size": tok.vocab_size,
                     "eos": None if eos is None else tok.decode([eos]) or f"id {eos}"}
    step, val_loss = _training_progress(folder, config)
    return {"folder": str(folder), "model": model.config.to_dict(),
            "parameters": model.num_parameters(), "nonfinite": nonfinite,
            "tokenizer": tokenizer, "step": step, "val_loss": val_loss,
            "lowrank": dict(config.get("lowrank") or {}),
            "source": config["source"] if isinstance(config.get("source"), dict) else None}


def _training_progress(folder: Path, config: dict[str, Any]) -> tuple[int | None, float | None]:
    """(step, val loss) of a checkpoint: its training state, its "best" record, and the
    last validation loss in the run's metrics.jsonl (the folder's parent)."""
    step = val = None
    best = config.get("best") if isinstance(config.get("best"), dict) else {}
    try:
        meta = read_json(folder / STATE_JSON_FILE, error=CheckpointError)
    except (FileNotFoundError, CheckpointError):
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    for source in (meta, best):
        if step is None and isinstance(source.get("step"), int):
            step = source["step"]
    if isinstance(best.get("val_loss"), (int, float)):
        val = float(best["val_loss"])
    metrics = folder.parent / "metrics.jsonl"
    if val is None and metrics.is_file() and metrics.stat().st_size < 256 * 1024 * 1024:
        for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("val_loss"), (int, float)) \
                    and (step is None or record.get("step") == step):
                val = float(record["val_loss"])
    if val is None and isinstance(meta.get("best_val_loss"), (int, float)):
        val = float(meta["best_val_loss"])
    return step, val


def load_train_state(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, meta) of the training state saved with a checkpoint."""
    folder = Path(path)
    meta_path = folder / STATE_JSON_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{folder} has no training state ({STATE_JSON_FILE}); it cannot "
                              f"be resumed, start a new run instead") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupt ({exc}); cannot resume from it") from exc
    return read_tensors(folder / STATE_TENSORS_FILE), meta


# --- optimizer state without pickle -------------------------------------------------------

_OPTIM_PREFIX = "optim."


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (moments, step counts) and JSON.

    Tensors are named ``optim.<param index>.<key>``; scalar per-parameter state and the
    param groups (lr, betas, ...) go to the JSON part. Round-trips exactly through
    :func:`load_optimizer_state`.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if isinstance(value, Tensor):
                tensors[f"{_OPTIM_PREFIX}{idx}.{key}"] = value
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor],
                         meta: dict[str, Any]) -> None:
    """Restore what :func:`optimizer_state` saved into an optimizer over the same params."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith(_OPTIM_PREFIX):
            continue
        idx, key = name[len(_OPTIM_PREFIX):].split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    groups = meta["param_groups"]
    own = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
        raise CheckpointError("the saved optimizer state does not match the model's "
                              "parameters (different structure); start a new run instead "
                              "of --resume")
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot restore the optimizer state ({exc}); start a new "
                              f"run instead of --resume") from exc
