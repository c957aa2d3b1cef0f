"""tinylm.training.heap: a CPU training process keeps the memory its steps free.

The oracle is the kernel's own count of page faults (getrusage's minor faults) during
training steps of a small model (4 layers, E=128, 12 windows of 64: the shape of
benchmarks/train.py's 4×128 row): with glibc's defaults the heap is handed back at the end
of every step and its pages fault again in the next (thousands over a few steps); kept, the steps
reuse them. Each case runs in a fresh process: malloc's settings belong to the process
and cannot be undone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tinylm.cli import main
from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.core.errors import ConfigError
from tinylm.training import heap, setup, train

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
import json, resource, torch
from tinylm import native
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.training import heap
kept = heap.keep_freed_memory()  # where tinylm.training's setup calls it: before the model
torch.manual_seed(0)
model = GPT(ModelConfig(vocab_size=65, context_length=64, n_layer=4, n_head=4, n_embd=128,
                        dropout=0.0))
native.accelerate(model, "cpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 65, (12, 65))
faults = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad(set_to_none=True)
    model.loss(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k != "TINYLM_HEAP" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's malloc's")
def test_kept_heap_training_steps_reuse_their_pages() -> None:
    kept, default = _probe(), _probe(TINYLM_HEAP="default")
    assert kept["kept"] is True and default["kept"] is False
    # after the first steps (which map what the run needs), glibc's default hands pages
    # back and faults them in again: 7,000-25,000 over these 27 steps here; kept, the
    # steps reuse them (0-350 faults in all, the odd small block)
    assert sum(default["faults"][3:]) > 3000, default
    assert sum(kept["faults"][3:]) < 1000, kept


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's malloc's")
def test_the_users_own_malloc_settings_are_left_alone() -> None:
    assert _probe(MALLOC_TRIM_THRESHOLD_="131072")["kept"] is False
    assert _probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["kept"] is False


def test_a_bad_tinylm_heap_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TINYLM_HEAP", "huge")
    with pytest.raises(ConfigError, match="TINYLM_HEAP='huge'.*keep, default"):
        heap.keep_freed_memory()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus

    root = tmp_path_factory.mktemp("heap-data")
    text = root / "text.txt"
    text.write_text(load_corpus("python-docs")[:20_000], encoding="utf-8")
    prepare(root / "prepared", [text], tokenizer="char", context_length=16, progress=False)
    return root / "prepared"


def test_a_cpu_training_run_keeps_its_heap(data_dir, tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(setup.heap, "keep_freed_memory", lambda: calls.append(1) or True)
    train(ModelConfig(n_layer=1, n_head=2, n_embd=16, context_length=16),
          TrainConfig(batch_size=2, max_steps=2, eval_every=2, eval_windows=2,
                      device="cpu"), data_dir, tmp_path / "run", progress=False)
    assert calls == [1]


def test_train_with_a_bad_tinylm_heap_says_so_in_one_line(data_dir, tmp_path, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.setenv("TINYLM_HEAP", "huge")
    code = main(["train", "--data", str(data_dir), "--out", str(tmp_path / "run"),
                 "--max-steps", "1", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "TINYLM_HEAP='huge'" in err, err
    assert not (tmp_path / "run" / "latest").exists()
