"""The ``tinylm`` command-line tool.

Each subcommand has an ``_add_<name>(subparsers)`` that declares its flags and a
``_cmd_<name>(args) -> int`` handler that parses, builds a config and calls the
library. Only this module prints. Errors a user can cause are ``TinyLMError``s:
:func:`main` prints their one-line message and exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence

from tinylm import __version__
from tinylm.core.errors import TinyLMError

log = logging.getLogger("tinylm")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2, as for every TinyLMError) and '--' read as
    a flag's value in ``--flag=--`` (argparse before 3.12 turns it into an empty list)."""

    def _get_formatter(self):  # argparse asks the terminal's size once per flag otherwise
        return self.formatter_class(prog=self.prog, width=_help_width())

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def _get_values(self, action, arg_strings):  # type: ignore[override]
        if arg_strings == ["--"] and action.option_strings and action.nargs is None:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


@functools.lru_cache(maxsize=1)
def _help_width() -> int:
    import shutil

    return max(shutil.get_terminal_size().columns - 2, 20)  # what argparse itself uses


def _count(value: str) -> int:
    """An integer flag that also takes integral scientific notation ("1e6")."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")) or number != int(number):
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
    return int(number)


# --- subcommands ------------------------------------------------------------------------
# Each entry: (name, adder). The adder creates the subparser and sets func=<handler>.
# Keep one _add_/_cmd_ pair per command below, in the order of the list.


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="show versions, the device and native kernels, and what a model is",
        description="Print tinylm/torch versions, the device tinylm picks (cuda > mps > "
        "cpu) and whether its native kernels are active. Given a checkpoint or run folder, "
        "also its architecture, parameter count, tokenizer kind and size, training step "
        "and validation loss, and low-rank ranks.",
    )
    p.add_argument("run", nargs="?", metavar="RUN",
                   help="a checkpoint folder or training run folder to describe")
    p.add_argument("--model", metavar="DIR", help="the same as RUN")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_info)


def _native_status() -> str:
    """'active' or 'off' for the native kernels, asked through the acceleration door."""
    from tinylm import acceleration

    native = getattr(acceleration, "native", None)
    available = getattr(acceleration, "available", None) or getattr(native, "available", None)
    if native is None or not callable(available):
        return "off (no native package)"
    try:
        return "active" if available() else "off (torch's kernels)"
    except Exception:  # a broken build must not break `info`
        return "off (torch's kernels)"


def _cmd_info(args: argparse.Namespace) -> int:
    import json

    import torch

    from tinylm.core.config import resolve_device
    from tinylm.core.errors import ConfigError
    from tinylm.io.checkpoint import describe_checkpoint

    if args.run and args.model and args.run != args.model:
        raise ConfigError(f"give the folder once: RUN ({args.run}) or --model ({args.model})")
    folder = args.run or args.model
    runtime = {"tinylm": __version__, "torch": torch.__version__,
               "device": str(resolve_device()), "native_kernels": _native_status()}
    info = describe_checkpoint(folder) if folder else None
    if args.json:
        print(json.dumps({**runtime, **({"checkpoint": info} if info else {})}))
        return 0
    print(f"tinylm {runtime['tinylm']}, torch {runtime['torch']}, device {runtime['device']}, "
          f"native kernels {runtime['native_kernels']}")
    if info is not None:
        for label, text in _info_lines(info):
            print(f"{label:<13} {text}")
    return 0


def _info_lines(info: dict) -> list[tuple[str, str]]:
    m = dict(info["model"])
    sizes = [f"{m.pop(k)} {label}" for k, label in (
        ("n_layer", "layers"), ("n_head", "heads"), ("head_dim", "dims/head"),
        ("n_embd", "n_embd"), ("context_length", "context"), ("vocab_size", "vocab"))
        if k in m]
    options = ", ".join(f"{k}={v}" for k, v in sorted(m.items()))
    tok = info["tokenizer"]
    tok_text = "none (no tokenizer.json)" if tok is None else (
        f"{tok['kind']}, {tok['vocab_size']:,} tokens, end-of-text "
        f"{tok['eos'] if tok['eos'] is not None else 'none'}")
    step, val = info["step"], info["val_loss"]
    training = ", ".join(([f"step {step:,}"] if step is not None else [])
                         + ([f"val loss {val:.4f}"] if val is not None else [])) or "unknown"
    ranks = info["lowrank"]
    lowrank = "none (full-rank)" if not ranks else (
        f"{len(ranks)} layers, ranks {min(ranks.values())}..{max(ranks.values())}: "
        + ", ".join(f"{k} {v}" for k, v in list(ranks.items())[:6])
        + (", ..." if len(ranks) > 6 else ""))
    lines = [("checkpoint", info["folder"]), ("architecture", ", ".join(sizes)),
             ("options", options), ("parameters", f"{info['parameters']:,}"),
             ("tokenizer", tok_text), ("training", training), ("low-rank", lowrank)]
    if info["nonfinite"]:
        lines.append(("WARNING", f"{info['nonfinite']:,} weights are NaN or infinite"))
    return lines


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="text/JSONL/Parquet/datasets -> tokenizer.json + token shards + meta.json",
        description="Tokenize files (text, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, a "
        "datasets save_to_disk folder), folders or globs of them, standard input or a "
        "built-in corpus (default: python-docs, no download) into --out: tokenizer.json, "
        "train-NNNNN.bin and val-NNNNN.bin shards (uint16 when the vocabulary fits, else "
        "uint32) and meta.json. Each record or text file is one document; documents are "
        "joined with the end-of-text token. Streams the input in two passes with flat "
        "memory, encodes on every core, and writes atomically, so an interrupted run "
        "leaves the folder as it was.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", action="append", metavar="FILE|DIR|GLOB|-",
                     help="a text, JSONL or Parquet file, a folder of them (or a datasets "
                     "folder), a quoted glob, or - for stdin (repeatable)")
    src.add_argument("--corpus", metavar="NAME",
                     help="a built-in corpus (default: python-docs, when no --input is given)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the records' text field in JSONL/Parquet/datasets inputs; dotted "
                   "for nested fields, e.g. meta.text (default: text)")
    src.add_argument("--chat", action="append", metavar="FILE.jsonl|DIR|python-qa",
                     help="conversation records for 'tinylm finetune' (repeatable): "
                     "{messages}, {prompt, completion} or {instruction, input, output} lines, "
                     "or python-qa (the built-in instruction set); writes token shards plus "
                     "a loss mask. Use --tokenizer MODEL_DIR (default: char from the text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip records whose text field is missing, null or not a string "
                   "(counted and reported) instead of refusing the input; with --chat: bad "
                   "conversation records, named by file and line")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="fraction of the documents held out for validation, whole and "
                   "spread evenly; a single document splits by tokens (default: 0.1)")
    p.add_argument("--val-files", action="append", default=[], metavar="FILE|DIR|GLOB",
                   help="validation documents from these inputs instead (repeatable)")
    p.add_argument("--context-length", type=int, default=256, metavar="C",
                   help="context length the data is for: each split needs at least C + 1 "
                   "tokens (default: 256)")
    p.add_argument("--doc-separator", default=None, metavar="TEXT",
                   help="what goes between documents: a special token, any text, or '' for "
                   "nothing (default: the tokenizer's end-of-text token, a line break if it "
                   "has none)")
    p.add_argument("--dedup", action="store_true",
                   help="drop exact duplicate documents (by hash), counted in meta.json")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="at most N tokens per shard file (default: 100000000)")
    p.add_argument("--workers", "--threads", type=int, default=None, metavar="N",
                   dest="workers",
                   help="CPU cores to use: encoding processes; the output is the same for "
                   "any N (default: the free cores, as for --threads elsewhere, for inputs "
                   "over 16 MB, else 1)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 or binary input: stop (strict), or replace bad bytes "
                   "with U+FFFD and go on (default: strict)")
    p.add_argument("--glob", default="*", metavar="PATTERN",
                   help="files to take from an input folder (default: * = all non-hidden)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--force", action="store_true",
                   help="overwrite an output folder that holds a different dataset")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    _tokenizer_flags(p)
    p.set_defaults(func=_cmd_prepare)


def _tokenizer_flags(p: argparse.ArgumentParser) -> None:
    """prepare's flags for the tokenizer: which, its size, its special tokens."""
    p.add_argument("--tokenizer", default="char", metavar="char|bpe|PATH",
                   help="char (one token per character), bpe (byte-level BPE trained on "
                   "the input), or an existing tokenizer.json / folder with vocab.json + "
                   "merges.txt (default: char)")
    p.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                   help="BPE vocabulary size, at least 256 + special tokens (default: 4096)")
    p.add_argument("--unknown", choices=("error", "replace"), default="error",
                   help="char tokenizer, later text with unseen characters: error, or "
                   "replace them with <unk> (default: error)")
    p.add_argument("--bpe-train-mb", type=_mb_or_all, default=32.0, metavar="MB|all",
                   help="train BPE on at most this many MB taken evenly along the input, "
                   "or all of it; bounds time and memory on huge corpora (default: 32)")
    p.add_argument("--special-token", action="append", default=[], metavar="TOKEN",
                   dest="special_tokens",
                   help="add a special token after the standard ones every char/bpe "
                   "tokenizer gets (<|endoftext|>, <|system|>, <|user|>, <|assistant|>, "
                   "<|end|>) (repeatable)")
    p.add_argument("--allow-special", action="store_true",
                   help="a special token spelled in the text (e.g. <|endoftext|>) becomes "
                   "that token; without it, it is ordinary text like any other")


