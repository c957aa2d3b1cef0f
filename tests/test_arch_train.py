"""Training with architecture variants: presets from the CLI (flags override), exact
resume after SIGKILL (bitwise), 2-rank DDP equal to one process, and bad flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinylm.cli import main
from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.io.checkpoint import load_train_state, read_config
from tinylm.training import read_metrics, train

MODEL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, context_length=32, dropout=0.1,
             norm="rmsnorm", position="rope", mlp="swiglu", qk_norm=True, bias=False,
             tie_embeddings=False)
TRAIN = dict(batch_size=4, lr=3e-3, warmup_steps=3, max_steps=12, eval_every=6,
             eval_windows=2, save_every=5, log_every=1, seed=7, device="cpu")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons need one reduction order
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus

    root = tmp_path_factory.mktemp("arch-data")
    text = root / "text.txt"
    text.write_text(load_corpus("python-docs")[:20_000], encoding="utf-8")
    prepare(root / "prepared", [text], tokenizer="char", context_length=32, progress=False)
    return root / "prepared"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "latest" / "model.safetensors"))


def _log(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed")}
            for r in read_metrics(run)]


def test_variant_kill_and_resume_is_bitwise_exact(data_dir, tmp_path) -> None:
    ref = tmp_path / "ref"
    train(ModelConfig(**MODEL), TrainConfig(**TRAIN), data_dir, ref, progress=False)
    out = tmp_path / "run"
    script = textwrap.dedent("""
        import json, os, signal, sys
        from tinylm.core.config import ModelConfig, TrainConfig
        from tinylm.training import train

        def on_step(step):
            if step == 7:  # between the checkpoints at 5 and 10
                os.kill(os.getpid(), signal.SIGKILL)

        train(ModelConfig(**json.loads(sys.argv[1])), TrainConfig(**json.loads(sys.argv[2])),
              sys.argv[3], sys.argv[4], progress=False, on_step=on_step)
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(MODEL), json.dumps(TRAIN),
                           str(data_dir), str(out)], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert load_train_state(out / "latest")[1]["step"] == 5
    train(ModelConfig(**MODEL), TrainConfig(**TRAIN), data_dir, out, resume=True,
          progress=False)
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys() and "blocks.0.ffn.gate.weight" in a
    assert "pos_emb.weight" not in a and "blocks.0.attn.q_norm.weight" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert _log(out) == _log(ref)


def test_ddp_two_ranks_with_a_variant_equal_one_process(data_dir, tmp_path) -> None:
    model = dict(MODEL, dropout=0.0, n_layer=1)
    cfg = dict(TRAIN, max_steps=3, min_lr_ratio=1.0, eval_every=100, save_every=100,
               log_every=1, grad_accum=2)
    single = tmp_path / "single"
    train(ModelConfig(**model), TrainConfig(**cfg), data_dir, single, progress=False)
    flags = ["--arch", "llama", "--qk-norm", "--n-kv-head", "2", "--n-layer", "1",
             "--n-head", "4", "--n-embd", "32", "--context-length", "32", "--dropout", "0",
             "--batch-size", "2", "--grad-accum", "2", "--lr", "3e-3", "--min-lr-ratio", "1",
             "--warmup-steps", "3", "--max-steps", "3", "--eval-every", "100",
             "--eval-windows", "2", "--save-every", "100", "--log-every", "1", "--seed", "7",
             "--device", "cpu"]
    ddp = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "-m", "tinylm", "train", "--data", str(data_dir), "--out", str(ddp), *flags],
        capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_config(ddp / "latest")["model"] == read_config(single / "latest")["model"]
    a, b = _weights(single), _weights(ddp)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_cli_preset_fills_fields_and_flags_override(data_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--arch", "modern",
                 "--mlp", "gelu", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
                 "--context-length", "32", "--batch-size", "2", "--max-steps", "2",
                 "--eval-every", "2", "--eval-windows", "1", "--save-every", "2",
                 "--warmup-steps", "0", "--device", "cpu", "--no-progress"]) == 0
    cfg = read_config(out / "latest")["model"]
    assert (cfg["norm"], cfg["position"], cfg["qk_norm"], cfg["bias"], cfg["mlp"]) == (
        "rmsnorm", "rope", True, False, "gelu")


@pytest.mark.parametrize("flags, field", [
    (["--n-head", "4", "--n-kv-head", "3"], "n_kv_head"),
    (["--arch", "llama", "--n-head", "2", "--n-embd", "10"], "head_dim"),
    (["--norm", "batchnorm"], "norm"),
])
def test_bad_variant_flags_are_one_line_and_write_nothing(data_dir, tmp_path, capsys, flags,
                                                          field) -> None:
    out = tmp_path / "run"
    assert main(["train", "--data", str(data_dir), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1
    assert not out.exists()
