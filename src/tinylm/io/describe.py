"""What ``tinylm info`` shows about a checkpoint or run folder (a ``.gguf`` file too): the
architecture, every parameter (quantized weights included) and the bytes on disk and in
memory, the tokenizer and how the model chats, the training step and validation loss it
reached (its own, or its source's for a quantized or compressed copy), what made it
(train, finetune, quantize, compress, merge, convert), its quantization, low-rank ranks
and LoRA adapters; :func:`info_lines` is the same record as labelled lines."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.checkpoint import load_model, load_tokenizer_of, read_config, resolve_checkpoint_dir
from tinylm.io.checkpoint_files import SHARDS_DIR, STATE_JSON_FILE, WEIGHTS_FILE
from tinylm.io.jsonio import read_json
from tinylm.layers.blocks import BlockLinear
from tinylm.layers.lora import LoRALinear
from tinylm.layers.quantized import QuantizedLinear


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tinylm info`` shows about a checkpoint or run folder, as JSON-ready values.

    Keys: folder, model (config fields), parameters (every weight the model computes
    with: float parameters plus quantized integer weights) and parameter_kinds ({float,
    quantized}), bytes ({disk: its weight files, memory: the loaded tensors}), nonfinite
    (count of NaN/inf weights), tokenizer ({kind, vocab_size, eos, chat} or None), step
    and val_loss (from the training state, the best/ record or the run's metrics.jsonl;
    None when unknown), trained_by (the tinylm train record, or None), source_training
    (for a checkpoint made from another one: that one's {source, found, step,
    val_loss}), made_by (the commands that made it, newest first), quantized ([{bits,
    group_size, minimum, layers}] per scheme), lowrank ({layer: rank}), lora ({rank,
    alpha, layers, adapter_parameters, base, base_found, grown} or None), source (where
    an imported model came from, e.g. {gguf, name, architecture}; None).
    """
    folder = resolve_checkpoint_dir(path)
    config = read_config(folder)
    model = load_model(folder, allow_nonfinite=True)
    nonfinite = sum(p.numel() - int(torch.isfinite(p).sum()) for p in model.parameters())
    step, val_loss, state = _training_progress(folder, config)
    own = step is not None or val_loss is not None
    floats, quantized = model.num_parameters(), _quantized_weights(model)
    return {"folder": str(folder), "model": model.config.to_dict(),
            "parameters": floats + quantized,
            "parameter_kinds": {"float": floats, "quantized": quantized},
            "bytes": {"disk": _disk_bytes(folder), "memory": _memory_bytes(model)},
            "nonfinite": nonfinite, "tokenizer": _tokenizer_info(folder),
            "step": step, "val_loss": val_loss, "trained_by": _trained_by(config, state),
            "source_training": None if own else _source_training(config),
            "made_by": _made_by(config),
            "quantized": _quantization(model), "lowrank": dict(config.get("lowrank") or {}),
            "lora": _lora(model, config),
            "source": config.get("source") if isinstance(config.get("source"), dict) else None}


def _tokenizer_info(folder: Path) -> dict[str, Any] | None:
    tok = load_tokenizer_of(folder)
    if tok is None:
        return None
    eos = tok.eos_id
    return {"kind": tok.kind, "vocab_size": tok.vocab_size,
            "eos": None if eos is None else tok.decode([eos]) or f"id {eos}",
            "chat": _chat_format(tok)}


def _chat_format(tok: Any) -> str:
    """How the tokenizer's model chats: its own template, tinylm's format, or not at all."""
    if tok.settings.chat_template:
        stops = [tok.decode([i]) for i in tok.end_of_turn_ids]
        return f"its own template (turns end with {', '.join(stops) or 'no stop token'})"
    return "tinylm's format" if tok.chat_template is not None else "none (no chat tokens)"


# --- sizes and structure ---------------------------------------------------------------------


def _quantized_weights(model: nn.Module) -> int:
    """The weights a model holds as quantized integers (they are buffers, not parameters;
    a BlockLinear's O·I weights, packed two per byte for the 4-bit types)."""
    return sum(m.qweight.numel() if isinstance(m, QuantizedLinear) else m.quantized_weights
               for m in model.modules() if isinstance(m, (QuantizedLinear, BlockLinear)))