def _mb_or_all(value: str) -> float | None:
    if value == "all":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of MB or 'all', got {value!r}") from None


def _cmd_prepare(args: argparse.Namespace) -> int:
    import time

    from tinylm.data.prepare import prepare
    from tinylm.data.readers import display_path

    if args.chat:
        return _cmd_prepare_chat(args)
    start = time.perf_counter()
    data = prepare(
        args.out, args.input, corpus=args.corpus, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, val_fraction=args.val_fraction, val_files=args.val_files,
        context_length=args.context_length, unknown=args.unknown, errors=args.errors,
        special_tokens=args.special_tokens, glob=args.glob,
        force=args.force,
        bpe_train_mb=args.bpe_train_mb, progress=False if args.no_progress else None,
        text_field=args.text_field, skip_bad=args.skip_bad, doc_separator=args.doc_separator,
        dedup=args.dedup, shard_tokens=args.shard_tokens, workers=args.workers,
        allow_special=args.allow_special,
    )
    seconds = time.perf_counter() - start
    meta = data.meta
    mb = meta["input_bytes"] / 1e6
    docs = meta["documents"]
    extra = "".join(f", {n:,} {what}" for what, n in (
        ("duplicates removed", docs["duplicates_removed"]),
        ("bad records skipped", docs["skipped_records"])) if n)
    shards = sum(len(v) for v in meta["shards"].values())
    print(f"prepared {display_path(data.dir)}: {meta['train_tokens']:,} train + "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}, {shards} shard(s)) from "
          f"{docs['train']:,} + {docs['val']:,} documents{extra}, {data.tokenizer.kind} "
          f"tokenizer with {data.vocab_size:,} tokens, from {meta['source']} ({mb:.2f} MB) in "
          f"{seconds:.1f} s ({mb / max(seconds, 1e-9):.1f} MB/s, {meta['workers']} worker(s))")
    return 0


