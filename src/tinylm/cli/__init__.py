"""The ``tinylm`` command-line tool.

Each subcommand has an ``_add_<name>(subparsers)`` that declares its flags and a
``_cmd_<name>(args) -> int`` handler that parses, calls the library and prints; they
live in the modules named for what the commands do: :mod:`tinylm.cli.prepare`,
:mod:`tinylm.cli.training` (train, finetune, merge, plot, export-checkpoint),
:mod:`tinylm.cli.use` (info, sample, chat, eval, explain, serve) and
:mod:`tinylm.cli.transform` (compress, quantize, convert); flags several commands share
are in :mod:`tinylm.cli.flags`. Only this package prints. Errors a user can cause are
``TinyLMError``s: :func:`main` prints their one-line message and exits with status 2, no
traceback. The handlers import the library lazily, so ``tinylm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence

from tinylm import __version__
from tinylm.cli.prepare import _add_prepare
from tinylm.cli.rl import _add_rl
from tinylm.cli.training import (
    _add_export_checkpoint,
    _add_finetune,
    _add_merge,
    _add_plot,
    _add_train,
)
from tinylm.cli.transform import _add_compress, _add_convert, _add_quantize
from tinylm.cli.use import (
    _add_chat,
    _add_eval,
    _add_explain,
    _add_info,
    _add_sample,
    _add_serve,
)
from tinylm.core.errors import TinyLMError


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


#: Every command's adder, in the order ``tinylm --help`` lists them. An adder creates the
#: subparser and sets ``func=<handler>``.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_prepare,
    _add_train,
    _add_finetune,
    _add_merge,
    _add_rl,
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
