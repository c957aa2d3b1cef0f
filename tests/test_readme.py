"""The README's examples run as written, so none can go stale.

Every command of every ```bash block of README.md runs, in the order a reader meets it,
in one working folder set up the way the README assumes (``make demo``'s data and run,
``make smollm2``'s model, the input files its examples name), on a tiny model: the test
appends flags that make each training run a few steps of a one-layer model, and nothing
else is changed. Each must exit 0. The few that cannot run here are listed in NOT_RUN
with the reason, and each entry must still match a README command (a stale exemption
fails). The Python blocks run too: the library example, and the serve example with the
official ``openai`` client against a live ``tinylm serve`` (its port changed).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tinylm.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
pytestmark = pytest.mark.slow

#: Commands (by their leading words) that do not run here, and why.
NOT_RUN = {
    "make demo": "three minutes of training; a fresh clone's `make demo` is run before each release",
    "make test": "this is the test suite",
    "make smollm2": "make test depends on it; the workspace below converts the same file",
    "make chat-demo": "minutes of fine-tuning; the chat commands below run its steps on a tiny model",
    "python benchmarks/": "benchmarks take minutes and write BENCHMARKS.md",
    "torchrun": "several processes (tests/test_distributed.py runs torchrun itself)",
    "tinylm convert --from-hf HuggingFaceTB/": "needs the Hugging Face Hub; tests have no network",
    "tinylm train --data data/shakespeare": "the tiny-Shakespeare text is not in the repository",
}

#: Flags appended to make a command small; later flags win in argparse.
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--context-length", "64"]
SHORT_RUN = ["--max-steps", "4", "--eval-every", "2", "--save-every", "2", "--eval-windows", "2",
             "--warmup-steps", "1", "--batch-size", "4"]
APPENDED = {"train": TINY_MODEL + SHORT_RUN, "finetune": SHORT_RUN,
            "sample": ["--max-new-tokens", "12"]}
#: What `tinylm train ...` stands for in the README's lines that elide the data and out.
ELLIPSIS = {"train": ["--data", "data/py", "--out", "runs/py"]}


def readme_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def bash_commands(text: str) -> list[list[str]]:
    """Each command of each bash block as argv (continuation lines joined, comments cut)."""
    commands = []
    for block in readme_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def exemption(argv: list[str]) -> str | None:
    line = " ".join(argv)
    return next((key for key in NOT_RUN if line.startswith(key)), None)


# --- the working folder the README assumes ----------------------------------------------


def _text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _write_inputs(work: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    text = _text()
    paragraphs = [p for p in text.split("\n\n") if len(p) > 40]
    (work / "some.txt").write_text(text[:150_000])
    (work / "notes.txt").write_text(text[150_000:160_000])
    (work / "prompt.txt").write_text("The list")
    (work / "texts").mkdir()
    for i in range(3):
        (work / "texts" / f"part{i}.txt").write_text(text[i * 20_000:(i + 1) * 20_000])
    (work / "web").mkdir()
    pq.write_table(pa.table({"text": paragraphs[:400]}), work / "web" / "part-0.parquet")
    lines = [json.dumps({"meta": {"body": p}}) for p in paragraphs[:400]] + ['{"no body": 1}']
    (work / "dump.jsonl.zst").write_bytes(zstandard.compress("\n".join(lines).encode()))
    convs = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
             for i in range(60)]
    (work / "convs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    (work / "run.toml").write_text("[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\n"
                                   "[train]\nmax_steps = 4\nbatch_size = 4\n")


def _gpt2_files(work: Path) -> None:
    """vocab.json + merges.txt, as GPT-2's files come, from a BPE tokenizer.json."""
    model = json.loads((work / "data/python-docs-bpe/tokenizer.json").read_text())["model"]
    folder = work / "gpt2-files"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def _run(work: Path, argv: list[str], stdin: str | None = None) -> str:
    """``tinylm ARGV`` in-process in ``work``; its stdout. Fails on a non-zero status."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd(), sys.stdin, sys.stdout, sys.stderr
    os.chdir(work)
    sys.stdout, sys.stderr = out, err
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        status = main(argv)
    finally:
        os.chdir(old[0])
        sys.stdin, sys.stdout, sys.stderr = old[1:]
    assert status == 0, f"tinylm {shlex.join(argv)} exited {status}:\n{err.getvalue()[-3000:]}"
    return out.getvalue()


@pytest.fixture(scope="module")
def work(tmp_path_factory, smollm2_gguf) -> Path:
    """A folder as after ``make demo`` and ``make smollm2``, with the README's inputs."""
    work = tmp_path_factory.mktemp("readme")
    _write_inputs(work)
    (work / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_gguf)
    _run(work, ["prepare", "--corpus", "python-docs", "--tokenizer", "bpe", "--vocab-size", "1024",
                "--out", "data/python-docs-bpe"])
    _run(work, ["prepare", "--out", "data/py-char"])
    for run, data in (("demo", "python-docs-bpe"), ("py-bpe", "python-docs-bpe"),
                      ("py-char", "py-char"), ("other", "py-char")):
        wider = ["--n-layer", "2", "--n-embd", "64"] if run == "demo" else []  # compress halves it
        _run(work, ["train", "--data", f"data/{data}", "--out", f"runs/{run}",
                    "--config", str(ROOT / "configs/demo.toml"), "--time-budget", "none",
                    *TINY_MODEL, *SHORT_RUN, *wider])
    _run(work, ["convert", "--from-gguf", str(smollm2_gguf), "--out", "models/smollm2"])
    _run(work, ["convert", "--model", "runs/py-bpe", "--to-hf", "path/to/gpt2"])
    _gpt2_files(work)
    return work