def _cmd_prepare_chat(args: argparse.Namespace) -> int:
    from tinylm.data.chatdata import prepare_chat

    data = prepare_chat(args.out, args.chat, tokenizer=args.tokenizer,
                        context_length=args.context_length, val_fraction=args.val_fraction,
                        skip_bad=args.skip_bad, force=args.force)
    chat = data.meta["chat"]
    counted = int(data.train_mask.sum())
    skipped = f", skipped {chat['skipped']} bad record(s)" if chat["skipped"] else ""
    print(f"prepared {data.dir}: {chat['conversations']['train']:,} train + "
          f"{chat['conversations']['val']:,} val conversations in rows of "
          f"{chat['row_length']} tokens, {len(data.train):,} train tokens of which "
          f"{counted:,} count in the loss, {data.tokenizer.kind} tokenizer with "
          f"{data.tokenizer.vocab_size:,} tokens{skipped}")
    return 0


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    from tinylm.core.config import TrainConfig
    from tinylm.training.finetune import FINETUNE_DROPOUT, FULL_DEFAULTS, LORA_DEFAULTS

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
    p.add_argument("--lora-targets", default="qkv,out,up,down", metavar="LIST",
                   help="layers to adapt, from qkv,out,up,down (default: all four)")
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
    _config_flags(p.add_argument_group("training"), TrainConfig, {})
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


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a fine-tuned model in the terminal (or answer one --prompt)",
        description="An interactive chat: the history is kept within the model's context "
        "(the oldest turns are dropped, with a note), answers stream as they are generated. "
        "Commands: /reset, /system TEXT, /temperature X, /help; Ctrl-D quits. With --prompt, "
        "answer one message and exit.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint or run folder")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="answer this message and exit (repeatable: each is answered as a "
                   "new conversation, printed after its question)")
    p.add_argument("--system", metavar="TEXT", help="a system message (default: none)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="sampling temperature, 0 = greedy (default: 0.7)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens")
    p.add_argument("--top-p", type=float, default=0.9, metavar="P",
                   help="nucleus sampling mass (default: 0.9)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="longest answer in tokens (default: 200)")
    p.add_argument("--seed", type=int, metavar="N", help="seed for reproducible answers")
    _device_flag(p)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    from tinylm.use.chatsession import open_session, run_terminal

    session = open_session(args.model, system=args.system, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens, seed=args.seed,
                           device=args.device)
    if args.prompt is None:
        return run_terminal(session, sys.stdin, sys.stdout)
    for prompt in args.prompt:
        session.reset()
        if len(args.prompt) > 1:
            sys.stdout.write(f"Q: {prompt}\nA: ")
        for piece in session.reply(prompt, note=lambda s: print(s, file=sys.stderr)):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _add_compress(sub: argparse._SubParsersAction) -> None:
    from tinylm.layers.lowrank import DEFAULT_LAYERS

    p = sub.add_parser(
        "compress",
        help="low-rank (truncated SVD) compression of a checkpoint, with a report",
        description="Replace chosen Linear layers W (E->F) by two thin ones W1 (E, r) and "
        "W2 (r, F), x·W ≈ x·W1·W2, by truncated SVD (the best rank-r approximation). "
        "Pick the ranks with --rank, --energy or --params-fraction; write a checkpoint "
        "that every command loads without flags and print a per-layer report. With "
        "--data also the validation loss before and after (and after --finetune STEPS). "
        "--sweep measures loss and forward speed over several parameter fractions.",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint (or training run) folder to compress")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the compressed checkpoint (not needed with --sweep)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--rank", type=int, metavar="R", help="the same rank R in every layer")
    how.add_argument("--energy", type=float, metavar="F",
                     help="per layer, the smallest rank keeping a share F in (0, 1] of Σσ²")
    how.add_argument("--params-fraction", type=float, metavar="P",
                     help="global budget: the whole model keeps at most a share P in (0, 1] "
                     "of its parameters; ranks follow singular-value energy across layers")
    how.add_argument("--sweep", action="store_true",
                     help="for each of --fractions, validation loss and forward tokens/s "
                     "(needs --data; --plot FILE.png draws loss vs parameters kept)")
    p.add_argument("--layers", default=",".join(DEFAULT_LAYERS), metavar="NAMES",
                   help="comma-separated layer names or suffixes to factorise (default: "
                   "%(default)s)")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data folder ('tinylm prepare --out'): report validation "
                   "loss and perplexity before and after")
    p.add_argument("--eval-windows", type=int, metavar="N",
                   help="evaluate on at most N windows of the validation split (default: all)")
    p.add_argument("--finetune", type=int, default=0, metavar="STEPS",
                   help="continue training the factorised model for STEPS steps on --data")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="peak learning rate of --finetune (default: the peak lr the model "
                   "was trained with, from its config.json, else 1e-3)")
    p.add_argument("--batch-size", type=int, default=32, metavar="B",
                   help="sequences per step of --finetune (default: 32)")
    p.add_argument("--fractions", default="0.9,0.75,0.5,0.35,0.25", metavar="P,P,...",
                   help="parameter fractions of --sweep (default: 0.9,0.75,0.5,0.35,0.25)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="with --sweep: write the loss/speed plot (.png, .svg or .pdf)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint in --out (never a run folder or a "
                   "folder with other files)")
    _device_flag(p)
    p.set_defaults(func=_cmd_compress)


def _parse_fractions(text: str) -> list[float]:
    from tinylm.core.errors import ConfigError

    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--fractions must be comma-separated numbers in (0, 1], got "
                          f"{text!r}; e.g. --fractions 0.9,0.5,0.25") from exc
    bad = [v for v in values if not 0.0 < v <= 1.0]
    if not values or bad:
        raise ConfigError(f"--fractions must be numbers in (0, 1], got {text!r}; e.g. "
                          f"--fractions 0.9,0.5,0.25")
    return values


