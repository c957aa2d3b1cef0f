"""What ``tinylm info`` shows about a checkpoint or run folder (a ``.gguf`` file too): the
architecture and parameter count, the tokenizer and how the model chats, the training
step and validation loss it reached, its low-rank ranks and where an import came from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tinylm.core.errors import CheckpointError
from tinylm.io.checkpoint import load_model, load_tokenizer_of, read_config, resolve_checkpoint_dir
from tinylm.io.checkpoint_files import STATE_JSON_FILE
from tinylm.io.jsonio import read_json


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tinylm info`` shows about a checkpoint or run folder, as JSON-ready values.

    Keys: folder, model (config fields), parameters, nonfinite (count of NaN/inf
    weights), tokenizer ({kind, vocab_size, eos, chat} or None), step and val_loss (from
    the training state, the best/ record or the run's metrics.jsonl; None when unknown),
    lowrank ({layer: rank}, empty when none), source (where an imported model came from,
    e.g. {gguf, name, architecture}; None).
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
        tokenizer["chat"] = _chat_format(tok)
    step, val_loss = _training_progress(folder, config)
    return {"folder": str(folder), "model": model.config.to_dict(),
            "parameters": model.num_parameters(), "nonfinite": nonfinite,
            "tokenizer": tokenizer, "step": step, "val_loss": val_loss,
            "lowrank": dict(config.get("lowrank") or {}),
            "source": config.get("source") if isinstance(config.get("source"), dict) else None}


def _chat_format(tok: Any) -> str:
    """How the tokenizer's model chats: its own template, tinylm's format, or not at all."""
    if tok.settings.chat_template:
        stops = [tok.decode([i]) for i in tok.end_of_turn_ids]
        return f"its own template (turns end with {', '.join(stops) or 'no stop token'})"
    return "tinylm's format" if tok.chat_template is not None else "none (no chat tokens)"


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
