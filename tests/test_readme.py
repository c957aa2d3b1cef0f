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
    "make demo": "three minutes of training (a fresh clone's make demo is tried by hand)",
    "make test": "this is the test suite",
    "make smollm2": "make test depends on it; the workspace below converts the same file",
    "make chat-demo": "minutes of fine-tuning; the chat lines below run its steps, tiny",
    "python benchmarks/": "benchmarks take minutes and write BENCHMARKS.md",
    "torchrun": "several processes (tests/test_distributed.py runs torchrun itself)",
    "tinylm convert --from-hf HuggingFaceTB/": "needs the Hugging Face Hub; tests have no network",
    "tinylm train --data data/shakespeare": "the tiny-Shakespeare text is not in the repository",
}
#: The guides' quick examples that do not run here (part of NOT_RUN).
DOCS_NOT_RUN = {
    "tinylm export-checkpoint runs/big": "needs a sharded run of torchrun "
                                         "(tests/test_distributed.py exports one)",
}
NOT_RUN.update(DOCS_NOT_RUN)

#: Flags appended to make a command small; later flags win in argparse.
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--context-length", "64"]
SHORT_RUN = ["--max-steps", "4", "--eval-every", "2", "--save-every", "2", "--eval-windows", "2",
             "--warmup-steps", "1", "--batch-size", "4"]
APPENDED = {"train": TINY_MODEL + SHORT_RUN, "finetune": SHORT_RUN,
            "sample": ["--max-new-tokens", "12"],
            "rl": ["--max-steps", "2", "--group-size", "2", "--prompts-per-step", "1",
                   "--max-new-tokens", "4", "--n-held-out", "2", "--pass-k", "2",
                   "--eval-every", "1", "--save-every", "1"]}
#: What `tinylm train ...` stands for in the README's lines that elide the data and out.
ELLIPSIS = {"train": ["--data", "data/py", "--out", "runs/py"], "sample": ["--prompt", "The"],
            "rl": ["--model", "runs/chat/merged", "--task", "builtin:arith", "--out", "runs/rl"]}


def readme_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _substituted(line: str) -> str:
    """``$(python -c '...')`` replaced by its output, as the shell would (with this
    interpreter as ``python``)."""
    def run(match: re.Match) -> str:
        argv = shlex.split(match.group(1))
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    return re.sub(r"\$\((.*?)\)(?=\s|$)", run, line)


def bash_commands(text: str) -> list[list[str]]:
    """Each command of each bash block as argv (continuation lines joined, comments cut)."""
    commands = []
    for block in readme_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(_substituted(line), comments=True)
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
    _write_docs_inputs(work, paragraphs)
    shutil.copy(ROOT / "tests/data/commonsense20.jsonl", work / "items.jsonl")
    items = [json.loads(line) for line in (work / "items.jsonl").read_text().splitlines()]
    (work / "hellaswag_val.jsonl").write_text("".join(json.dumps(  # HellaSwag's own fields
        {"ind": i, "activity_label": "Everyday facts", "ctx_a": it["context"], "ctx_b": "",
         "endings": it["choices"], "label": str(it["answer"])}) + "\n"
        for i, it in enumerate(items)))
    (work / "core.toml").write_text('limit = 10\n[[task]]\ntask = "builtin:copy"\n'
                                    '[[task]]\ntask = "items.jsonl"\n')
    (work / "run.toml").write_text("[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\n"
                                   "[train]\nmax_steps = 4\nbatch_size = 4\n")


def _write_docs_inputs(work: Path, paragraphs: list[str]) -> None:
    """The inputs the guides' quick examples name (docs/prepare.md's)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (work / "shards").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": paragraphs[i * 200:(i + 1) * 200]}),
                       work / "shards" / f"part-{i}.parquet")
    datasets.Dataset.from_dict({"text": paragraphs[:300]}).save_to_disk(work / "saved_dataset")
    (work / "train").mkdir()
    for i in range(3):
        (work / "train" / f"doc{i}.txt").write_text("\n\n".join(paragraphs[i * 100:(i + 1) * 100]))
    (work / "held_out.jsonl").write_text("".join(json.dumps({"text": p}) + "\n"
                                                 for p in paragraphs[300:340]))
    (work / "notes.md").write_text("\n\n".join(paragraphs[340:600]))


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
    (work / "x.gguf").symlink_to(smollm2_gguf)  # the guides' any-GGUF-file example
    _run(work, ["prepare", "--corpus", "python-docs", "--tokenizer", "bpe", "--vocab-size", "1024",
                "--out", "data/python-docs-bpe"])
    _run(work, ["prepare", "--out", "data/py-char"])
    _run(work, ["prepare", "--out", "data/py"])
    for run, data in (("demo", "python-docs-bpe"), ("py-bpe", "python-docs-bpe"),
                      ("py-char", "py-char"), ("other", "py-char"), ("py", "py")):
        wider = ["--n-layer", "2", "--n-embd", "64"] if run == "demo" else []  # compress halves it
        _run(work, ["train", "--data", f"data/{data}", "--out", f"runs/{run}",
                    "--config", str(ROOT / "configs/demo.toml"), "--time-budget", "none",
                    *TINY_MODEL, *SHORT_RUN, *wider])
    _run(work, ["convert", "--from-gguf", str(smollm2_gguf), "--out", "models/smollm2"])
    _run(work, ["convert", "--model", "runs/py-bpe", "--to-hf", "path/to/gpt2"])
    _gpt2_files(work)
    return work


# --- running the commands ---------------------------------------------------------------


def _as_run(argv: list[str]) -> list[str]:
    """The argv tinylm gets: the README's words plus APPENDED."""
    argv = argv[1:]  # tinylm / .venv/bin/tinylm
    command = argv[0]
    if "..." in argv:
        at = argv.index("...")
        argv = argv[:at] + ELLIPSIS[command] + argv[at + 1:]
    if "--finetune" in argv:  # compress --finetune N: two steps
        argv[argv.index("--finetune") + 1] = "2"
    return argv + APPENDED.get(command, [])


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


