"""The commands that train or write training runs: ``train``, ``finetune``, ``merge``,
``plot`` and ``export-checkpoint``."""

from __future__ import annotations

import argparse
import sys

from tinylm.cli.flags import _OFF, _config_flags, _resume_arg

_MODEL_FLAG_HELP = {
    "vocab_size": None,  # always the prepared data's tokenizer size
    "context_length": "C, tokens per training window and the model's longest input",
    "n_layer": "number of Transformer blocks",
    "n_head": "H, attention heads per block",
    "n_embd": "E, embedding width",
    "head_dim": "D per head (default: n_embd // n_head)",
    "dropout": "dropout probability while training",
    "bias": "biases in Linear layers and LayerNorms",
    "tie_embeddings": "share the token embedding with the LM head",
    "norm_eps": "epsilon of every LayerNorm/RMSNorm",
    "norm": "layernorm (GPT-2) or rmsnorm",
    "position": "learned (position table, GPT-2) or rope (rotary, in attention)",
    "rope_theta": "RoPE base theta",
    "mlp": "gelu (GPT-2), swiglu (gated SiLU, Llama) or relu2 (squared ReLU)",
    "ffn_hidden": "MLP hidden width (default: 4*E; swiglu 8*E/3 rounded up to 8)",
    "n_kv_head": "key/value heads, fewer = grouped-query, 1 = multi-query (default: n_head)",
    "qk_norm": "RMSNorm each head's query and key",
    "qkv_bias": "biases on the QKV projection only (default: --bias)",
}


def _add_train(sub: argparse._SubParsersAction) -> None:
    from tinylm.core.config import ARCH_PRESETS, ModelConfig, TrainConfig

    p = sub.add_parser(
        "train",
        help="train a model on prepared data; writes checkpoints, metrics.jsonl, loss.png",
        description="Train a GPT on a folder written by 'tinylm prepare'. The run folder "
        "--out gets latest/ (resumable checkpoint), best/ (lowest periodic validation "
        "estimate), metrics.jsonl, "
        "loss.png and run.toml; one process at a time (a lock). Values come from the "
        "defaults, then the saved run (with "
        "--resume), then --config, then flags. Under torchrun every process runs this.",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="prepared data folder")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder to write")
    p.add_argument("--config", metavar="TOML", help="run config file ([model]/[train] "
                   "tables or top-level keys); flags override it")
    p.add_argument("--resume", nargs="?", const=True, default=None, type=_resume_arg,
                   metavar="auto",
                   help="continue from OUT/latest (an error when there is none); "
                   "'--resume auto' continues if a checkpoint exists, else starts; after a "
                   "torchrun restart, auto is what a plain run does")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="force the progress bar on/off (default: on a terminal)")
    model = p.add_argument_group("model")
    model.add_argument("--arch", choices=sorted(ARCH_PRESETS), default=None,
                       help="architecture preset: gpt2, llama (RMSNorm, RoPE, SwiGLU, no "
                       "biases, untied head) or modern (RMSNorm, RoPE, ReLU², QK-norm, no "
                       "biases, untied head); explicit flags override it (default: gpt2)")
    _config_flags(model, ModelConfig, _MODEL_FLAG_HELP)
    _config_flags(p.add_argument_group("training"), TrainConfig, {})
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from tinylm.core.config import ModelConfig, TrainConfig
    from tinylm.training import UNSET, train_run

    names = [f.name for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)]
    overrides = {n: UNSET if getattr(args, n, None) is _OFF else getattr(args, n, None)
                 for n in names}
    result = train_run(args.data, args.out, config_file=args.config, overrides=overrides,
                       resume=args.resume, progress=args.progress, arch=args.arch)
    if result.rank != 0:
        return 0
    if result.stop_reason == "finished":
        print(f"{result.out_dir} was already finished at step {result.steps}; nothing changed "
              f"(pass a larger --max-steps or --time-budget to train further)")
        return 0
    mins, secs = divmod(int(result.elapsed), 60)
    if result.interrupted:
        print(f"interrupted at step {result.steps}; checkpoint saved to {result.checkpoint}; "
              f"continue with: tinylm train --data {args.data} --out {args.out} --resume",
              file=sys.stderr)
        return 130
    print(f"trained {result.steps} steps in {mins}m{secs:02d}s "
          f"({result.tokens_per_s:,.0f} tokens/s), stopped by {result.stop_reason}")
    if result.final_val_loss is not None:
        best = (f"; best estimate {result.best_val_loss:.4f}"
                if result.best_val_loss is not None else "")
        print(f"val loss {result.final_val_loss:.4f} (perplexity "
              f"{result.final_val_perplexity:.2f}) over the whole validation split{best}")
    best_dir = result.out_dir / "best"
    print(f"checkpoint: {result.checkpoint}"
          + (f"  (best: {best_dir})" if best_dir.is_dir() else ""))
    plot = Path(result.out_dir) / "loss.png"
    if plot.is_file():
        print(f"loss curve: {plot}")
    return 0


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    from tinylm.core.config import TrainConfig
    from tinylm.layers.defaults import DEFAULT_TARGETS
    from tinylm.training.defaults import FINETUNE_DROPOUT, FULL_DEFAULTS, LORA_DEFAULTS

    p = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on chat data (full or LoRA); loss on assistant tokens",
        description="Supervised fine-tuning of --model on a folder written by 'tinylm "
        "prepare --chat'. Only the assistants' tokens count in the loss. Full fine-tuning "
        "by default; --lora-rank R trains low-rank adapters instead and saves only them "
        "(plus a reference to the base; 'tinylm merge' folds them in). The same loop, "
        "files and flags as 'tinylm train'. Defaults that differ from train: "
        + ", ".join(f"{k}={v}" for k, v in FULL_DEFAULTS.items())
        + f" (LoRA: lr={LORA_DEFAULTS['lr']}).",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="base checkpoint or run folder (tinylm train / convert --from-hf)")
    p.add_argument("--data", required=True, metavar="DIR", help="'tinylm prepare --chat' folder")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder to write")
    p.add_argument("--lora-rank", type=int, metavar="R",
                   help="train rank-R LoRA adapters instead of every weight")
    p.add_argument("--lora-alpha", type=float, metavar="A",
                   help="LoRA scale numerator: updates are (A / R)·x·A·B (default: 2·R)")
    p.add_argument("--lora-targets", default=",".join(DEFAULT_TARGETS), metavar="LIST",
                   help="layers to adapt, from qkv,out,up,down (default: %(default)s)")
    p.add_argument("--dropout", type=float, metavar="P",
                   help="dropout probability while fine-tuning; the base's pretraining "
                   "dropout is not carried over, and with 0 the fused native training step "
                   f"runs (default: {FINETUNE_DROPOUT:g})")
    p.add_argument("--merge", action="store_true",
                   help="LoRA: also write OUT/merged, a plain checkpoint with the adapters "
                   "folded in")
    p.add_argument("--resume", action="store_true", help="continue from OUT/latest")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="force the progress bar on/off (default: on a terminal)")
    lora_notes = {k: f"with --lora-rank: {v}" for k, v in LORA_DEFAULTS.items()
                  if FULL_DEFAULTS.get(k) != v}
    _config_flags(p.add_argument_group("training"), TrainConfig, {}, defaults=FULL_DEFAULTS,
                  notes=lora_notes)
    p.set_defaults(func=_cmd_finetune)


