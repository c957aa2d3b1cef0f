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

Writes follow the save protocol of :mod:`tinylm.io.checkpoint_files` (the folder's file
names, :func:`~tinylm.io.checkpoint_files.save_checkpoint` and recovery): a temporary
sibling folder, config.json last, renamed into place; a kill at any point leaves a
complete checkpoint that the next load recovers (docs/train.md, "The save protocol").
This module reads one: what a path names (:func:`resolve_checkpoint_dir`, a run folder's
latest/ or a .gguf file's conversion), its config, weights, tokenizer and training state.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from tinylm.core.config import ModelConfig, check_model_fits
from tinylm.core.errors import CheckpointError, ConfigError, NonFiniteError, TinyLMError
from tinylm.core.model import GPT
from tinylm.io.checkpoint_files import (
    CONFIG_FILE,
    FORMAT,
    RUN_BEST,
    RUN_LATEST,
    STATE_JSON_FILE,
    STATE_TENSORS_FILE,
    TOKENIZER_FILE,
    VERSION,
    WEIGHTS_FILE,
    _saved_step,
    is_complete,
    leftovers,
    model_state,
    recover_checkpoint,
    strip_wrapper_prefixes,
    unwrap_model,
)
from tinylm.io.files import is_locked, sha256_file
from tinylm.io.jsonio import read_json
from tinylm.layers import registry

log = logging.getLogger(__name__)

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
_OBJECT_SECTIONS = ("train", "lowrank", "gguf_blocks", "compress", "sharded")
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


def is_sharded(folder: Path) -> bool:
    """Whether ``folder`` is a complete sharded checkpoint (``--strategy fsdp|zero1``)."""
    return is_complete(folder) and bool(read_config(folder).get("sharded"))


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
    given, path = path, resolve_checkpoint_dir(path)
    config = read_config(path)
    if config.get("sharded"):
        raise CheckpointError(f"{path} is a sharded checkpoint (tinylm train --strategy "
                              f"{config['sharded'].get('strategy', 'fsdp')}); consolidate it "
                              f"first: tinylm export-checkpoint {path} --out DIR")
    model = build_model(config)
    state = _stored_state(path, read_tensors(path / WEIGHTS_FILE))
    if config.get("lora_base"):  # adapters only: the frozen weights come from the base
        own = state
        state = {k: v for k, v in _stored_state(
            path, _lora_base_state(config["lora_base"], path)).items() if k not in own}
        state.update(own)
    if model.config.tie_embeddings:
        _drop_tied_head(path, state)
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
    model = model.to(device).eval()
    _ORIGINS[model] = (str(given if Path(given).suffix.lower() == ".gguf" else path),
                       allow_nonfinite)
    return model


#: Where each model :func:`load_model` returned came from: (the checkpoint as the user
#: named it — a .gguf file, else its folder — and whether non-finite weights were allowed),
#: for run-time messages. Weak keys: an entry goes with its model.
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def nonfinite_allowed(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded with ``allow_nonfinite`` (``--allow-nonfinite``): then
    eval reports a non-finite loss as it is, which is what the flag asks for."""
    return _ORIGINS.get(unwrap_model(model), (None, False))[1]


def nonfinite_error(model: torch.nn.Module, what: str) -> NonFiniteError:
    """The one-line error for NaN or infinite values found at run time in ``what`` (e.g.
    "the next-token logits") of ``model``: finite weights can still overflow float32 in
    the forward pass (every weight 3e38 passes the load-time check). It names the
    checkpoint the model was loaded from, when :func:`load_model` loaded it."""
    where, allowed = _ORIGINS.get(unwrap_model(model), (None, False))
    name = f"the model of {where}" if where else "the model"
    cause = ("its weights were loaded with --allow-nonfinite, so they may hold NaN or inf"
             if allowed else "its weights are finite but overflow float32 in the forward pass")
    return NonFiniteError(
        f"{name} gives NaN or infinite values in {what} ({cause}); training diverged or the "
        f"file is damaged: use an earlier checkpoint (e.g. the run's best/) or retrain")


def _stored_state(path: Path, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    """The stored tensors by the model's names (torch.compile / DDP prefixes removed);
    two stored tensors that name the same weight are refused, never one silently kept."""
    state = strip_wrapper_prefixes(raw)
    if len(state) < len(raw):
        seen: dict[str, str] = {}
        for key in raw:
            name = next(iter(strip_wrapper_prefixes({key: None})))
            if name in seen:
                raise CheckpointError(
                    f"{path}: the weights hold both {seen[name]} and {key}, which name the "
                    f"same weight {name}; one of them would be ignored, so the file is "
                    f"refused: restore the checkpoint or re-save it from its source")
            seen[name] = key
    return state


def _drop_tied_head(path: Path, state: dict[str, Tensor]) -> None:
    """Remove a stored ``lm_head.weight`` of a tied model, whose head IS its embedding.
    One equal to the embedding (what some converters write) is a harmless duplicate and
    dropped; any other would be ignored by the model, so the checkpoint is refused."""
    head = state.pop("lm_head.weight", None)
    emb = state.get("tok_emb.weight")
    if head is None:
        return
    same = emb is not None and head.shape == emb.shape and torch.equal(
        head.to(torch.float32), emb.to(torch.float32))
    if not same:
        raise CheckpointError(
            f"{path}: config.json says the LM head is tied to the token embedding, but the "
            f"weights hold an lm_head.weight that differs from tok_emb.weight; the model "
            f"would ignore it, so the checkpoint is refused: set \"tie_embeddings\": false "
            f"in config.json if the head is its own, or remove lm_head.weight")


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
