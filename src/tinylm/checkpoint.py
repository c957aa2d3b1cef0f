"""Checkpoints: a folder of safetensors + JSON, written atomically, never pickled.

Layout of a checkpoint folder::

    config.json              {"format": "tinylm", "version": 1, "model": ModelConfig, ...}
    model.safetensors        the weights (a tied LM head is stored once, as tok_emb)
    tokenizer.json           the tokenizer, when one is known
    train_state.safetensors  optional: optimizer moments, RNG states (tensors)
    train_state.json         optional: step, data position, best loss ... (JSON)

Writes go to a temporary sibling folder that is fsynced and then renamed into place;
an existing checkpoint at the destination is kept until the new one is complete, so a
run killed mid-save never leaves a folder that looks complete but is not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tinylm.config import ModelConfig, check_model_fits
from tinylm.errors import CheckpointError, ConfigError, TinyLMError
from tinylm.jsonio import read_json
from tinylm.model import GPT

FORMAT = "tinylm"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"

log = logging.getLogger(__name__)

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


# --- writing ------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
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


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    tokenizer: Any | None = None,
    *,
    extra_config: dict[str, Any] | None = None,
    train_tensors: dict[str, Tensor] | None = None,
    train_meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and optionally its tokenizer and training state) to ``path``.

    ``extra_config`` entries are merged into config.json (e.g. "train" or "lowrank");
    ``train_tensors``/``train_meta`` become train_state.safetensors/.json. Atomic: the
    folder appears complete or not at all, and a previous checkpoint at ``path`` is
    replaced only once the new one is fully on disk.
    """
    dest = Path(path)
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint in {parent}: {exc.strerror}; "
                              f"choose a writable --out folder") from exc
    try:
        base = unwrap_model(model)
        config = {"format": FORMAT, "version": VERSION, "model": base.config.to_dict()}
        config.update(extra_config or {})
        from tinylm.lowrank import structure_of  # factorised layers (tinylm compress)

        if structure_of(base):
            config["lowrank"] = structure_of(base)
        _write_tensors(tmp / WEIGHTS_FILE, model_state(base))
        _write_json(tmp / CONFIG_FILE, config)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        if train_tensors is not None:
            _write_tensors(tmp / STATE_TENSORS_FILE, train_tensors)
        if train_meta is not None:
            _write_json(tmp / STATE_JSON_FILE, train_meta)
        _fsync_dir(tmp)
        old = None
        if dest.exists():
            old = parent / f".{dest.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(dest, old)
        os.replace(tmp, dest)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {dest}: {exc}; the previous "
                              f"checkpoint (if any) is untouched; free disk space or choose "
                              f"another --out") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# --- reading ------------------------------------------------------------------------------


RUN_LATEST = "latest"  # a training run folder's newest checkpoint (tinylm train --out)


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names: itself, or ``path/latest`` for a run folder.

    ``tinylm train --out RUN`` writes RUN/latest and RUN/best; passing RUN wherever a
    checkpoint is expected means RUN/latest. This is the one place that decides it.
    """
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() and (folder / RUN_LATEST / CONFIG_FILE).is_file():
        return folder / RUN_LATEST
    return folder


#: config.json sections that hold JSON objects when present (others are free-form).
_OBJECT_SECTIONS = ("train", "lowrank", "compress")
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
    from safetensors.torch import load_file

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
    model = GPT(model_config)
    lowrank = config.get("lowrank")
    if lowrank:
        from tinylm.lowrank import apply_structure  # factorised layers (tinylm compress)

        apply_structure(model, lowrank)
    return model


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", *,
               allow_nonfinite: bool = False) -> GPT:
    """The model stored in a checkpoint folder, in eval mode, on ``device``.

    Weights stored in another float dtype (float16, bfloat16, float64) are cast to the
    model's with a note; integer or bool weights are refused, and so are NaN/infinite
    weights unless ``allow_nonfinite``.
    """
    path = resolve_checkpoint_dir(path)
    config = read_config(path)
    model = build_model(config)
    state = strip_wrapper_prefixes(read_tensors(path / WEIGHTS_FILE))
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
    """The checkpoint's tokenizer, or None when the folder has none."""
    tok_path = resolve_checkpoint_dir(path) / TOKENIZER_FILE
    if not tok_path.is_file():
        return None
    from tinylm.tokenizers import load_tokenizer

    try:
        return load_tokenizer(tok_path)
    except TinyLMError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{tok_path} is corrupt ({exc}); restore it or re-run "
                              f"'tinylm prepare'") from exc


def load_checkpoint(path: str | os.PathLike, device: torch.device | str = "cpu", *,
                    allow_nonfinite: bool = False):
    """(model, tokenizer or None) from a checkpoint folder (see :func:`load_model`)."""
    return load_model(path, device, allow_nonfinite=allow_nonfinite), load_tokenizer_of(path)


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tinylm info`` shows about a checkpoint or run folder, as JSON-ready values.

    Keys: folder, model (config fields), parameters, nonfinite (count of NaN/inf
    weights), tokenizer ({kind, vocab_size, eos} or None), step and val_loss (from the
    training state, the best/ record or the run's metrics.jsonl; None when unknown),
    lowrank ({layer: rank}, empty when none).
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
            "lowrank": dict(config.get("lowrank") or {})}


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