def all_parameters(model: nn.Module) -> int:
    """Every weight ``model`` computes with: its distinct float parameters plus the
    quantized integer weights (which ``num_parameters`` does not see: they are buffers)."""
    return sum(p.numel() for p in model.parameters()) + _quantized_weights(model)


def _memory_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers as loaded."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _disk_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's weight files (model.safetensors, or a sharded save's
    weight shards), optimizer state excluded."""
    weights = folder / WEIGHTS_FILE
    if weights.is_file():
        return weights.stat().st_size
    shards = folder / SHARDS_DIR
    return sum(p.stat().st_size for p in shards.glob("model*.safetensors")) \
        if shards.is_dir() else 0


def _quantization(model: nn.Module) -> list[dict[str, Any]]:
    """One entry per scheme (bits, group size, minimum; a GGUF block type) with its layers
    in model order."""
    schemes: dict[tuple, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            key = (m.bits, m.group_size, m.minimum is not None, None)
            schemes.setdefault(key, []).append(name)
        elif isinstance(m, BlockLinear):
            key = (8 if m.block_type == "Q8_0" else 4, 32, m.block_type == "Q4_1",
                   m.block_type)
            schemes.setdefault(key, []).append(name)
    return [{"bits": b, "group_size": g, "minimum": mn, "layers": names,
             **({"block_type": t} if t else {})}
            for (b, g, mn, t), names in schemes.items()]


def _lora(model: nn.Module, config: dict[str, Any]) -> dict[str, Any] | None:
    """A LoRA model's adapters (ranks, alphas, layers, size) and the base it was put on."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not layers:
        return None
    base = config.get("lora_base") if isinstance(config.get("lora_base"), dict) else {}
    finetune = config.get("finetune") if isinstance(config.get("finetune"), dict) else {}
    base_path = base.get("path") or finetune.get("base")
    return {"rank": sorted({m.rank for _, m in layers}),
            "alpha": sorted({float(m.alpha) for _, m in layers}),
            "layers": [n for n, _ in layers],
            "adapter_parameters": sum(m.lora_A.numel() + m.lora_B.numel() for _, m in layers),
            "base": base_path, "base_found": bool(base_path) and Path(base_path).exists(),
            "adapters_only": bool(base), "grown": bool(base.get("grown"))}


# --- where it came from ------------------------------------------------------------------------


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _made_by(config: dict[str, Any]) -> list[str]:
    """The tinylm commands that made this checkpoint, as config.json records them."""
    made = []
    q, c, f = (_section(config, k) for k in ("quantized_from", "compress", "finetune"))
    if q:
        made.append(f"tinylm quantize ({q.get('scheme', '?')}) of {q.get('source', '?')}")
    if c:
        tuned = f", then fine-tuned {c['finetune_steps']} steps" \
            if c.get("finetune_steps") else ""
        made.append(f"tinylm compress ({c.get('mode', '?')}{tuned}) of {c.get('source', '?')}")
    if isinstance(config.get("merged_from"), str):
        made.append(f"tinylm merge: the LoRA adapters of {config['merged_from']} folded into "
                    f"its base")
    if f:
        made.append(f"tinylm finetune ({f.get('mode', '?')}) of {f.get('base', '?')} on "
                    f"{f.get('data', '?')}")
    elif _section(config, "train"):
        made.append("tinylm train")
    source = _section(config, "source")
    if source.get("gguf"):
        made.append(f"tinylm convert --from-gguf {source['gguf']}")
    if source.get("hf"):
        made.append(f"tinylm convert --from-hf {source['hf']}")
    return made


def _trained_by(config: dict[str, Any], state: dict[str, Any]) -> dict[str, Any] | None:
    """tinylm train's record of the run that wrote this checkpoint (None: not trained by it)."""
    train = _section(config, "train")
    if not train:
        return None
    return {"steps": state.get("step"), "max_steps": train.get("max_steps"),
            "stop_reason": state.get("stop_reason"), "tokens": state.get("tokens_seen"),
            "lr": train.get("lr"), "batch_size": train.get("batch_size"),
            "optimizer": train.get("optimizer")}


def _source_path(config: dict[str, Any]) -> str | None:
    """The checkpoint this one was made from by quantize, compress or merge."""
    for key in ("quantized_from", "compress"):
        source = _section(config, key).get("source")
        if isinstance(source, str):
            return source
    merged = config.get("merged_from")
    return merged if isinstance(merged, str) else None


