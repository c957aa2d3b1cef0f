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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_info,
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