def _check_compress_flags(args: argparse.Namespace) -> list[str]:
    """Flag combinations of compress (before anything is loaded); returns the layers."""
    from tinylm.core.errors import ConfigError

    mode = (args.rank, args.energy, args.params_fraction)
    if args.sweep:
        if not args.data:
            raise ConfigError("--sweep needs --data DIR to measure the validation loss; pass "
                              "a folder made by 'tinylm prepare'")
    elif all(v is None for v in mode):
        raise ConfigError("choose how much to keep: --rank R, --energy F, --params-fraction P "
                          "(or --sweep)")
    elif not args.out:
        raise ConfigError("--out DIR is missing: where should the compressed checkpoint go?")
    if args.plot and not args.sweep:
        raise ConfigError("--plot draws the --sweep figure; add --sweep or drop --plot")
    if args.finetune < 0 or (args.finetune and not args.data):
        raise ConfigError(f"--finetune {args.finetune} needs a number of steps >= 1 and "
                          f"--data DIR to train on")
    if args.eval_windows is not None and args.eval_windows < 1:
        raise ConfigError(f"--eval-windows must be >= 1, got {args.eval_windows}")
    layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    if not layers:
        raise ConfigError(f"--layers names no layer ({args.layers!r}); e.g. --layers "
                          f"attn.qkv,ffn.up")
    return layers


def _cmd_compress(args: argparse.Namespace) -> int:
    from tinylm.commands.compress import compress_checkpoint, sweep_checkpoint
    from tinylm.layers.lowrank import format_report, format_sweep

    layers = _check_compress_flags(args)
    common = {"layers": layers, "eval_windows": args.eval_windows, "device": args.device}
    if args.sweep:
        rows, plot = sweep_checkpoint(args.model, args.data, _parse_fractions(args.fractions),
                                      plot=args.plot, **common)
        print(format_sweep(rows))
        if plot is not None:
            print(f"plot: {plot}")
        return 0
    mode = {k: v for k, v in (("rank", args.rank), ("energy", args.energy),
                              ("params_fraction", args.params_fraction)) if v is not None}
    r = compress_checkpoint(args.model, args.out, mode=mode, data_dir=args.data,
                            finetune_steps=args.finetune, lr=args.lr,
                            batch_size=args.batch_size, force=args.force, **common)
    print(format_report(r.report))
    if r.before is not None and r.after is not None:
        print(f"val loss: {r.before.loss:.4f} -> {r.after.loss:.4f} "
              f"(perplexity {r.before.perplexity:.3f} -> {r.after.perplexity:.3f}, "
              f"{100 * (r.after.loss / r.before.loss - 1):+.1f} %)")
    if r.tuned is not None and r.before is not None:
        print(f"after fine-tuning {r.finetune_steps} steps: val loss {r.tuned.loss:.4f} "
              f"(perplexity {r.tuned.perplexity:.3f}, "
              f"{100 * (r.tuned.loss / r.before.loss - 1):+.1f} % vs the uncompressed model)")
    print(f"file size: {r.bytes_in / 1e6:.2f} MB -> {r.bytes_out / 1e6:.2f} MB "
          f"({100 * (1 - r.bytes_out / r.bytes_in):.1f} % smaller)")
    print(f"wrote {r.dest}")
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="int8 weights (weight-only, symmetric) for CPU inference, with a report",
        description="Store the chosen Linear layers' weights as int8 integers times float32 "
        "scales, one scale per output channel (default) or per --group-size G input "
        "features; activations stay float32. Writes a checkpoint that every command loads "
        "without flags ('convert --to-hf' exports it dequantized) and prints per layer the "
        "max and mean relative error and the bytes before and after; with --data also the "
        "validation loss before and after.",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint (or training run) folder to quantize")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for the quantized checkpoint (new or empty; an existing "
                   "checkpoint only with --force)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint at --out (never a run folder or a "
                   "folder with other files)")
    p.add_argument("--bits", type=int, default=8, metavar="B",
                   help="bits per weight, 2-8, stored in int8 (default: 8)")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="one scale per G consecutive input features (default: one per "
                   "output channel)")
    p.add_argument("--layers", default=None, metavar="NAMES",
                   help="comma-separated layer names or suffixes, e.g. attn.qkv,ffn.up "
                   "(default: every Linear layer of the blocks)")
    p.add_argument("--include-head", action="store_true",
                   help="quantize the LM head too (an untied one; a tied head is the "
                   "token embedding and stays float32)")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data folder ('tinylm prepare --out'): report validation "
                   "loss and perplexity before and after")
    p.add_argument("--eval-windows", type=int, metavar="N",
                   help="evaluate on at most N windows of the validation split (default: all)")
    _threads_flag(p)
    p.set_defaults(func=_cmd_quantize)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from tinylm.core.errors import ConfigError
    from tinylm.layers.quantize import format_report, quantize_checkpoint

    layers = None
    if args.layers is not None:
        layers = [name.strip() for name in args.layers.split(",") if name.strip()]
        if not layers:
            raise ConfigError(f"--layers names no layer ({args.layers!r}); e.g. --layers "
                              f"attn.qkv,ffn.up")
    report, dest = quantize_checkpoint(
        args.model, args.out, bits=args.bits, group_size=args.group_size, layers=layers,
        include_head=args.include_head, data_dir=args.data, eval_windows=args.eval_windows,
        force=args.force)
    print(format_report(report))
    print(f"wrote {dest}")
    return 0


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