def _source_training(config: dict[str, Any], hops: int = 4) -> dict[str, Any] | None:
    """The training the checkpoint's source reached (following quantize/compress/merge
    records back to the first checkpoint that has one); None when it has no source."""
    source = _source_path(config)
    if source is None:
        return None
    found = {"source": source, "found": False, "step": None, "val_loss": None}
    if source.lower().endswith(".gguf"):  # a pretrained file: no tinylm training
        return {**found, "found": Path(source).is_file(), "pretrained": True}
    try:
        folder = resolve_checkpoint_dir(source)
        cfg = read_config(folder)
    except (CheckpointError, ConfigError, OSError):
        return found
    step, val, _ = _training_progress(folder, cfg)
    if step is None and val is None and hops > 0:
        deeper = _source_training(cfg, hops - 1)
        if deeper is not None and deeper["found"]:
            return deeper
    return {"source": str(folder), "found": True, "step": step, "val_loss": val}


def _training_progress(folder: Path, config: dict[str, Any]
                       ) -> tuple[int | None, float | None, dict[str, Any]]:
    """(step, val loss, the training state's JSON) of a checkpoint: its training state,
    its "best" record, and the last validation loss in the run's metrics.jsonl (the
    folder's parent)."""
    step = val = None
    best = _section(config, "best")
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
    return step, val, meta


# --- the record as lines ---------------------------------------------------------------------


def layer_summary(names: list[str], n_layer: int) -> str:
    """Layer names in few words: "attn.qkv, ffn.up of all 4 blocks", "ffn.up of blocks
    0-1", other names as they are."""
    by_suffix: dict[str, list[int]] = {}
    others = []
    for name in names:
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m:
            by_suffix.setdefault(m[2], []).append(int(m[1]))
        else:
            others.append(name)
    every = [s for s, ids in by_suffix.items() if sorted(set(ids)) == list(range(n_layer))]
    parts = [f"{', '.join(every)} of all {n_layer} blocks"] if every else []
    parts += [f"{s} of block{'s' if len(ids) > 1 else ''} {_ranges(ids)}"
              for s, ids in by_suffix.items() if s not in every]
    return "; ".join(parts + others)


def _ranges(ids: list[int]) -> str:
    ids = sorted(set(ids))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n:,} bytes"


def _parameters_text(info: dict[str, Any]) -> str:
    kinds = info.get("parameter_kinds") or {}
    if not kinds.get("quantized"):
        return f"{info['parameters']:,}"
    return (f"{info['parameters']:,} ({kinds['quantized']:,} quantized weights + "
            f"{kinds['float']:,} float)")


def _size_text(info: dict[str, Any]) -> str:
    b = info["bytes"]
    lora = info.get("lora") or {}
    disk = f"{_mb(b['disk'])} on disk" + (" (the adapters; the base's weights come from the "
                                          "base)" if lora.get("adapters_only") else "")
    return f"{disk}, {_mb(b['memory'])} in memory"


def _quantized_text(info: dict[str, Any]) -> str:
    groups = info.get("quantized") or []
    if not groups:
        return "none (float weights)"
    n_layer = info["model"].get("n_layer", 0)
    parts = []
    for g in groups:
        per = "per output channel" if g["group_size"] is None \
            else f"groups of {g['group_size']} inputs"
        kind = f"int{g['bits']}" if g["bits"] == 8 else f"{g['bits']}-bit (stored in int8)"
        if g.get("block_type"):
            kind = (f"{g['block_type']} blocks ({g['bits']}-bit"
                    + (", two per byte)" if g["bits"] == 4 else ")"))
        parts.append(f"{kind}, {per}{', with a minimum' if g['minimum'] else ''}: "
                     f"{len(g['layers'])} layers ({layer_summary(g['layers'], n_layer)})")
    return "; ".join(parts)


def _lowrank_text(ranks: dict[str, int]) -> str:
    if not ranks:
        return "none (full-rank)"
    return (f"{len(ranks)} layers, ranks {min(ranks.values())}..{max(ranks.values())}: "
            + ", ".join(f"{k} {v}" for k, v in list(ranks.items())[:6])
            + (", ..." if len(ranks) > 6 else ""))


