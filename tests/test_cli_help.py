"""``--help`` is quick and true (issue 36 items 4 and 10): building the parser imports no
torch, and every flag's help-shown default is the default that runs, for every command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinylm.cli import build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(script: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"})
    return out.stdout.split()


def test_help_imports_no_torch() -> None:
    """``tinylm --help`` and every ``tinylm CMD --help`` build the parser without torch
    (importing it took 1-2 s, most of a --help's 2-6 s)."""
    script = (
        "import contextlib, io, sys\n"
        "import tinylm.cli\n"
        "print('torch' in sys.modules)\n"
        "from tinylm.cli import build_parser, main\n"
        "names = sorted(build_parser().commands)\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main(['--help'])] + [main([n, '--help']) for n in names]\n"
        "print('torch' in sys.modules, len(names), set(codes))\n"
    )
    assert _run(script) == ["False", "False", str(len(build_parser().commands)), "{0}"]


def test_import_tinylm_is_light_and_its_names_still_resolve() -> None:
    script = ("import sys, tinylm\n"
              "print('torch' in sys.modules)\n"
              "from tinylm import ModelConfig, TinyLMError\n"
              "print('torch' in sys.modules)\n"
              "model = tinylm.GPT(ModelConfig(vocab_size=8, context_length=4, n_layer=1,\n"
              "                               n_head=1, n_embd=8))\n"
              "print('torch' in sys.modules, type(model).__module__)\n")
    assert _run(script) == ["False", "False", "True", "tinylm.core.model"]


def test_python_m_tinylm_help_imports_no_torch() -> None:
    script = ("import runpy, sys\n"
              "sys.argv = ['tinylm', 'finetune', '--help']\n"
              "try:\n"
              "    runpy.run_module('tinylm', run_name='__main__')\n"
              "except SystemExit as exc:\n"
              "    code = exc.code\n"
              "print(code, 'torch' in sys.modules, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"})
    assert "usage: tinylm finetune" in out.stdout
    assert out.stderr.split() == ["0", "False"], out.stderr


# --- every help-shown default is the default that runs ----------------------------------


COMMANDS = build_parser().commands

#: The required arguments of the commands that run here, up to the training loop (which
#: the test replaces); every other command is parsed with placeholders
#: (:func:`required_argv`).
REQUIRED = {
    "prepare": ["--out", "{tmp}/data"], "train": ["--data", "{data}", "--out", "{tmp}/run"],
    "finetune": ["--model", "{base}", "--data", "{chat}", "--out", "{tmp}/ft"],
}


def required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """Placeholders for a command's required flags, positionals and required groups."""
    argv: list[str] = []
    chosen = {id(g._group_actions[0]) for g in parser._mutually_exclusive_groups if g.required}
    for action in parser._actions:
        if not action.option_strings:
            if action.nargs not in ("?", "*", argparse.SUPPRESS):
                argv.append("x")
        elif action.required or id(action) in chosen:
            argv += [action.option_strings[-1], "x"]
    return argv