def _config_flags(group: argparse._ArgumentGroup, cls: type, helps: dict[str, str | None]
                  ) -> None:
    """One flag per dataclass field (--n-layer for n_layer); default None = not given."""
    import dataclasses

    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(cls):
        help_text = helps.get(f.name, f.metadata.get("help", ""))
        if help_text is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" | None", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            help_text = f"{help_text} (default: {default})"
        optional = "None" in str(f.type) and kind != "str"
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif optional:
            group.add_argument(flag, type=_or_off(types[kind], zero_is_off=f.name ==
                                                   "time_budget"),
                               default=None, metavar=kind.upper(),
                               help=f"{help_text}; 'none' switches it off"
                               + (" (so does 0)" if f.name == "time_budget" else ""))
        else:
            group.add_argument(flag, type=types[kind], default=None, metavar=kind.upper(),
                               help=help_text)


_OFF = object()  # a flag given as "none": switch off what a config file or saved run set


def _or_off(kind: type, zero_is_off: bool = False) -> Callable[[str], object]:
    def parse(text: str) -> object:
        if text.strip().lower() in ("none", "off"):
            return _OFF
        value = kind(text)
        return _OFF if zero_is_off and value == 0 else value

    parse.__name__ = kind.__name__
    return parse


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


def _resume_arg(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"expected nothing or 'auto', got {text!r}")
    return text


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
                   help="the figure to write: .png, .svg or .pdf (default: "
                   "loss-comparison.png)")
    p.add_argument("--log-scale", action="store_true", help="log-scale loss axis")
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    from tinylm.training import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out, log_scale=args.log_scale)}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="mean loss, perplexity and bits per byte over a split or a text file",
        description="Score every next-token target of a prepared split (--data) or a text "
        "file (--text) exactly once: non-overlapping windows of the model's context "
        "length, or sliding windows with --stride. Bits per byte divide the total loss "
        "in bits by the UTF-8 size of the text, so they compare across tokenizers.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR", help="a folder written by 'tinylm prepare'")
    src.add_argument("--text", metavar="FILE", help="a UTF-8 text file")
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint or run folder")
    p.add_argument("--split", choices=("val", "train"), default="val",
                   help="which split of --data (default: val)")
    p.add_argument("--stride", type=_count, metavar="N",
                   help="sliding-window step, 1..C; each scored token then sees at least "
                   "C - N tokens of context (default: C, non-overlapping windows)")
    p.add_argument("--batch-size", type=_count, default=16, metavar="B",
                   help="windows per forward pass (default: 16)")
    p.add_argument("--max-windows", type=_count, metavar="N",
                   help="stop after N windows: a quick estimate instead of the exact value")
    _device_flag(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: loss, perplexity, bits_per_byte, tokens")
    _allow_nonfinite_flag(p)
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from tinylm.core.config import resolve_device
    from tinylm.core.errors import CheckpointError, DataError
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.use.evaluation import evaluate_split, evaluate_text

    device = resolve_device(args.device)
    model, tokenizer = load_checkpoint(args.model, device, allow_nonfinite=args.allow_nonfinite)
    options = {"stride": args.stride, "batch_size": args.batch_size,
               "max_windows": args.max_windows}
    if args.text is not None:
        if tokenizer is None:
            raise CheckpointError(f"{args.model} has no tokenizer.json, so --text cannot be "
                                  f"encoded; evaluate a prepared split with --data instead")
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise DataError(f"text file {args.text} does not exist; pass a UTF-8 text file "
                            f"to --text") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {args.text} as UTF-8 text ({exc}); convert it to "
                            f"UTF-8") from exc
        result = evaluate_text(model, tokenizer, text, **options)
        what = f"{args.text}"
    else:
        result = evaluate_split(model, tokenizer, args.data, args.split, **options)
        what = f"{args.data} ({args.split} split)"
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    bpb = "unknown" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}"
    print(f"model          {args.model}")
    print(f"evaluated on   {what}: {result.tokens:,} tokens")
    print(f"loss           {result.loss:.4f} nats/token")
    print(f"perplexity     {result.perplexity:.3f}")
    print(f"bits per byte  {bpb}")
    return 0


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="next-token table per position, attention maps (PNG/HTML), embedding neighbours",
        description="For each position t of the prompt, show the token at t and the top-k "
        "candidates for the NEXT token with their probabilities (row t is the distribution "
        "after tokens 0..t, as in the study note's 'This is a pen .' table). Optionally draw "
        "every attention map (layers x heads) as a PNG, write an offline HTML explorer, "
        "or list the tokens nearest to one token in embedding space.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint or run folder")
    p.add_argument("--prompt", metavar="TEXT",
                   help="the text to explain (at most the model's context length in tokens)")
    p.add_argument("--top-k", type=int, default=5, metavar="K",
                   help="candidates per row (default: 5)")
    p.add_argument("--json", action="store_true",
                   help="print JSON: a list of rows {token, id, position, candidates: "
                   "[{token, id, prob}]} (with --neighbours, their list too)")
    p.add_argument("--attention", metavar="FILE.png",
                   help="draw all attention maps as a grid of heatmaps, in the format the "
                   "suffix names: .png, .jpg, .svg or .pdf (needs matplotlib)")
    p.add_argument("--html", metavar="FILE.html",
                   help="write the explorer: one offline page that walks every equation of "
                   "attention on the prompt (steps, heads, maps, logit lens, ablation, low "
                   "rank, next-token table)")
    p.add_argument("--layer", type=int, default=0, metavar="L",
                   help="the layer the page opens on (default: 0)")
    p.add_argument("--head", type=int, default=0, metavar="H",
                   help="the head the page opens on (default: 0)")
    p.add_argument("--neighbours", metavar="TOKEN",
                   help="list the tokens nearest to TOKEN by cosine similarity of embeddings")
    p.add_argument("--count", type=int, default=10, metavar="N",
                   help="how many neighbours (default: 10)")
    _device_flag(p)
    p.set_defaults(func=_cmd_explain)