def _cmd_finetune(args: argparse.Namespace) -> int:
    import dataclasses

    from tinylm.core.config import TrainConfig
    from tinylm.training.finetune import finetune

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if getattr(args, f.name, None) is not None}
    result, info = finetune(args.model, args.data, args.out, lora_rank=args.lora_rank,
                            lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
                            overrides=overrides, resume=args.resume, progress=args.progress,
                            merge_to=args.merge, dropout=args.dropout)
    if result.rank != 0:
        return 0
    if result.interrupted:
        print(f"interrupted at step {result.steps}; continue with the same command and "
              f"--resume", file=sys.stderr)
        return 130
    share = 100 * info["trainable"] / max(info["parameters"], 1)
    print(f"fine-tuned ({info['mode']}) {result.steps} steps, {info['trainable']:,} trainable "
          f"of {info['parameters']:,} parameters ({share:.2f} %)")
    if result.final_val_loss is not None:
        print(f"val loss on assistant tokens {result.final_val_loss:.4f} (perplexity "
              f"{result.final_val_perplexity:.2f})")
    print(f"checkpoint: {result.checkpoint}")
    if info.get("merged"):
        print(f"merged: {info['merged']}")
    return 0


def _add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="fold a LoRA checkpoint's adapters into a plain checkpoint",
        description="Load a LoRA fine-tuning checkpoint (its adapters and the base it "
        "names), fold every adapter into its layer (W + (alpha/r)·(A·B)ᵀ) and write a plain "
        "checkpoint that every command loads without the base.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="LoRA checkpoint or run folder")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder to write")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint")
    p.set_defaults(func=_cmd_merge)


def _cmd_merge(args: argparse.Namespace) -> int:
    from tinylm.training.finetune import merge

    print(f"wrote {merge(args.model, args.out, force=args.force)}")
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw the loss curves of one or more training runs into one figure",
        description="Read RUN_DIR/metrics.jsonl of each run and draw train loss (lines), "
        "the periodic validation estimates (dots) and the final whole-split validation "
        "loss (a star) against step, one colour per run.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (tinylm train --out)")
    p.add_argument("--out", default="loss-comparison.png", metavar="FILE",
                   help="the figure to write: .png, .svg or .pdf (default: %(default)s)")
    p.add_argument("--log-scale", action="store_true", help="log-scale loss axis")
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    from tinylm.training import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out, log_scale=args.log_scale)}")
    return 0


def _add_export_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-checkpoint",
        help="a sharded checkpoint (train --strategy zero1/fsdp) -> an ordinary one",
        description="Consolidate a sharded checkpoint (written by tinylm train --strategy "
        "zero1 or fsdp: one safetensors shard per rank) into the ordinary tinylm checkpoint "
        "(model.safetensors + JSON, with the whole optimizer state) that sample, eval, "
        "serve, convert ... read. Runs in one process; no GPU or process group needed.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="the sharded checkpoint folder, or a tinylm train --out folder "
                   "(its latest/)")
    p.add_argument("--out", metavar="DIR", required=True,
                   help="the checkpoint to write; a new or empty folder")
    p.add_argument("--force", action="store_true",
                   help="replace an existing tinylm checkpoint in --out (never a folder "
                   "holding other files)")
    p.set_defaults(func=_cmd_export_checkpoint)


def _cmd_export_checkpoint(args: argparse.Namespace) -> int:
    from tinylm.commands.export import export_checkpoint

    dest = export_checkpoint(args.checkpoint, args.out, force=args.force)
    print(f"exported {args.checkpoint} -> {dest}")
    return 0
