"""Supervised fine-tuning: a checkpoint + chat data -> a model that answers.

:func:`finetune` loads a base checkpoint (a tinylm run or one converted from Hugging
Face), grows its vocabulary when the chat data's tokenizer appended the chat tokens,
optionally puts LoRA adapters on it (:mod:`tinylm.layers.lora`), and trains it with
:func:`tinylm.training.train` on the data's loss mask, so the loss counts only the
assistants' tokens. It is the same loop as ``tinylm train``: schedule, clipping,
accumulation, evaluation on the validation conversations, checkpoints, exact resume,
DDP, metrics.jsonl and loss.png.

A LoRA run's checkpoints hold only the adapters plus config.json's ``"lora"`` entry
naming the base checkpoint (its path and the sha256 of its weights);
:func:`merge` folds the adapters into a plain checkpoint that needs nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.core.config import TrainConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data.chatdata import ChatData, load_chat_data
from tinylm.data.tokenizers import STANDARD_SPECIALS, Tokenizer
from tinylm.io.checkpoint import (
    load_checkpoint,
    load_model,
    require_tokenizer_of,
    resolve_checkpoint_dir,
)
from tinylm.io.checkpoint_files import WEIGHTS_FILE, save_checkpoint
from tinylm.io.files import sha256_file
from tinylm.layers.lora import DEFAULT_TARGETS, adapter_parameters, apply_lora, merge_lora
from tinylm.training import TrainResult, command_threads, train
from tinylm.training.defaults import FINETUNE_DROPOUT, FULL_DEFAULTS, LORA_DEFAULTS


def _same_tokens(base: Tokenizer, data: Tokenizer) -> bool:
    """True when ``data`` is ``base``, or ``base`` with the chat tokens appended."""
    want = base.to_hf_json()
    return data.to_hf_json() in (want, base.with_special_tokens(STANDARD_SPECIALS).to_hf_json())


def grow_vocab(model: GPT, vocab_size: int) -> GPT:
    """``model`` with ``vocab_size`` embedding rows: existing rows kept, new rows
    drawn as GPT-2 initialises embeddings (N(0, 0.02)), so each new token differs."""
    old = model.config.vocab_size
    if vocab_size == old:
        return model
    grown = GPT(model.config.replace(vocab_size=vocab_size))
    state = grown.state_dict()
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key in ("tok_emb.weight", "lm_head.weight"):
                state[key][:old] = value
            else:
                state[key] = value
    grown.load_state_dict(state)
    return grown.train(model.training)


def with_dropout(model: GPT, dropout: float) -> GPT:
    """``model`` with dropout probability ``dropout`` (the same weights; a new model only
    when it differs from the model's own)."""
    if dropout == model.config.dropout:
        return model
    new = GPT(model.config.replace(dropout=dropout))
    new.load_state_dict(model.state_dict())
    return new.train(model.training)


def base_model(model_dir: str | os.PathLike, data: ChatData,
               dropout: float = FINETUNE_DROPOUT) -> GPT:
    """The base checkpoint, checked against the data's tokenizer, grown to fit it, with
    ``dropout`` for the fine-tuning run."""
    model = with_dropout(load_model(model_dir), dropout)
    tok = require_tokenizer_of(model_dir, "its tokens cannot be matched to the chat data; "
                                          "fine-tune a checkpoint that has one")
    if not _same_tokens(tok, data.tokenizer):
        raise DataError(f"the chat data {data.dir} was prepared with another tokenizer than "
                        f"{model_dir}'s ({tok.kind}, {tok.vocab_size} tokens); prepare it with "
                        f"tinylm prepare --chat FILE --tokenizer {model_dir}")
    if any(n.endswith((".lora_A", ".lora_B")) for n, _ in model.named_parameters()):
        model = merge_lora(model)  # fine-tuning a LoRA run: start from its merged weights
    return grow_vocab(model, data.tokenizer.vocab_size)


def train_config(overrides: dict[str, Any] | None, lora: bool) -> TrainConfig:
    """The fine-tuning TrainConfig: :data:`FULL_DEFAULTS` / :data:`LORA_DEFAULTS` with
    ``overrides`` (TrainConfig field -> value) on top."""
    values = {**(LORA_DEFAULTS if lora else FULL_DEFAULTS), **(overrides or {})}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown training setting(s) {unknown}; see tinylm finetune --help")
    return TrainConfig.from_dict(values)


def finetune(model_dir: str | os.PathLike, data_dir: str | os.PathLike | ChatData,
             out_dir: str | os.PathLike, *, lora_rank: int | None = None,
             lora_alpha: float | None = None, lora_targets: Any = DEFAULT_TARGETS,
             overrides: dict[str, Any] | None = None, resume: bool | str | None = False,
             progress: bool | None = None, merge_to: bool = False,
             dropout: float | None = None) -> tuple[TrainResult, dict[str, Any]]:
    """Fine-tune ``model_dir`` on chat data into ``out_dir``; LoRA when ``lora_rank``.
    ``merge_to``: a LoRA run also writes ``out_dir/merged`` (:func:`merge`). ``dropout``
    (default :data:`FINETUNE_DROPOUT`) is the model's dropout while fine-tuning.

    Returns the training result and a summary (mode, parameter counts, merged path)."""
    data = data_dir if isinstance(data_dir, ChatData) else load_chat_data(data_dir)
    lora = lora_rank is not None
    if merge_to and not lora:
        raise ConfigError("--merge needs --lora-rank (full fine-tuning has nothing to merge)")
    cfg = train_config(overrides, lora)
    torch.manual_seed(cfg.seed)  # the new embedding rows and adapters are seeded
    model = base_model(model_dir, data, FINETUNE_DROPOUT if dropout is None else dropout)
    base_vocab = load_checkpoint(model_dir)[0].config.vocab_size
    info: dict[str, Any] = {"mode": "lora" if lora else "full", "base": str(Path(model_dir)),
                            "parameters": sum(p.numel() for p in model.parameters())}
    extra: dict[str, Any] = {"finetune": {"mode": info["mode"],
                                          "base": str(Path(model_dir).resolve()),
                                          "data": str(getattr(data, "dir", ""))}}
    if lora:
        apply_lora(model, lora_rank, lora_alpha, lora_targets)
        extra["lora_base"] = {"path": str(Path(model_dir).resolve()),
                              "sha256": sha256_file(resolve_checkpoint_dir(model_dir)
                                                    / WEIGHTS_FILE),
                              "grown": model.config.vocab_size > base_vocab}
    info["trainable"] = (adapter_parameters(model) if lora else
                         sum(p.numel() for p in model.parameters() if p.requires_grad))
    with command_threads(cfg.threads):
        result = train(model.config, cfg, data, out_dir, model=model, resume=resume,
                       progress=progress, extra_config=extra)
    if merge_to and result.rank == 0 and not result.interrupted:
        info["merged"] = merge(result.checkpoint, Path(out_dir) / "merged", force=True)
    return result, info


def merge(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
          force: bool = False) -> Path:
    """Fold a LoRA checkpoint's adapters into a plain checkpoint at ``out_dir``."""
    from tinylm.io.checkpoint_files import check_target

    model, tok = load_checkpoint(model_dir)
    if not any(isinstance(m, nn.Module) and n.endswith(("qkv", "out", "up", "down"))
               and hasattr(m, "lora_A") for n, m in model.named_modules()):
        raise ConfigError(f"{model_dir} has no LoRA adapters to merge; it is already a plain "
                          f"checkpoint")
    dest = check_target(out_dir, force=force)
    return save_checkpoint(dest, merge_lora(model), tok,
                           extra_config={"merged_from": str(Path(model_dir).resolve())})


__all__ = ["FINETUNE_DROPOUT", "FULL_DEFAULTS", "LORA_DEFAULTS", "base_model", "finetune",
           "grow_vocab", "merge", "train_config", "with_dropout"]