def _cmd_explain(args: argparse.Namespace) -> int:
    import json

    from tinylm.use import inspection
    from tinylm.use.explorer import run_explain

    report = run_explain(args.model, prompt=args.prompt, top_k=args.top_k,
                         attention=args.attention, html_path=args.html, layer=args.layer,
                         head=args.head, neighbours=args.neighbours, count=args.count,
                         device=args.device)
    for path in report.written:
        log.info("wrote %s", path)
    out: dict[str, object] = {}
    if report.explanation is not None:
        out["rows"] = report.explanation.to_json()
        if not args.json:
            print(inspection.format_table(report.explanation))
    if report.neighbours is not None:
        out["neighbours"] = [{"token": n.token, "id": n.id, "similarity": n.similarity}
                             for n in report.neighbours]
        if not args.json:
            if report.explanation is not None:
                print()
            print(inspection.format_neighbours(args.neighbours, report.neighbours))
    if args.json:
        print(json.dumps(out if len(out) > 1 else next(iter(out.values())), ensure_ascii=False,
                         indent=1))
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="Hugging Face GPT-2/Llama/Qwen2/Mistral folder <-> tinylm checkpoint",
        description="--from-hf HF_DIR --out DIR: a Hugging Face GPT-2, Llama, Qwen2 or "
        "Mistral folder on disk (config.json, model.safetensors or pytorch_model.bin, "
        "tokenizer.json when present; the family comes from config.json) -> a tinylm "
        "checkpoint. --model DIR --to-hf HF_DIR: a tinylm checkpoint -> a folder that "
        "transformers' AutoModelForCausalLM and AutoTokenizer load (GPT-2, Llama or Qwen2, "
        "from the architecture). Nothing is downloaded.",
    )
    p.add_argument("--from-hf", metavar="HF_DIR",
                   help="a Hugging Face GPT-2/Llama/Qwen2/Mistral folder to import")
    p.add_argument("--out", metavar="DIR",
                   help="the tinylm checkpoint to write (--from-hf); a new or empty folder")
    p.add_argument("--force", action="store_true",
                   help="--from-hf: replace an existing tinylm checkpoint in --out (never a "
                   "folder holding other files)")
    p.add_argument("--model", metavar="DIR", help="a tinylm checkpoint to export")
    p.add_argument("--to-hf", metavar="HF_DIR",
                   help="the Hugging Face folder to write (--model); must not exist or be empty")
    p.add_argument("--weights-only", action="store_true",
                   help="--to-hf: export the model without its tokenizer (needed for char "
                   "tokenizers, which have no GPT-2 equivalent)")
    p.set_defaults(func=_cmd_convert)


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


