"""The global parser and `tinylm info` (issue 20 items 10-12): one-line flag errors in
every command, -q/-v after the command, quiet third-party loggers, help texts written
one way, the same --device everywhere, `info` on a real run, the README's sample line."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinylm.cli import build_parser, main
from tinylm.io.checkpoint import load_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"
TEXT = ("The quick brown fox jumps over the lazy dog. " * 40
        + "Lists are mutable sequences; tuples are not.\n" * 40)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def one_line(code: int, err: str, command: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tinylm {command}: error: "), err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real (tiny) training run: prepare, then 4 steps of train with one evaluation."""
    root = tmp_path_factory.mktemp("cli")
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["prepare", "--input", str(text), "--out", str(root / "data"),
                 "--context-length", "16", "--special-token", "<|endoftext|>",
                 "--no-progress"]) == 0
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--context-length",
                 "16", "--batch-size", "4", "--max-steps", "4", "--eval-every", "4",
                 "--eval-windows", "2", "--save-every", "4", "--warmup-steps", "0",
                 "--device", "cpu", "--no-progress", "-q"]) == 0
    return root / "run"


# --- the parser -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(_commands()))
def test_bad_flags_are_one_line_in_every_command(command, capsys) -> None:
    code = main([command, "--no-such-flag", "1"])
    line = one_line(code, capsys.readouterr().err, command)
    assert ("unrecognized arguments: --no-such-flag" in line
            or "the following arguments are required" in line), line
    assert line.endswith(f"see 'tinylm {command} --help'")