def shown_default(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    """The X of '(default: X)' in the flag's help as --help prints it, or None."""
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    start = text.rfind("(default: ")
    if start < 0:
        return None
    depth, i = 1, start + len("(default: ")
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    raise AssertionError(f"unbalanced '(default: ' in {text!r}")


def _literal(text: str) -> bool:
    """A value a reader takes at its word (a number or a boolean), not a description."""
    try:
        float(text)
        return True
    except ValueError:
        return text in ("True", "False")


#: The letters help texts use for other settings (E = n_embd, ...).
LETTERS = {"E": "n_embd", "C": "context_length", "H": "n_head", "R": "lora_rank"}


def _formula(head: str, values: dict[str, object]) -> object:
    """The value of a shown default written as another setting or a formula of settings
    ('n_head', '--bias', 'n_embd // n_head', '4*E'), or None when it is not one."""
    names = {**values, **{k: values.get(v) for k, v in LETTERS.items()}}
    expr = head.replace("·", "*")
    if expr.startswith("--"):
        expr = expr[2:].replace("-", "_")
    try:
        return eval(expr, {"__builtins__": {}}, names)  # noqa: S307 (the test's own texts)
    except Exception:
        return None


def agrees(shown: str, value: object, values: dict[str, object] | None = None) -> bool:
    """The shown default states ``value`` (its head, before '; ', ', ' or ' = ', when the
    rest explains it), literally or as a formula of the other settings in ``values``."""
    want = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    for head in (shown, *(shown.split(sep)[0] for sep in ("; ", ", ", " = "))):
        if re.fullmatch(r"\d{1,3}(,\d{3})+", head):  # 16,777,216: thousands separators
            head = head.replace(",", "")
        if head == want:
            return True
        if not isinstance(value, bool) and isinstance(value, (int, float)) and _literal(head):
            return float(head) == float(value)
        if values is not None and not _literal(head) and _formula(head, values) == value:
            return True
    return False


class _Stop(Exception):
    """Raised by the stand-in training loop once it has seen the configs."""


def _run_to_the_loop(monkeypatch, module, argv: list[str]) -> dict[str, object]:
    """The model and training config the command hands to the training loop."""
    seen: dict[str, object] = {}

    def loop(model_config, train_config, *args, **kwargs):
        seen.update(dataclasses.asdict(model_config), **dataclasses.asdict(train_config))
        raise _Stop

    monkeypatch.setattr(module, "train", loop)
    with pytest.raises(_Stop):
        main(argv)
    return seen


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A prepared text folder, a tiny base checkpoint and chat data prepared with it."""
    import torch

    from tinylm.core.config import ModelConfig
    from tinylm.core.model import GPT
    from tinylm.data.chatdata import prepare_chat
    from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer
    from tinylm.io.checkpoint_files import save_checkpoint

    root = tmp_path_factory.mktemp("help")
    (root / "t.txt").write_text("what is it 0123456789?. " * 200)
    assert main(["prepare", "--input", str(root / "t.txt"), "--out", str(root / "data"),
                 "--context-length", "16", "--no-progress", "-q"]) == 0
    tok = CharTokenizer("what is it 0123456789?.x", special_tokens=STANDARD_SPECIALS)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=31, n_layer=1,
                            n_head=2, n_embd=16, dropout=0.1))
    base = save_checkpoint(root / "base", model, tok)
    qa = [{"prompt": f"what is {i}?", "completion": f"it is {i}."} for i in range(20)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))
    prepare_chat(root / "chat", [root / "qa.jsonl"], tokenizer=base, context_length=31)
    return {"tmp": str(root), "data": str(root / "data"), "base": str(base),
            "chat": str(root / "chat")}


def effective_defaults(command: str, inputs, monkeypatch) -> dict[str, object]:
    """dest -> the value the command runs with when no optional flag is given."""
    given = REQUIRED.get(command) or required_argv(COMMANDS[command])
    argv = [command, *(a.format(**inputs) for a in given)]
    args = COMMANDS[command].parse_args(argv[1:])
    values = vars(args)
    if command == "prepare":
        from tinylm.data.options import PrepareOptions

        values.update(dataclasses.asdict(PrepareOptions.from_args(args)))
    elif command == "train":
        import tinylm.training.loop as loop

        values.update(_run_to_the_loop(monkeypatch, loop, argv))
    elif command == "finetune":
        import tinylm.training.finetune as finetune

        values.update(_run_to_the_loop(monkeypatch, finetune, argv))
    return values


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_help_default_is_the_default_that_runs(command, inputs, monkeypatch) -> None:
    """Issue 36 item 4: finetune's flags showed train's defaults (lr 0.001, 100 warm-up
    steps, 2000 steps, batch 32) while it ran its own (1e-4, 20, 300, 16)."""
    parser = COMMANDS[command]
    values = effective_defaults(command, inputs, monkeypatch)
    checked = 0
    for action in parser._actions:
        shown = shown_default(parser, action)
        if shown is None:
            continue
        value = values.get(action.dest)
        flag = "/".join(action.option_strings) or action.dest
        if value is None:  # decided at run time: the help describes it, states no value
            assert not _literal(shown.split("; ")[0]), \
                f"{command} {flag}: help shows {shown!r} but runs with None"
            continue
        assert agrees(shown, value, values), \
            f"{command} {flag}: help shows {shown!r}, runs {value!r}"
        checked += 1
    assert checked or command not in ("prepare", "train", "finetune", "sample", "serve")


def test_finetune_help_shows_the_lora_defaults_that_run(inputs, monkeypatch) -> None:
    import tinylm.training.finetune as finetune
    from tinylm.training.defaults import FULL_DEFAULTS, LORA_DEFAULTS

    argv = ["finetune", *(a.format(**inputs) for a in REQUIRED["finetune"])]
    runs = _run_to_the_loop(monkeypatch, finetune, [*argv, "--lora-rank", "2"])
    parser = COMMANDS["finetune"]
    notes = 0
    for action in parser._actions:
        shown = shown_default(parser, action) or ""
        if "; with --lora-rank: " in shown:
            note = shown.split("; with --lora-rank: ")[1]
            assert agrees(note, runs[action.dest]), (action.dest, shown, runs[action.dest])
            notes += 1
    assert notes == sum(LORA_DEFAULTS[k] != FULL_DEFAULTS.get(k) for k in LORA_DEFAULTS) == 1
    text = parser.format_help()
    assert "--lr LR" in text or "--lr FLOAT" in text
    assert "(default: 0.0001; with --lora-rank: 0.002)" in " ".join(text.split())


def test_train_arch_default_is_the_preset_that_runs(inputs, monkeypatch) -> None:
    import tinylm.training.loop as loop

    argv = ["train", *(a.format(**inputs) for a in REQUIRED["train"])]
    arch = next(a for a in COMMANDS["train"]._actions if a.dest == "arch")
    shown = shown_default(COMMANDS["train"], arch)
    assert shown in arch.choices
    assert _run_to_the_loop(monkeypatch, loop, argv) == \
        _run_to_the_loop(monkeypatch, loop, [*argv, "--arch", shown])


def test_the_checks_can_fail() -> None:
    assert agrees("0.0001; with --lora-rank: 0.002", 1e-4) and not agrees("0.001", 1e-4)
    assert agrees("* = all non-hidden", "*") and agrees("60", 60.0)
    assert agrees("qkv,out,up,down", ("qkv", "out", "up", "down"))
    assert not agrees("True", False) and not agrees("100", 20) and _literal("1e-05")
    assert agrees("n_embd // n_head", 32, {"n_embd": 128, "n_head": 4})
    assert not agrees("4*E; swiglu 8*E/3", 500, {"n_embd": 128})
    assert not _literal("the free cores") and not _literal("2·R")