def _cmd_convert(args: argparse.Namespace) -> int:
    from tinylm.core.errors import ConfigError
    from tinylm.io.checkpoint import check_target, load_checkpoint, save_checkpoint
    from tinylm.io.hf import export_family, read_hf_folder, write_hf_folder

    importing = args.from_hf is not None or args.out is not None
    exporting = args.model is not None or args.to_hf is not None
    if importing == exporting or (importing and not (args.from_hf and args.out)) or (
            exporting and not (args.model and args.to_hf)):
        raise ConfigError("use either --from-hf HF_DIR --out DIR (import) or --model DIR "
                          "--to-hf HF_DIR (export)")
    if importing:
        if args.weights_only:
            raise ConfigError("--weights-only applies to --to-hf only")
        check_target(args.out, force=args.force)
        model, tokenizer = read_hf_folder(args.from_hf)
        save_checkpoint(args.out, model, tokenizer)
        tok = f"{tokenizer.kind} tokenizer" if tokenizer is not None else "no tokenizer files"
        print(f"converted {args.from_hf} -> {args.out} ({model.num_parameters():,} parameters, "
              f"{tok})")
    else:
        model, tokenizer = load_checkpoint(args.model)
        write_hf_folder(model, tokenizer, args.to_hf, weights_only=args.weights_only)
        what = "weights only" if args.weights_only else f"{tokenizer.kind} tokenizer"
        family = export_family(model.config).architecture
        print(f"exported {args.model} -> {args.to_hf} (Hugging Face {family}, {what})")
    return 0


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a checkpoint (KV cache, temperature/top-k/top-p, streaming)",
        description="Continue a prompt with a trained model. The prompt goes through the "
        "model in one pass, then one token per step through the KV cache; text is "
        "streamed to stdout as it becomes decodable (whole characters only). Without a "
        "prompt, generation starts from the end-of-text token. Past the context length "
        "the window slides. A sample ends at the end-of-text token, a --stop string, or "
        "after --max-new-tokens.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="read the prompt from a UTF-8 file ('-' = stdin), used as is")
    p.add_argument("--max-new-tokens", type=_count, default=200, metavar="N",
                   help="tokens to generate per sample (default: 200)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="0 = greedy; <1 sharper, >1 more random (default: 1.0)")
    p.add_argument("--top-k", type=_count, metavar="K",
                   help="sample among the K most likely (default: all)")
    p.add_argument("--top-p", type=float, metavar="P",
                   help="sample among the smallest set of tokens whose probability reaches P "
                   "(0 < P <= 1) (default: all)")
    p.add_argument("--seed", type=_count, metavar="S",
                   help="random seed in [0, 2^63 - 1]: same seed, same text (default: random)")
    p.add_argument("--num-samples", type=_count, default=1, metavar="N",
                   help="samples generated together in one batch, printed one after another "
                   "(default: 1)")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a sample before this string (repeatable; escapes like \\n work)")
    p.add_argument("--no-echo", action="store_true", help="print only the continuation")
    p.add_argument("--allow-special", action="store_true",
                   help="a special token spelled in the prompt (e.g. <|endoftext|>) becomes "
                   "that token; without it, it is ordinary text")
    _allow_nonfinite_flag(p)
    _device_flag(p)
    p.set_defaults(func=_cmd_sample)


def _allow_nonfinite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load a model whose weights hold NaN or inf (refused otherwise)")


def _device_flag(p: argparse.ArgumentParser) -> None:
    """--device and --threads, with the same default and help in every command that
    computes on a model."""
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps (default: auto)")
    _threads_flag(p)


def _threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads N: torch's CPU threads for the whole command, applied by :func:`main`."""
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads for torch's kernels (default: the free cores: "
                   "OMP_NUM_THREADS if set, else the cores the current load leaves idle)")
    p.set_defaults(apply_threads=True)


#: The most prompt text read from --prompt-file (a prompt uses at most its last C - 1
#: tokens; this only stops /dev/zero or a huge file from filling memory).
PROMPT_MAX_BYTES = 16 * 1024 * 1024