# --- running the commands ---------------------------------------------------------------


def _as_run(argv: list[str]) -> tuple[list[str], str | None]:
    """The argv tinylm gets (the README's words plus APPENDED) and the stdin it reads."""
    stdin = None
    if "|" in argv:  # printf 'TEXT' | tinylm ...
        cut = argv.index("|")
        assert argv[0] == "printf", argv
        stdin, argv = argv[1], argv[cut + 1:]
    argv = argv[1:]  # tinylm / .venv/bin/tinylm
    command = argv[0]
    if "..." in argv:
        at = argv.index("...")
        argv = argv[:at] + ELLIPSIS[command] + argv[at + 1:]
    if "--finetune" in argv:  # compress --finetune N: two steps
        argv[argv.index("--finetune") + 1] = "2"
    return argv + APPENDED.get(command, []), stdin


def _clear_outputs(work: Path, argv: list[str]) -> None:
    """A README line writes its --out as if it were the first to (unless it resumes)."""
    if "--resume" in argv or "--force" in argv:
        return
    for flag in ("--out", "--to-hf"):
        if flag in argv:
            target = work / argv[argv.index(flag) + 1]
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


def _serve_block(work: Path, argv: list[str], text: str) -> None:
    """`tinylm serve` as written (on a free port), its curl line, its openai example."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tinylm", *argv[1:], "--port", str(port)],
                              cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, server)
        curl = next(c for c in bash_commands(text) if c[0] == "curl")
        curl = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in curl]
        answer = json.loads(subprocess.run(curl, capture_output=True, check=True, timeout=120,
                                           text=True).stdout)
        assert answer["choices"][0]["text"], answer
        example = next(b for b in readme_blocks(text, "python") if "OpenAI(" in b)
        example = example.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), "the openai example printed no text"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_ready(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail("tinylm serve did not become ready in 120 s")


def test_readme_commands_run_as_written(work):
    text = README.read_text()
    ran, exempt_used = 0, set()
    outputs = {}
    for argv in bash_commands(text):
        key = exemption(argv)
        if key:
            exempt_used.add(key)
            continue
        if argv[0] == "curl":  # the serve block's curl: run by _serve_block's server
            continue
        if argv[0].endswith("tinylm") and argv[1] == "serve":
            _serve_block(work, argv, text)
            ran += 1
            continue
        run_argv, stdin = _as_run(argv)
        if run_argv[0] == "chat" and "--prompt" not in run_argv:
            stdin = "What does len() return?\n"  # the interactive chat: one question, Ctrl-D
        _clear_outputs(work, run_argv)
        outputs[shlex.join(argv)] = _run(work, run_argv, stdin)
        ran += 1
    assert set(NOT_RUN) == exempt_used, f"stale exemptions: {set(NOT_RUN) - exempt_used}"
    assert ran >= 40, ran
    france = next(v for k, v in outputs.items() if "capital of France" in k)
    assert "Paris" in france, france  # the quick start's answer, as the README shows it


def test_readme_library_example_runs():
    block = next(b for b in readme_blocks(README.read_text(), "python")
                 if "from tinylm import GPT" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert tuple(scope["logits"].shape) == (2, 5, 1000)
    assert scope["maps"].shape[:2] == (4, 2)
