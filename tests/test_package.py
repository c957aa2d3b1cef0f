"""The package as a whole: entry points, public API, and tinylm without its native package.

(Which module may import which, and the size limits, are tests/test_layout.py's.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tinylm

SRC = Path(tinylm.__file__).parent
REPO = Path(__file__).resolve().parents[1]


def test_public_api() -> None:
    from tinylm import GPT, ModelConfig

    model = GPT(ModelConfig(vocab_size=10, context_length=4, n_layer=1, n_head=1, n_embd=4))
    import torch

    assert model(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3, 10)


def test_help_via_module_and_console_script() -> None:
    out = subprocess.run([sys.executable, "-m", "tinylm", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "usage: tinylm" in out
    script = Path(sys.executable).parent / "tinylm"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "usage: tinylm" in out


HIDE_NATIVE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tinylm.native" or name.startswith("tinylm.native."):
            raise ImportError(f"{name} is hidden for this test")
sys.meta_path.insert(0, Hide())
import torch
from tinylm import GPT, ModelConfig, acceleration, generate
from tinylm.use.evaluation import evaluate
assert acceleration.native is None
m = GPT(ModelConfig(vocab_size=17, context_length=16, n_layer=1, n_head=2, n_embd=32))
plan = acceleration.accelerate(m, "cpu")
assert plan.paths == frozenset()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
ids = torch.randint(0, 17, (4, 17), generator=torch.Generator().manual_seed(0))
first = m.loss(ids[:, :-1], ids[:, 1:])
for _ in range(5):
    opt.zero_grad()
    m.loss(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
assert m.loss(ids[:, :-1], ids[:, 1:]) < first
print(generate(m, [1, 2], 5, temperature=0).shape, evaluate(m, ids.flatten()).loss > 0)
assert not any(k.startswith("tinylm.native") for k in sys.modules)
"""


def test_tinylm_works_with_the_native_package_hidden() -> None:
    out = subprocess.run([sys.executable, "-c", HIDE_NATIVE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch.Size([1,", "7])", "True"]


# ``python -m tinylm ARGS`` that then fails (status 99) if any tinylm.native module was loaded.
RUN_CLI = """
import runpy, sys
sys.argv = ["tinylm", *sys.argv[1:]]
try:
    runpy.run_module("tinylm", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
loaded = [k for k in sys.modules if k.startswith("tinylm.native")]
print("loaded:", loaded, file=sys.stderr)
sys.exit(99 if loaded else code)
"""


def _copy_without_native(root: Path) -> Path:
    """src/tinylm copied under ``root`` with its native/ folder left out; returns ``root``."""
    shutil.copytree(SRC, root / "tinylm",
                    ignore=lambda folder, names: [n for n in names if n == "__pycache__"
                                                  or (Path(folder) == SRC and n == "native")])
    assert not (root / "tinylm" / "native").exists()
    return root


@pytest.mark.slow
def test_deleting_the_native_package_leaves_a_working_tinylm_and_suite(tmp_path: Path) -> None:
    src = _copy_without_native(tmp_path / "src")
    env = {**os.environ, "PYTHONPATH": str(src)}
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                              "no:cacheprovider", str(REPO / "tests")], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    assert "error" not in collect.stdout.splitlines()[-1].lower(), collect.stdout[-3000:]
    assert "the optional native package is absent" in collect.stdout  # skipped, not failed
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    data, run = tmp_path / "data", tmp_path / "run"
    commands = [
        ["prepare", "--input", str(text), "--out", str(data), "--context-length", "16",
         "--no-progress"],
        ["train", "--data", str(data), "--out", str(run), "--n-layer", "1", "--n-head", "2",
         "--n-embd", "16", "--context-length", "16", "--batch-size", "4", "--max-steps", "2",
         "--warmup-steps", "0", "--device", "cpu", "--no-progress", "-q"],
        ["sample", "--model", str(run), "--prompt", "the", "--max-new-tokens", "5",
         "--device", "cpu", "--seed", "1"],
    ]
    outputs = []
    for args in commands:
        done = subprocess.run([sys.executable, "-c", RUN_CLI, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (args[0], done.stderr)
        assert "loaded: []" in done.stderr, done.stderr
        outputs.append(done.stdout)
    assert (data / "meta.json").is_file() and (run / "latest").is_dir()
    assert "trained 2 steps" in outputs[1] and outputs[2].startswith("the")