def _lora_text(lora: dict[str, Any], n_layer: int) -> str:
    def one(values: list) -> str:
        return "/".join(f"{v:g}" for v in values)

    base = lora["base"] or "not recorded"
    where = "" if not lora["base"] else " (found)" if lora["base_found"] else " (missing!)"
    return (f"rank {one(lora['rank'])}, alpha {one(lora['alpha'])} on {len(lora['layers'])} "
            f"layers ({layer_summary(lora['layers'], n_layer)}), "
            f"{lora['adapter_parameters']:,} adapter parameters; base {base}{where}")


def _training_text(info: dict[str, Any]) -> str:
    step, val = info["step"], info["val_loss"]
    own = ", ".join(([f"step {step:,}"] if step is not None else [])
                    + ([f"val loss {val:.4f}"] if val is not None else []))
    if own:
        return own
    src = info.get("source_training")
    if src and src["found"] and (src["step"] is not None or src["val_loss"] is not None):
        of = ", ".join(([f"step {src['step']:,}"] if src["step"] is not None else [])
                       + ([f"val loss {src['val_loss']:.4f}"] if src["val_loss"] is not None
                          else []))
        return f"none of its own; made from {src['source']}, trained to {of}"
    if src and src.get("pretrained"):
        return f"none in tinylm; made from {src['source']}, pretrained elsewhere"
    if src:
        state = "no longer there" if not src["found"] else "has no training record"
        return f"none of its own; its source {src['source']} {state}"
    if info.get("source"):
        return "pretrained elsewhere (converted); none in tinylm"
    return "none recorded (saved without tinylm train, and no run folder around it)"


def _train_text(t: dict[str, Any]) -> str:
    """tinylm train's record in a few words: steps, why it stopped, tokens, optimizer."""
    steps = f"{t['steps']:,} of {t['max_steps']:,} steps" \
        if isinstance(t.get("steps"), int) and isinstance(t.get("max_steps"), int) \
        else "steps unknown"
    why = f", stopped by {t['stop_reason']}" if t.get("stop_reason") else ""
    tokens = f", {t['tokens']:,} tokens" if isinstance(t.get("tokens"), int) else ""
    return (f"{steps}{why}{tokens}, {t.get('optimizer')} lr {t.get('lr')}, batch "
            f"{t.get('batch_size')}")


def _made_text(info: dict[str, Any]) -> str:
    made = list(info.get("made_by") or [])
    t = info.get("trained_by")
    for i, entry in enumerate(made):
        if t and entry.startswith(("tinylm train", "tinylm finetune")):
            made[i] = f"{entry}: {_train_text(t)}"
    return "; then ".join(reversed(made)) if made else "not recorded"


def info_lines(info: dict[str, Any]) -> list[tuple[str, str]]:
    """:func:`describe_checkpoint`'s record as the (label, text) lines ``tinylm info``
    prints."""
    m = dict(info["model"])
    n_layer = m.get("n_layer", 0)
    sizes = [f"{m.pop(k)} {label}" for k, label in (
        ("n_layer", "layers"), ("n_head", "heads"), ("head_dim", "dims/head"),
        ("n_embd", "n_embd"), ("context_length", "context"), ("vocab_size", "vocab"))
        if k in m]
    options = ", ".join(f"{k}={v}" for k, v in sorted(m.items()))
    tok = info["tokenizer"]
    tok_text = "none (no tokenizer.json)" if tok is None else (
        f"{tok['kind']}, {tok['vocab_size']:,} tokens, end-of-text "
        f"{tok['eos'] if tok['eos'] is not None else 'none'}")
    lines = [("checkpoint", info["folder"]), ("architecture", ", ".join(sizes)),
             ("options", options), ("parameters", _parameters_text(info)),
             ("size", _size_text(info)), ("tokenizer", tok_text)]
    if tok is not None and tok.get("chat"):
        lines.append(("chat", tok["chat"]))
    lines += [("made by", _made_text(info)), ("training", _training_text(info)),
              ("quantized", _quantized_text(info)), ("low-rank", _lowrank_text(info["lowrank"]))]
    if info.get("lora"):
        lines.append(("LoRA", _lora_text(info["lora"], n_layer)))
    source = info.get("source")
    if source and source.get("gguf"):
        lines.insert(1, ("converted", f"from {source['gguf']} ({source.get('architecture')}, "
                                      f"{source.get('bytes', 0) / 1e6:.1f} MB"
                                      + (f", \"{source['name']}\")" if source.get("name")
                                         else ")")))
    if info["nonfinite"]:
        lines.append(("WARNING", f"{info['nonfinite']:,} weights are NaN or infinite"))
    return lines
