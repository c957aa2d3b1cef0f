"""Flags more than one command shares, and the one home for the CLI's argparse types
(``_count``, ``_positive``, ``_or_off``, ``_resume_arg``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping


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


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def _allow_nonfinite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load a model whose weights hold NaN or inf (refused otherwise); "
                   "eval then reports a non-finite loss as it is, sample still stops at "
                   "non-finite logits")


def _device_flag(p: argparse.ArgumentParser) -> None:
    """--device and --threads, with the same default and help in every command that
    computes on a model."""
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps (default: "
                   "%(default)s)")
    _threads_flag(p)


def _threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads N: torch's CPU threads for the whole command, applied by :func:`main`."""
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads for torch's kernels (default: the free cores: "
                   "OMP_NUM_THREADS if set, else the cores the current load leaves idle)")
    p.set_defaults(apply_threads=True)


def _config_flags(group: argparse._ArgumentGroup, cls: type, helps: dict[str, str | None],
                  defaults: Mapping[str, object] | None = None,
                  notes: Mapping[str, str] | None = None) -> None:
    """One flag per dataclass field (--n-layer for n_layer); default None = not given, the
    command's layers decide. The help shows the default that runs: ``defaults[name]``
    where the command has its own (finetune's), else the field's; ``notes[name]`` follows
    it (``(default: 0.0001; with --lora-rank: 0.002)``)."""
    import dataclasses

    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(cls):
        help_text = helps.get(f.name, f.metadata.get("help", ""))
        if help_text is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" | None", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        default = (defaults or {}).get(f.name, default)
        if default is not None:
            note = (notes or {}).get(f.name)
            help_text = f"{help_text} (default: {default}" + (f"; {note})" if note else ")")
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


def _resume_arg(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"expected nothing or 'auto', got {text!r}")
    return text