def test_help_and_version_still_exit_0(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("tinylm ")
    assert main(["sample", "--help"]) == 0
    assert "usage: tinylm sample" in capsys.readouterr().out


def test_a_value_of_two_dashes_is_a_value_not_a_crash(capsys) -> None:
    line = one_line(main(["sample", "--model", "m", "--seed=--"]), capsys.readouterr().err,
                    "sample")
    assert "argument --seed: expected an integer, got '--'" in line


_HELP_DEFAULT = re.compile(r"default")


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_texts_write_defaults_one_way(command) -> None:
    parser = _commands()[command]
    for action in parser._actions:
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        for match in _HELP_DEFAULT.finditer(text):
            before = text[max(0, match.start() - 1):match.start()]
            assert before == "(" and text[match.end():match.end() + 2] == ": ", \
                f"{command} {action.option_strings}: {text!r} (write '(default: X)')"


def test_device_flag_is_the_same_in_every_command() -> None:
    seen = {}
    for name, parser in _commands().items():
        for action in parser._actions:
            if "--device" in action.option_strings:
                # train's and finetune's flags default to None (= not given: the config
                # file or the base run decides), and TrainConfig's default is what its
                # help shows
                default = action.default if name not in ("train", "finetune") else "auto"
                seen[name] = (default, parser._get_formatter()._expand_help(action))
    assert {"sample", "eval", "explain", "compress", "train"} <= set(seen)
    assert len(set(seen.values())) == 1, seen
    default, help_text = next(iter(seen.values()))
    assert default == "auto" and help_text.endswith("(default: auto)")


#: Commands that compute on a model: each takes --threads (train and finetune through
#: TrainConfig.threads, serve for its decoding loop, prepare as its encoding processes).
COMPUTING = ("prepare", "train", "finetune", "chat", "sample", "eval", "explain", "compress",
             "quantize", "serve")


def test_every_computing_command_takes_threads() -> None:
    commands = _commands()
    for name in COMPUTING:
        flags = {s for a in commands[name]._actions for s in a.option_strings}
        assert "--threads" in flags, name
    assert main(["sample", "--model", "m", "--threads", "0"]) == 2


@pytest.mark.parametrize("given, want", [(["--threads", "1"], 1), ([], None)])
def test_threads_apply_to_the_whole_command(run_dir, capsys, monkeypatch, given, want) -> None:
    import torch

    from tinylm.training import threads as training

    monkeypatch.setattr(training, "default_threads", lambda: 3)
    seen: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    before = torch.get_num_threads()
    assert main(["sample", "--model", str(run_dir), "--max-new-tokens", "3", "--prompt",
                 "The", "--device", "cpu", *given]) == 0
    assert seen[0] == (want or 3)  # --threads, else tinylm.core.config.default_threads()
    assert torch.get_num_threads() == before  # restored when the command ends
    seen.clear()
    assert main(["eval", "--model", str(run_dir), "--data", str(run_dir.parent / "data"),
                 "--device", "cpu", *given]) == 0
    assert seen[0] == (want or 3)
    capsys.readouterr()


def test_sample_allow_special_turns_a_spelled_token_into_its_id(run_dir, capsys,
                                                                 monkeypatch) -> None:
    """Issue 11 item 4: a prompt's "<|endoftext|>" is text unless --allow-special."""
    from tinylm.use import sampling

    prompts = []
    real = sampling.generate_stream
    monkeypatch.setattr(sampling, "generate_stream",
                        lambda model, batch, *a, **k: (prompts.append(batch[0].tolist()),
                                                       real(model, batch, *a, **k))[1])
    tokenizer = load_checkpoint(run_dir)[1]
    args = ["sample", "--model", str(run_dir), "--prompt", "The<|endoftext|>",
            "--max-new-tokens", "2", "--device", "cpu"]
    # as text, its characters are ones this char tokenizer never saw: refused, one line
    line = one_line(main(args), capsys.readouterr().err, "sample")
    assert "'<'" in line and "'|'" in line and not prompts
    assert main([*args, "--allow-special"]) == 0
    assert prompts == [[*tokenizer.encode("The"), tokenizer.eos_id]]
    capsys.readouterr()


#: What a module of the cli package may import at its top: the standard library, the
#: package itself, the version and the errors. The library comes in lazily, in handlers.
_CLI_TOP_LEVEL = ("tinylm", "tinylm.cli", "tinylm.core.errors")


def test_cli_modules_import_the_library_only_inside_handlers() -> None:
    import ast

    package = SRC / "tinylm" / "cli"
    assert (package / "__init__.py").is_file() and not (SRC / "tinylm" / "cli.py").exists()
    for path in sorted(package.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = (top in sys.stdlib_module_names or name in _CLI_TOP_LEVEL
                      or name.startswith("tinylm.cli."))
                assert ok, f"{path.name} imports {name} at module level"
        assert len(path.read_text().splitlines()) <= 800, path.name


def test_console_script_and_module_name_the_same_main() -> None:
    from tinylm import cli

    pyproject = (SRC.parent / "pyproject.toml").read_text()
    assert '[project.scripts]\ntinylm = "tinylm.cli:main"\n' in pyproject and cli.main is main
    assert "from tinylm.cli import main" in (SRC / "tinylm" / "__main__.py").read_text()


# --- logging --------------------------------------------------------------------------------


def test_verbosity_flags_work_before_and_after_the_command() -> None:
    script = (
        "import logging, sys\n"
        "from tinylm.cli import main\n"
        "for argv in (['-v', 'info'], ['info', '-v'], ['-q', 'info'], ['info', '-q']):\n"
        "    print('== ' + ' '.join(argv), file=sys.stderr, flush=True)\n"
        "    assert main(argv) == 0\n"
        "    log = logging.getLogger('tinylm.x')\n"
        "    log.debug('TINYLM-DEBUG'); log.info('TINYLM-INFO'); log.warning('TINYLM-WARN')\n"
        "    for name in ('matplotlib.font_manager', 'filelock', 'PIL.PngImagePlugin'):\n"
        "        logging.getLogger(name).debug('NOISE'); logging.getLogger(name).info('NOISE')\n"
    )
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"}).stderr
    parts = dict(part.split("\n", 1) for part in err.split("== ")[1:])
    assert set(parts) == {"-v info", "info -v", "-q info", "info -q"}, err
    for argv in ("-v info", "info -v"):
        assert "TINYLM-DEBUG" in parts[argv] and "TINYLM-INFO" in parts[argv], argv
    for argv in ("-q info", "info -q"):
        assert "TINYLM-DEBUG" not in parts[argv] and "TINYLM-INFO" not in parts[argv], argv
        assert "TINYLM-WARN" in parts[argv]
    assert "NOISE" not in err  # third-party debug/info lines stay out, even with -v


# --- info -----------------------------------------------------------------------------------


def test_info_describes_a_training_run(run_dir, capsys) -> None:
    assert main(["info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    model, tok = load_checkpoint(run_dir)
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines()[1:])
    assert rows["architecture"].startswith("1 layers, 2 heads, 8 dims/head, 16 n_embd, "
                                           f"16 context, {tok.vocab_size} vocab")
    assert rows["parameters"] == f"{model.num_parameters():,}"
    assert rows["tokenizer"] == f"char, {tok.vocab_size:,} tokens, end-of-text <|endoftext|>"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in metrics if r.get("step") == 4 and "val_loss" in r][-1]
    assert rows["training"] == f"step 4, val loss {val:.4f}"
    assert rows["low-rank"] == "none (full-rank)"
    assert re.match(r"tinylm \S+, torch \S+, device cpu, native kernels (active|off)",
                    out.splitlines()[0])
    assert main(["info", "--json", "--model", str(run_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint"]["step"] == 4 and info["checkpoint"]["nonfinite"] == 0
    assert info["checkpoint"]["parameters"] == model.num_parameters()


def test_info_shows_low_rank_ranks(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "small"
    assert main(["compress", "--model", str(run_dir), "--out", str(out), "--rank", "2",
                 "--layers", "attn.qkv", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("low-rank"))
    assert line.split(None, 1)[1] == "1 layers, ranks 2..2: blocks.0.attn.qkv 2"


def test_info_on_a_missing_folder_is_one_line(tmp_path, capsys) -> None:
    one_line(main(["info", str(tmp_path / "nope")]), capsys.readouterr().err, "info")


# --- the README's sample line, and hints that point at real flags ---------------------------


def test_readme_sample_without_a_prompt_works(run_dir, capsys) -> None:
    readme = (SRC.parent / "README.md").read_text()
    assert "tinylm sample --model runs/py --num-samples 4 --no-echo" in readme
    code = main(["sample", "--model", str(run_dir), "--num-samples", "4", "--no-echo",
                 "--max-new-tokens", "20", "--seed", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("--- sample")] == [
        f"--- sample {i} ---" for i in range(1, 5)]


def test_sample_hint_for_unseen_characters_names_what_sample_can_do(run_dir, capsys) -> None:
    line = one_line(main(["sample", "--model", str(run_dir), "--prompt", "日本"]),
                    capsys.readouterr().err, "sample")
    assert "'日' (U+65E5)" in line
    assert "tinylm prepare --unknown replace" in line and "remove them" in line
    assert "use --unknown replace" not in line


def test_explain_hint_for_unseen_characters_names_tinylm_prepare(run_dir, capsys) -> None:
    line = one_line(main(["explain", "--model", str(run_dir), "--prompt", "日本"]),
                    capsys.readouterr().err, "explain")
    assert "tinylm prepare --unknown replace" in line and "use --unknown replace" not in line


# --- make demo's last line ------------------------------------------------------------------


def _demo_next_line() -> str:
    """The text `make demo` ends with (the echo of its recipe's last line)."""
    import shlex

    makefile = (SRC.parent / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0].splitlines()
    last = recipe[-1].strip()
    assert last.startswith("@echo "), last
    return shlex.split(last[len("@echo "):])[0]


def test_make_demo_ends_with_next_steps_that_work(run_dir, capsys) -> None:
    """Issue 36 item 10: `make demo` ended without a next step. Its last line names
    commands that run on the demo's output: each tinylm command parses, and the sample
    one runs (on a tiny run standing for runs/demo)."""
    import shlex

    line = _demo_next_line()
    assert line.startswith("next: ") and "\n" not in line
    commands = [shlex.split(part.split(" (")[0]) for part in line[len("next: "):].split("; ")]
    assert [c[0] for c in commands] == [".venv/bin/tinylm", ".venv/bin/tinylm", "make"]
    parser = build_parser()
    for argv in commands[:2]:
        args = parser.parse_args(argv[1:])
        assert args.model == "runs/demo" and args.command in ("sample", "serve")
    sample = [str(run_dir) if a == "runs/demo" else a for a in commands[0][1:]]
    assert main([*sample, "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("Lists are")
    assert commands[2] == ["make", "chat-demo"]
    assert "\nchat-demo: " in (SRC.parent / "Makefile").read_text()