def _read_prompt(args: argparse.Namespace) -> str:
    from pathlib import Path

    from tinylm.core.errors import DataError

    if args.prompt_file is None:
        return args.prompt or ""
    name = "stdin" if args.prompt_file == "-" else f"prompt file {args.prompt_file}"
    try:
        if args.prompt_file == "-":
            if sys.stdin is None or sys.stdin.isatty():
                raise DataError("--prompt-file - reads the prompt from stdin, but stdin is a "
                                "terminal; pipe text in or use --prompt")
            raw = getattr(sys.stdin, "buffer", None)  # text-only streams (tests) have none
            data = raw.read(PROMPT_MAX_BYTES + 1) if raw is not None else \
                sys.stdin.read(PROMPT_MAX_BYTES + 1).encode("utf-8", "surrogateescape")
        else:
            with open(Path(args.prompt_file), "rb") as f:
                data = f.read(PROMPT_MAX_BYTES + 1)
    except FileNotFoundError as exc:
        raise DataError(f"{name} does not exist; pass a UTF-8 text file to --prompt-file") \
            from exc
    except OSError as exc:
        raise DataError(f"cannot read {name} ({exc.strerror or exc}); pass a UTF-8 text file "
                        f"to --prompt-file") from exc
    if len(data) > PROMPT_MAX_BYTES:
        raise DataError(f"{name} is larger than {PROMPT_MAX_BYTES // 2**20} MB; a prompt uses "
                        f"only its last context-length tokens, so pass the end of the text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        f"convert it to UTF-8") from exc


def _cmd_sample(args: argparse.Namespace) -> int:
    import re

    from tinylm.core.config import resolve_device
    from tinylm.core.errors import CheckpointError, ConfigError
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.use.sampling import SamplingConfig, check_generation, generate_text

    SamplingConfig(args.temperature, args.top_k, args.top_p)  # check flags before loading
    device = resolve_device(args.device)
    check_generation(args.max_new_tokens, args.num_samples, args.seed, device=device)
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    stop = [re.sub(r"\\([ntr\\])", lambda m: escapes[m.group(1)], s) for s in args.stop]
    if any(not s for s in stop):
        raise ConfigError("--stop needs a non-empty string")
    prompt = _read_prompt(args)
    model, tokenizer = load_checkpoint(args.model, device,
                                       allow_nonfinite=args.allow_nonfinite)
    check_generation(args.max_new_tokens, args.num_samples, args.seed,
                     prompt_tokens=len(prompt.encode("utf-8")) + 1, device=device,
                     model_config=model.config)
    if tokenizer is None:
        raise CheckpointError(f"{args.model} has no tokenizer.json; sample needs the model's "
                              f"tokenizer to turn text into ids")
    pieces = generate_text(model, tokenizer, prompt, args.max_new_tokens,
                           num_samples=args.num_samples, stop=stop,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, allow_special=args.allow_special)
    echo = "" if args.no_echo else prompt
    out = sys.stdout
    if args.num_samples == 1:
        out.write(echo)
        out.flush()
        for _, piece in pieces:
            out.write(piece)
            out.flush()
        out.write("\n")
        return 0
    texts = [""] * args.num_samples
    for i, piece in pieces:
        texts[i] += piece
    for i, text in enumerate(texts):
        if i:
            out.write("\n")
        out.write(f"--- sample {i + 1} ---\n{echo}{text}\n")
    out.flush()
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching) and a web page",
        description="Serve a checkpoint over HTTP: POST /v1/completions, /v1/chat/completions "
                    "(models with a chat template), /v1/explain; GET /v1/models, /health, "
                    "/metrics; the playground and explorer page at /. Concurrent requests "
                    "decode together in one batched step. Needs the [serve] extra.")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1; any other needs an API key)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $TINYLM_API_KEY; "
                        "none on 127.0.0.1)")
    p.add_argument("--max-batch", type=_positive, default=16, metavar="N",
                   help="requests decoded together in one step (default: 16)")
    p.add_argument("--max-queue", type=_positive, default=64, metavar="N",
                   help="requests waiting beyond the batch; more get 429 (default: 64)")
    p.add_argument("--max-tokens", type=_positive, default=256, metavar="N",
                   help="the largest max_tokens a request may ask for (default: 256)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="per-request time limit; generation ends there (default: 60)")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="torch threads of the decoding loop (default: torch's own choice)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the folder's name)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from tinylm.core.errors import ConfigError
    from tinylm.serve import serve

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    kwargs = {} if args.model_name is None else {"model_name": args.model_name}
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
          max_batch=args.max_batch, max_queue=args.max_queue, max_tokens=args.max_tokens,
          timeout=args.timeout, threads=args.threads, **kwargs)
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_prepare,
    _add_train,
    _add_finetune,
    _add_merge,
    _add_chat,
    _add_plot,
    _add_sample,
    _add_eval,
    _add_explain,
    _add_compress,
    _add_quantize,
    _add_convert,
    _add_export_checkpoint,
    _add_serve,
    _add_info,
]


# --- entry point ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tinylm",
        description="GPT-style language models from the attention equations up.",
        epilog="Run 'tinylm COMMAND --help' for the flags of one command.",
    )
    parser.add_argument("--version", action="version", version=f"tinylm {__version__}")
    _verbosity_flags(parser, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    for command in sub.choices.values():  # -v/-q also after the command
        _verbosity_flags(command, argparse.SUPPRESS)
    parser.commands = dict(sub.choices)
    return parser


def _verbosity_flags(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log tinylm's debug details")
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="log warnings and errors only")


#: Libraries whose debug/info lines are noise on tinylm's stderr, even with -v.
_QUIET_LOGGERS = ("matplotlib", "PIL", "filelock", "urllib3", "httpx", "httpcore",
                  "asyncio", "fsspec", "torch", "h5py")


def _configure_logging(verbose: bool, quiet: bool) -> None:
    """tinylm's own lines at INFO (DEBUG with -v, WARNING with -q); others at WARNING."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    for name, want in (("tinylm", level), *((n, logging.WARNING) for n in _QUIET_LOGGERS)):
        logger = logging.getLogger(name)
        if logger.level != want:  # setLevel clears every logger's cache
            logger.setLevel(want)


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    """One parser per process (parsing leaves it unchanged; building costs ~30 ms)."""
    return build_parser()


def _run_command(args: argparse.Namespace) -> int:
    """The handler, under ``--threads`` (or the free cores) for commands that compute;
    train and finetune take it from their config layers, serve for its decoding loop."""
    if not getattr(args, "apply_threads", False):
        return int(args.func(args) or 0)
    from tinylm.training import command_threads

    with command_threads(args.threads):
        return int(args.func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _cached_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command's parser, so the hint points at its --help
            parser.commands.get(args.command, parser).error(
                f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a bad flag (one line, status 2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(getattr(args, "verbose", False), getattr(args, "quiet", False))
    for stream in (sys.stdout, sys.stderr):  # a path with undecodable bytes must print
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", "") == "strict":
            stream.reconfigure(errors="backslashreplace")
    try:
        return _run_command(args)
    except TinyLMError as exc:
        message = " ".join(str(exc).split())  # one line, whatever a message quoted
        print(f"tinylm {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tinylm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tinylm sample ... | head`
        return 0
