"""``tinylm export-checkpoint``: consolidate a sharded checkpoint (``--strategy
zero1|fsdp``) into the ordinary safetensors + JSON checkpoint every command reads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tinylm.core.config import TrainConfig
from tinylm.core.errors import CheckpointError
from tinylm.io.checkpoint import (
    build_model,
    is_sharded,
    load_tokenizer_of,
    load_train_state,
    optimizer_state,
    read_config,
    resolve_checkpoint_dir,
)
from tinylm.io.checkpoint_files import SHARDS_DIR, check_target, is_complete, save_checkpoint
from tinylm.layers.registry import SECTIONS as STRUCTURE_SECTIONS
from tinylm.training import build_optimizer, distributed

_STRUCTURE_SECTIONS = ("format", "version", "model", "sharded", *STRUCTURE_SECTIONS)


def export_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *,
                      force: bool = False) -> Path:
    """``tinylm export-checkpoint``: a sharded checkpoint (``--strategy zero1|fsdp``, or a
    run folder whose latest/ is one) -> the ordinary safetensors + JSON checkpoint that
    every command reads, with its whole optimizer state (resumable with ``--strategy
    ddp`` or one process). Reads the shards in this one process, no process group."""
    folder = resolve_checkpoint_dir(source)
    if not is_complete(folder):
        raise CheckpointError(f"{folder} is not a complete tinylm checkpoint; pass a "
                              f"checkpoint folder or a tinylm train --out folder")
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} is already an ordinary checkpoint; every command "
                              f"reads it as it is (nothing was written)")
    dest = check_target(out, force=force)
    config = read_config(folder)
    model = build_model(config)
    train_cfg = TrainConfig.from_dict({**config.get("train", {}), "strategy": "ddp"})
    optimizer = build_optimizer(model, train_cfg, torch.device("cpu"))
    distributed.load_shards(model, optimizer, folder / SHARDS_DIR, distributed.DistContext())
    tensors, meta = load_train_state(folder)
    opt_tensors, opt_meta = optimizer_state(optimizer)
    tensors.update(opt_tensors)
    meta.update(optimizer=opt_meta, strategy="ddp",
                exported_from={**config["sharded"], "step": meta.get("step")})
    extra = {k: v for k, v in config.items() if k not in _STRUCTURE_SECTIONS}
    extra["train"] = train_cfg.to_dict()
    return save_checkpoint(dest, model, load_tokenizer_of(folder), extra_config=extra,
                           train_tensors=tensors, train_meta=meta)