def _serve(work: Path, env: dict[str, str], argv: list[str], check) -> None:
    """`tinylm serve` as written (on a free port) until ``check(base URL)`` returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}
    server = subprocess.Popen([sys.executable, "-m", "tinylm", *argv[1:], "--port", str(port)],
                              cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server)
        check(port)
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


def _readme_serve_examples(text: str):
    """The README's check of a live server: its curl line and its openai example."""
    def check(port: int) -> None:
        here = f"127.0.0.1:{port}"
        curl = [a.replace("127.0.0.1:8000", here) for a in next(
            c for c in bash_commands(text) if c[0] == "curl")]
        answer = json.loads(subprocess.run(curl, capture_output=True, check=True, timeout=120,
                                           text=True).stdout)
        assert answer["choices"][0]["text"], answer
        example = next(b for b in readme_blocks(text, "python") if "OpenAI(" in b)
        done = subprocess.run([sys.executable, "-c", example.replace("127.0.0.1:8000", here)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), "the openai example printed no text"
    return check


def _lists_its_model(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200


def _shell_stdin(work: Path, argv: list[str]) -> tuple[list[str], str | None]:
    """``LEFT | tinylm ...``: the left side's output (printf's text, or the shell's) as stdin."""
    if "|" not in argv:
        return argv, None
    cut = argv.index("|")
    left = argv[:cut]
    if left[0] == "printf":
        return argv[cut + 1:], left[1]
    done = subprocess.run(" ".join(left), shell=True, cwd=work, capture_output=True,
                          text=True, check=True)  # e.g. cat *.md: the glob needs a shell
    return argv[cut + 1:], done.stdout


def run_commands(work: Path, commands: list[list[str]], serve_check) -> dict[str, str]:
    """Each command in order (NOT_RUN ones left out); {command line: its stdout}."""
    outputs = {}
    for argv in commands:
        line = shlex.join(argv)
        env = {}
        while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # NAME=VALUE tinylm ...
            name, value = argv[0].split("=", 1)
            env[name], argv = value, argv[1:]
        if exemption(argv) or argv[0] == "curl":  # curl: the serve check runs it
            continue
        if argv[0].endswith("tinylm") and argv[1] == "serve":
            _serve(work, env, argv, serve_check)
            outputs[line] = ""
            continue
        assert not env, f"only serve lines set variables here: {line}"
        argv, stdin = _shell_stdin(work, argv)
        run_argv = _as_run(argv)
        if run_argv[0] == "chat" and "--prompt" not in run_argv:
            stdin = "What does len() return?\n"  # the interactive chat: one question, Ctrl-D
        _clear_outputs(work, run_argv)
        outputs[line] = _run(work, run_argv, stdin)
    return outputs


def test_readme_commands_run_as_written(work):
    text = README.read_text()
    commands = bash_commands(text)
    outputs = run_commands(work, commands, _readme_serve_examples(text))
    used = {exemption(argv) for argv in commands} - {None}
    assert set(NOT_RUN) - set(DOCS_NOT_RUN) <= used, f"stale: {set(NOT_RUN) - used}"
    assert len(outputs) >= 40, len(outputs)
    france = next(v for k, v in outputs.items() if "capital of France" in k)
    assert "Paris" in france, france  # the quick start's answer, as the README shows it


DOCS = sorted(p.name for p in (ROOT / "docs").glob("*.md")
              if readme_blocks(p.read_text(), "bash"))


@pytest.mark.parametrize("name", DOCS)
def test_docs_quick_examples_run_as_written(work, name):
    """Each guide's first bash block, its quick examples, runs as written too."""
    commands = bash_commands("```bash\n" + readme_blocks((ROOT / "docs" / name).read_text(),
                                                          "bash")[0] + "```\n")
    outputs = run_commands(work, commands, _lists_its_model)
    assert outputs or all(exemption(c) for c in commands), name


def test_readme_library_example_runs():
    block = next(b for b in readme_blocks(README.read_text(), "python")
                 if "from tinylm import GPT" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert tuple(scope["logits"].shape) == (2, 5, 1000)
    assert scope["maps"].shape[:2] == (4, 2)
