"""The ``tinylm`` command-line tool.

Each subcommand has an ``_add_<name>(subparsers)`` that declares its flags and a
``_cmd_<name>(args) -> int`` handler that parses, builds a config and calls the
library. Only this module prints. Errors a user can cause are ``TinyLMError``s:
:func:`main` prints their one-line message and exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from tinylm import __version__
from tinylm.errors import TinyLMError

log = logging.getLogger("tinylm")


# --- subcommands ------------------------------------------------------------------------
# Each entry: (name, adder). The adder creates the subparser and sets func=<handler>.
# Keep one _add_/_cmd_ pair per command below, in the order of the list.


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="show versions, the device tinylm would use, and a model's shape",
        description="Print tinylm/torch versions and the device tinylm picks "
        "(cuda > mps > cpu). With --model DIR, also the checkpoint's config and "
        "parameter count.",
    )
    p.add_argument("--model", metavar="DIR", help="a checkpoint folder to describe")
    p.set_defaults(func=_cmd_info)


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from tinylm.config import resolve_device

    print(f"tinylm {__version__}, torch {torch.__version__}, device {resolve_device()}")
    if args.model:
        from tinylm.checkpoint import load_checkpoint

        model, _tok = load_checkpoint(args.model)
        print(model.config.to_json())
        print(f"parameters: {model.num_parameters():,}")
    return 0


def _add_compress(sub: argparse._SubParsersAction) -> None:
    from tinylm.lowrank import DEFAULT_LAYERS

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
    p.add_argument("--lr", type=float, default=3e-4, metavar="LR",
                   help="peak learning rate of --finetune (default: 3e-4)")
    p.add_argument("--batch-size", type=int, default=32, metavar="B",
                   help="sequences per step of --finetune (default: 32)")
    p.add_argument("--fractions", default="0.9,0.75,0.5,0.35,0.25", metavar="P,P,...",
                   help="parameter fractions of --sweep (default: 0.9,0.75,0.5,0.35,0.25)")
    p.add_argument("--plot", metavar="FILE.png", help="with --sweep: write the loss/speed plot")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    p.set_defaults(func=_cmd_compress)


def _parse_fractions(text: str) -> list[float]:
    from tinylm.errors import ConfigError

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


def _cmd_compress(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from tinylm.checkpoint import load_checkpoint, resolve_checkpoint_dir, save_checkpoint
    from tinylm.config import resolve_device
    from tinylm.errors import ConfigError
    from tinylm.lowrank import compress, format_report, format_sweep, plot_sweep, sweep

    mode = {"rank": args.rank, "energy": args.energy, "params_fraction": args.params_fraction}
    if args.sweep:
        if not args.data:
            raise ConfigError("--sweep needs --data DIR to measure the validation loss; pass "
                              "a folder made by 'tinylm prepare'")
        fractions = _parse_fractions(args.fractions)
    elif all(v is None for v in mode.values()):
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

    device = resolve_device(args.device)
    model, tokenizer = load_checkpoint(args.model, device=device)
    data = None
    if args.data:
        from tinylm.data import load_prepared

        data = load_prepared(args.data)

    def val_loss(m):
        from tinylm.evaluation import evaluate

        return evaluate(m, data.val, max_windows=args.eval_windows)

    if args.sweep:
        rows = sweep(model, fractions, lambda m: val_loss(m).loss, layers=layers,
                     progress=lambda r: log.info("params %.3f kept: val loss %.4f, %.0f tokens/s",
                                                 r.params_fraction, r.loss, r.tokens_per_s))
        print(format_sweep(rows))
        if args.plot:
            print(f"plot: {plot_sweep(rows, args.plot)}")
        return 0

    before = val_loss(model) if data is not None else None
    report = compress(model, layers=layers, **mode)
    print(format_report(report))
    if data is not None:
        after = val_loss(model)
        print(f"val loss: {before.loss:.4f} -> {after.loss:.4f} "
              f"(perplexity {before.perplexity:.3f} -> {after.perplexity:.3f}, "
              f"{100 * (after.loss / before.loss - 1):+.1f} %)")
    if args.finetune:
        from tinylm.config import TrainConfig
        from tinylm.training import train

        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        train_config = TrainConfig(
            max_steps=args.finetune, lr=args.lr, batch_size=args.batch_size,
            warmup_steps=min(20, args.finetune // 10), eval_every=args.finetune,
            save_every=args.finetune, device=str(device))
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.finetune-", dir=out.parent) as run:
            result = train(model.config, train_config, args.data, run, model=model)
        model = getattr(result, "model", None) or model
        tuned = val_loss(model)
        print(f"after fine-tuning {args.finetune} steps: val loss {tuned.loss:.4f} "
              f"(perplexity {tuned.perplexity:.3f}, {100 * (tuned.loss / before.loss - 1):+.1f} % "
              f"vs the uncompressed model)")
    dest = save_checkpoint(args.out, model, tokenizer,
                           extra_config={"compress": {"source": str(args.model),
                                                      "mode": report.mode,
                                                      "finetune_steps": args.finetune}})
    size_in = (resolve_checkpoint_dir(args.model) / "model.safetensors").stat().st_size
    size_out = (dest / "model.safetensors").stat().st_size
    print(f"file size: {size_in / 1e6:.2f} MB -> {size_out / 1e6:.2f} MB "
          f"({100 * (1 - size_out / size_in):.1f} % smaller)")
    print(f"wrote {dest}")
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_info,
    _add_compress,
]


# --- entry point ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinylm",
        description="GPT-style language models from the attention equations up.",
        epilog="Run 'tinylm COMMAND --help' for the flags of one command.",
    )
    parser.add_argument("--version", action="version", version=f"tinylm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except TinyLMError as exc:
        print(f"tinylm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tinylm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tinylm sample ... | head`
        return 0
