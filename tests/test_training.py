"""Training: config validation, schedule, exact resume after SIGKILL, DDP equality,
faults (NaN, SIGINT, bad config/data/output), metrics and plots."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinylm.cli import main
from tinylm.core.config import ModelConfig, TrainConfig, read_toml
from tinylm.core.errors import CheckpointError, ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.io.checkpoint import load_checkpoint, load_train_state, read_config
from tinylm.training import NonFiniteLossError, decay_groups, lr_at, read_metrics, train

MODEL = dict(n_layer=2, n_head=2, n_embd=32, context_length=32, dropout=0.1)
TRAIN = dict(batch_size=4, grad_accum=2, lr=3e-3, warmup_steps=3, max_steps=24, eval_every=8,
             eval_windows=4, save_every=5, log_every=1, seed=7, device="cpu")
# Values that depend on the clock, not on the computation.
TIMING_KEYS = ("tokens_per_s", "elapsed")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread here and in subprocesses (OMP_NUM_THREADS=1): the bitwise
    comparisons need the same reduction order, and a busy 2-core machine is faster so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus

    root = tmp_path_factory.mktemp("train-data")
    text = root / "text.txt"
    text.write_text(load_corpus("python-docs")[:40_000], encoding="utf-8")
    prepare(root / "prepared", [text], tokenizer="char", context_length=32, progress=False)
    return root / "prepared"


def _run(data_dir: Path, out: Path, model: dict | None = None, **train_changes):
    cfg = TrainConfig(**{**TRAIN, **train_changes})
    return train(ModelConfig(**(model or MODEL)), cfg, data_dir, out, progress=False)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "latest" / "model.safetensors"))


def _loss_log(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(run)]


@pytest.fixture(scope="module")
def reference_run(data_dir, tmp_path_factory) -> Path:
    """One uninterrupted run that several tests compare against."""
    out = tmp_path_factory.mktemp("ref") / "run"
    _run(data_dir, out)
    return out


# --- config and math ---------------------------------------------------------------------


@pytest.mark.parametrize("changes, field", [
    ({"lr": 0}, "lr"), ({"lr": float("nan")}, "lr"), ({"batch_size": 0}, "batch_size"),
    ({"grad_accum": 1.5}, "grad_accum"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"), ({"beta2": 1.0}, "beta2"),
    ({"optimizer": "sgd"}, "optimizer"), ({"grad_clip": -1}, "grad_clip"),
    ({"time_budget": 0}, "time_budget"), ({"compile": "yes"}, "compile"),
    ({"tokens_per_step": 4096, "grad_accum": 2}, "tokens_per_step"),
])
def test_train_config_rejects_bad_values(changes, field) -> None:
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**changes)


def test_train_config_json_round_trip_and_unknown_key() -> None:
    cfg = TrainConfig(lr=2e-3, time_budget=30.0)
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1e-3})


def test_lr_schedule_warmup_cosine_floor() -> None:
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)  # warm-up ends at the peak
    assert lr_at(10, **kw) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(60, **kw) == pytest.approx(0.55)  # halfway: (peak + floor) / 2
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)  # held at the floor
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # monotone decay
    assert lr_at(0, lr=1.0, warmup_steps=0, total_steps=100, min_lr_ratio=0.0) == 1.0
    # A warm-up longer than the run (e.g. --max-steps 30 with the default 100) just ramps.
    assert lr_at(29, lr=1.0, warmup_steps=100, total_steps=30,
                 min_lr_ratio=0.1) == pytest.approx(0.3)


def test_weight_decay_only_on_matrices() -> None:
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, context_length=8))
    decay, no_decay = decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in decay["params"]}
    named = dict(model.named_parameters())
    assert id(named["blocks.0.attn.qkv.weight"]) in ids
    assert id(named["blocks.1.ffn.down.weight"]) in ids
    for name in ("tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight",
                 "blocks.0.attn.qkv.bias", "final_norm.bias"):
        assert id(named[name]) not in ids
    # Every parameter exactly once (the tied LM head is the token embedding).
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_read_toml_routes_keys_and_rejects_unknown(tmp_path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("lr = 0.002\nn_layer = 3\n[train]\nbatch_size = 8\n[model]\nn_embd = 48\n")
    model, train_kw = read_toml(f)
    assert model == {"n_layer": 3, "n_embd": 48}
    assert train_kw == {"lr": 0.002, "batch_size": 8}
    f.write_text("learning_rate = 1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        read_toml(f)


# --- a run and its files -----------------------------------------------------------------


def test_run_folder_metrics_and_checkpoints(reference_run, data_dir) -> None:
    records = read_metrics(reference_run)
    train_records = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 25))
    for r in train_records:
        assert set(r) >= {"step", "train_loss", "lr", "grad_norm", "tokens_per_s", "elapsed"}
        assert math.isfinite(r["train_loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    assert train_records[0]["lr"] == pytest.approx(1e-3)  # warm-up step 1 of 3
    assert train_records[0]["train_loss"] > train_records[-1]["train_loss"]
    # Periodic estimates (a fixed random sample of windows) and the exact final value are
    # different measurements, kept under different keys.
    est_steps = [r["step"] for r in records if "val_loss_estimate" in r]
    assert est_steps == [8, 16, 24]  # periodic ones, then the final model's estimate
    assert [r["step"] for r in records if "val_loss" in r] == [24]
    assert records[-1]["final"] is True
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(records[-1]["val_loss"]))
    # The final val loss is the exact mean over the whole validation split.
    from tinylm.data import load_prepared
    from tinylm.use.evaluation import estimate_loss, evaluate, sample_windows

    model, tok = load_checkpoint(reference_run)  # a run folder resolves to latest/
    assert tok is not None and tok.vocab_size == model.config.vocab_size
    val = load_prepared(data_dir).val
    exact = evaluate(model, val).loss
    assert records[-1]["val_loss"] == pytest.approx(exact, rel=1e-6)
    # best/ is chosen like for like: the lowest estimate on the same sample.
    _tensors, meta = load_train_state(reference_run / "latest")
    estimates = [r["val_loss_estimate"] for r in records if "val_loss_estimate" in r]
    assert meta["step"] == 24 and meta["best_val_loss"] == pytest.approx(min(estimates))
    best = read_config(reference_run / "best")
    assert best["best"]["val_loss_estimate"] == pytest.approx(meta["best_val_loss"])
    starts = sample_windows(len(val), 32, TRAIN["eval_windows"], TRAIN["seed"])
    assert len(starts) == 4 and starts[-1] > 4 * 32  # spread over the split, not its head
    best_model, _ = load_checkpoint(reference_run / "best")
    again = estimate_loss(best_model, val, starts, context_length=32)
    assert again.loss == pytest.approx(best["best"]["val_loss_estimate"], rel=1e-5)
    assert read_config(reference_run)["train"]["lr"] == TRAIN["lr"]
    model_kw, train_kw = read_toml(reference_run / "run.toml")  # effective config, reusable
    assert model_kw["n_embd"] == 32 and train_kw["max_steps"] == 24
    assert (reference_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kill_and_resume_is_bitwise_exact(reference_run, data_dir, tmp_path) -> None:
    """SIGKILL at step 13 (checkpoint at 10), resume: same weights and loss log."""
    out = tmp_path / "run"
    script = textwrap.dedent("""
        import json, os, signal, sys
        from tinylm.core.config import ModelConfig, TrainConfig
        from tinylm.training import train

        def on_step(step):
            if step == 13:  # mid-way between the checkpoints at 10 and 15
                os.kill(os.getpid(), signal.SIGKILL)

        train(ModelConfig(**json.loads(sys.argv[1])), TrainConfig(**json.loads(sys.argv[2])),
              sys.argv[3], sys.argv[4], progress=False, on_step=on_step)
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(MODEL), json.dumps(TRAIN),
                           str(data_dir), str(out)], capture_output=True, text=True, timeout=120,
                          env=ENV)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert load_train_state(out / "latest")[1]["step"] == 10
    assert max(r["step"] for r in read_metrics(out)) == 12  # logged past the checkpoint
    with pytest.raises(CheckpointError, match="--resume"):
        _run(data_dir, out)  # an existing run is never overwritten
    result = train(ModelConfig(**MODEL), TrainConfig(**TRAIN), data_dir, out, resume=True,
                   progress=False)
    assert result.steps == 24 and result.stop_reason == "max_steps"
    ref, got = _weights(reference_run), _weights(out)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert _loss_log(out) == _loss_log(reference_run)


def test_ddp_two_ranks_equal_one_process_and_resume(data_dir, tmp_path) -> None:
    """torchrun with 2 gloo ranks of batch 2 == one process of batch 4, also when the
    2-rank run stops at step 4 and is resumed to step 6 (constant lr after warm-up, so
    the schedule does not depend on max_steps)."""
    model = {**MODEL, "dropout": 0.0}
    cfg = dict(TRAIN, max_steps=6, min_lr_ratio=1.0, eval_every=100, save_every=100,
               log_every=2)
    single = tmp_path / "single"
    train(ModelConfig(**model), TrainConfig(**cfg), data_dir, single, progress=False)
    flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--context-length", "32",
             "--dropout", "0", "--batch-size", "2", "--grad-accum", "2", "--lr", "3e-3",
             "--min-lr-ratio", "1", "--warmup-steps", "3", "--eval-every", "100",
             "--eval-windows", "4", "--save-every", "100", "--log-every", "2",
             "--seed", "7", "--device", "cpu"]
    ddp = tmp_path / "ddp"

    def torchrun(*extra: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", "2", "-m", "tinylm", "train", "--data", str(data_dir),
             "--out", str(ddp), *flags, *extra],
            capture_output=True, text=True, timeout=180, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = torchrun("--max-steps", "4")
    assert first.stdout.count("trained 4 steps") == 1  # only rank 0 reports
    assert load_train_state(ddp / "latest")[1]["world_size"] == 2
    torchrun("--max-steps", "6", "--resume")
    a, b = _weights(single), _weights(ddp)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    steps = [r["step"] for r in read_metrics(ddp) if "train_loss" in r]
    assert steps == [2, 4, 6]
    # The logged loss is the mean over ranks (rank 0's own half would differ).
    one = [r["train_loss"] for r in read_metrics(single) if "train_loss" in r]
    two = [r["train_loss"] for r in read_metrics(ddp) if "train_loss" in r]
    assert two == pytest.approx(one, rel=1e-5)


def test_torchrun_max_restarts_resumes_a_run_started_without_resume(data_dir,
                                                                    tmp_path) -> None:
    """Issue 11 item 6: rank 1 dies after the step-4 checkpoint of a run started without
    --resume; torchrun --max-restarts 1 restarts both workers, which resume from latest/
    on their own and end at step 12 with the weights of an uninterrupted run. (Each
    attempt joins with keys of its own: torchrun's store still holds the dead attempt's.)"""
    model = {**MODEL, "dropout": 0.0}
    cfg = dict(TRAIN, max_steps=12, eval_every=100, save_every=4, log_every=2)
    single = tmp_path / "single"
    train(ModelConfig(**model), TrainConfig(**cfg), data_dir, single, progress=False)
    ddp = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "--max-restarts", "1", str(Path(__file__).with_name("torchrun_crash_once.py")),
         "train", "--data", str(data_dir), "--out", str(ddp), "--n-layer", "2", "--n-head",
         "2", "--n-embd", "32", "--context-length", "32", "--dropout", "0", "--batch-size",
         "2", "--grad-accum", "2", "--lr", "3e-3", "--warmup-steps", "3", "--max-steps", "12",
         "--eval-every", "100", "--eval-windows", "4", "--save-every", "4", "--log-every",
         "2", "--seed", "7", "--device", "cpu"],
        capture_output=True, text=True, timeout=240, env={**ENV, "CRASH_AFTER": "4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(exitcode: 17) local_rank: 1" in proc.stderr, proc.stderr[-3000:]  # it died
    assert re.search(r"resum\w* from step (4|8)", proc.stderr), proc.stderr[-3000:]
    assert load_train_state(ddp / "latest")[1]["step"] == 12
    a, b = _weights(single), _weights(ddp)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


# --- faults --------------------------------------------------------------------------------


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    holder: dict = {}

    def poison(step: int) -> None:
        if step == 12:  # checkpoint at 10 exists; step 13's loss will be NaN
            with torch.no_grad():
                holder["model"].final_norm.weight.fill_(float("nan"))

    import tinylm.training.setup as training  # the setup phase builds the optimizer

    original = training.build_optimizer

    def capture(model, config, device):
        holder["model"] = model
        return original(model, config, device)

    training.build_optimizer = capture
    try:
        with pytest.raises(NonFiniteLossError, match="step 13") as info:
            train(ModelConfig(**MODEL), TrainConfig(**TRAIN), data_dir, out, progress=False,
                  on_step=poison)
    finally:
        training.build_optimizer = original
    assert "step 10" in str(info.value) and "--lr" in str(info.value)
    assert "--resume" in str(info.value) and "--grad-clip" not in str(info.value)  # clip is on
    assert load_train_state(out / "latest")[1]["step"] == 10
    for t in _weights(out).values():
        assert torch.isfinite(t).all()


def test_non_finite_loss_before_any_checkpoint_does_not_suggest_resume(data_dir,
                                                                        tmp_path) -> None:
    import tinylm.training.setup as training  # the setup phase builds the optimizer

    holder: dict = {}
    original = training.build_optimizer

    def capture(model, config, device):
        holder["model"] = model
        return original(model, config, device)

    def poison(step: int) -> None:
        if step == 1:
            with torch.no_grad():
                holder["model"].final_norm.weight.fill_(float("nan"))

    training.build_optimizer = capture
    try:
        with pytest.raises(NonFiniteLossError, match="no checkpoint had been written") as info:
            train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, grad_clip=0.0)), data_dir,
                  tmp_path / "run", progress=False, on_step=poison)
    finally:
        training.build_optimizer = original
    assert "--resume" not in str(info.value) and "--grad-clip" in str(info.value)


def test_sigint_saves_a_checkpoint_and_exits_cleanly(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tinylm", "train", "--data", str(data_dir), "--out", str(out),
           "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context-length", "32",
           "--batch-size", "4", "--max-steps", "100000", "--warmup-steps", "0",
           "--log-every", "1", "--eval-every", "100000", "--save-every", "100000",
           "--device", "cpu", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    deadline = time.monotonic() + 60
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.stat().st_size):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    assert stderr.count("interrupted") == 1, stderr  # said once
    step = load_train_state(out / "latest")[1]["step"]
    assert 1 <= step < 100000
    assert max(r["step"] for r in read_metrics(out)) == step


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_cli_errors_are_one_line_exit_2(data_dir, tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    base = ["train", "--data", str(data_dir), "--out", out, "--device", "cpu"]
    code, err = _cli(capsys, *base, "--lr", "-1")
    assert code == 2 and "lr must be" in err and len(err.strip().splitlines()) == 1
    code, err = _cli(capsys, *base, "--n-embd", "30", "--n-head", "4")
    assert code == 2 and "n_embd=30" in err
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train]\nbatchsize = 3\n")
    code, err = _cli(capsys, *base, "--config", str(bad_toml))
    assert code == 2 and "batchsize" in err
    code, err = _cli(capsys, "train", "--data", str(tmp_path / "nope"), "--out", out)
    assert code == 2 and "does not exist" in err and "tinylm prepare" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _cli(capsys, "train", "--data", str(empty), "--out", out)
    assert code == 2 and "meta.json" in err
    code, err = _cli(capsys, *base, "--context-length", "100000")
    assert code == 2 and "context_length" in err
    assert not Path(out, "latest").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = _cli(capsys, "train", "--data", str(data_dir), "--out", str(blocker / "run"),
                     "--device", "cpu", "--context-length", "32", "--n-layer", "1")
    assert code == 2 and "not writable" in err


def test_insufficient_disk_fails_before_training(data_dir, tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(CheckpointError, match="free"):
        _run(data_dir, tmp_path / "run")
    assert not (tmp_path / "run" / "latest").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_time_budget_and_compile_fallback(data_dir, tmp_path, monkeypatch, caplog) -> None:
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(torch, "compile", broken_compile)
    result = _run(data_dir, tmp_path / "run", max_steps=100000, warmup_steps=0,
                  time_budget=1.0, compile=True, log_every=5, eval_every=100000,
                  save_every=100000)
    assert result.stop_reason == "time_budget" and 0 < result.steps < 100000
    assert "torch.compile is not usable" in caplog.text
    assert result.final_val_loss is not None
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert lrs[-1] < TRAIN["lr"]  # the cosine was stretched over the budget


def test_a_time_budget_shorter_than_the_warmup_scales_the_warmup(data_dir, tmp_path,
                                                                   caplog) -> None:
    """Issue 36 item 5: `train --time-budget 30` with the defaults trained 14 steps and
    the lr peaked at 1.4e-4 (the 100-step warm-up never ended), silently. Each step here
    sleeps 80 ms, so a 1 s budget fits at most 12 of the default 100 warm-up steps."""
    cfg = TrainConfig(**{**TRAIN, "warmup_steps": 100, "max_steps": 2000, "time_budget": 1.0,
                         "grad_accum": 1, "eval_every": 100000, "save_every": 100000})
    result = train(ModelConfig(**MODEL), cfg, data_dir, tmp_path / "run", progress=False,
                   on_step=lambda step: time.sleep(0.08))
    assert result.stop_reason == "time_budget" and result.steps < cfg.warmup_steps
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert max(lrs) == pytest.approx(cfg.lr)  # the peak is reached, not 12 % of it
    assert lrs[-1] < cfg.lr  # and the cosine decays over the rest of the budget
    warnings = [m for m in (r.getMessage() for r in caplog.records)
                if "fewer than the warm-up" in m]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "time budget (1 s)" in warnings[0] and "(100 steps)" in warnings[0]


def test_a_budget_that_does_not_end_the_run_leaves_the_warmup(data_dir, tmp_path,
                                                                caplog) -> None:
    """--max-steps ends this run before its (long) budget: the warm-up is the user's."""
    cfg = TrainConfig(**{**TRAIN, "warmup_steps": 4, "max_steps": 3, "time_budget": 600.0,
                         "grad_accum": 1, "eval_every": 100000, "save_every": 100000})
    train(ModelConfig(**MODEL), cfg, data_dir, tmp_path / "run", progress=False)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert lrs == pytest.approx([cfg.lr * s / 4 for s in (1, 2, 3)])
    assert "fewer than the warm-up" not in caplog.text


def test_fitted_warmup_keeps_the_schedule_share() -> None:
    from tinylm.training.loop import fitted_warmup

    assert fitted_warmup(100, 2000, 14) == 1  # 5 % of 14 steps, at least one
    assert fitted_warmup(100, 200, 40) == 20  # half of the schedule warmed up: half of 40
    assert fitted_warmup(100, 100, 14) == 7  # a warm-up as long as the run: at most half
    assert fitted_warmup(30, 100, 3.6) == 1


def test_resume_via_cli_extends_a_finished_run(reference_run, data_dir, tmp_path,
                                               capsys) -> None:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    code = main(["train", "--data", str(data_dir), "--out", str(out), "--resume",
                 "--max-steps", "26", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert load_train_state(out / "latest")[1]["step"] == 26
    assert read_config(out)["train"]["max_steps"] == 26  # the effective config is saved
    code, err = _cli(capsys, "train", "--data", str(data_dir), "--out", str(out), "--resume",
                     "--n-embd", "64")
    assert code == 2 and "n_embd" in err


def test_plot_command_writes_png(reference_run, tmp_path, capsys) -> None:
    png = tmp_path / "cmp.png"
    assert main(["plot", str(reference_run), str(reference_run), "--out", str(png),
                 "--log-scale"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, err = _cli(capsys, "plot", str(tmp_path / "missing"), "--out", str(png))
    assert code == 2 and "metrics.jsonl" in err


def test_bad_data_errors(tmp_path) -> None:
    with pytest.raises(DataError):
        _run(tmp_path / "missing", tmp_path / "run")


# --- the save protocol, recovery and the run folder ------------------------------------------

SHORT = dict(TRAIN, max_steps=6, save_every=2, eval_every=100, grad_accum=1, log_every=1)
TINY = dict(MODEL, n_layer=1)


def _weights_equal(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_kill_at_every_point_of_the_save_protocol_resumes_bitwise(data_dir, tmp_path,
                                                                 monkeypatch) -> None:
    """SIGKILL before each file operation of the last save of latest/ (step 4, replacing
    the checkpoint of step 2): resume continues from the newest complete checkpoint (step
    2, or the finished step 4) and ends bitwise equal to an uninterrupted run."""
    import tinylm.io.checkpoint_files as ck
    import tinylm.training.loop as training

    monkeypatch.setattr(training, "_redraw", lambda run: None)  # the plot is not the point
    cfg = TrainConfig(**dict(SHORT, max_steps=4))

    def run(out: Path, **kw):
        return train(ModelConfig(**TINY), cfg, data_dir, out, progress=False, **kw)

    saves: list[list[str]] = []

    def record(label: str) -> None:
        if label.startswith("mkdir tmp"):
            saves.append([label])
        else:
            saves[-1].append(label)

    ref = tmp_path / "ref"
    ck._before_file_op = record
    try:
        run(ref)
    finally:
        ck._before_file_op = None
    assert [s[0] for s in saves] == ["mkdir tmp for latest", "mkdir tmp for best",
                                     "mkdir tmp for latest"]
    points = saves[2]
    assert points[1:] == ["write model.safetensors", "write tokenizer.json",
                          "write train_state.safetensors", "write train_state.json",
                          "write config.json", "fsync tmp", "rename dest to old",
                          "rename tmp to dest", "fsync parent", "remove old"]
    for k in range(len(points)):
        out = tmp_path / f"kill-{k}"
        pid = os.fork()
        if pid == 0:  # the child trains and dies before operation k of that save
            try:
                count = {"latest": 0, "ops": 0}

                def die(label: str, count=count, k=k) -> None:
                    count["latest"] += label == "mkdir tmp for latest"
                    if count["latest"] == 2:
                        if count["ops"] == k:
                            os.kill(os.getpid(), signal.SIGKILL)
                        count["ops"] += 1

                ck._before_file_op = die
                run(out)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
        result = run(out, resume=True)
        complete = k > points.index("write config.json")  # the new checkpoint was whole
        assert result.resumed_from == (4 if complete else 2), (k, points[k])
        assert result.stop_reason == ("finished" if complete else "max_steps")
        assert result.steps == 4
        _weights_equal(ref, out)
        assert _loss_log(out) == _loss_log(ref), k
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_an_interrupted_save_is_recovered_on_load(data_dir, tmp_path, caplog) -> None:
    """latest/ gone with complete copies beside it: the newest wins, said in one line, on any
    load (here load_checkpoint) — and without them, best/ is pointed to."""
    out = tmp_path / "run"
    train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2, eval_every=2)), data_dir,
          out, progress=False)
    latest = out / "latest"
    os.rename(latest, out / ".latest.old-999999999")  # a dead writer's previous copy
    import shutil

    shutil.copytree(out / ".latest.old-999999999", out / ".latest.tmp-999999998-x")
    os.remove(out / ".latest.tmp-999999998-x" / "config.json")  # incomplete: never used
    (out / ".metrics.jsonl.tmp-abc").write_text("torn")  # a killed atomic write's temporary
    model, _ = load_checkpoint(out)
    assert latest.is_dir() and sorted(p.name for p in out.iterdir() if p.name.startswith(
        ".latest")) == []
    assert "recovered" in caplog.text and ".latest.old-999999999" in caplog.text
    shutil.rmtree(latest)
    with pytest.raises(CheckpointError, match="best/ beside it"):
        load_checkpoint(out)
    with pytest.raises(CheckpointError, match="would overwrite best/"):  # and tidies up
        train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2)), data_dir, out,
              progress=False)
    assert not (out / ".metrics.jsonl.tmp-abc").exists()
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="afile.txt is a file, not a checkpoint folder"):
        load_checkpoint(afile)


def test_run_folder_lock_refuses_a_live_writer_and_ignores_a_dead_one(data_dir,
                                                                      tmp_path) -> None:
    from tinylm.io.files import FolderBusyError

    out = tmp_path / "run"
    out.mkdir()
    script = ("import fcntl, os, sys, time\n"
              "f = open(os.path.join(sys.argv[1], '.lock'), 'w')\n"
              "fcntl.flock(f, fcntl.LOCK_EX)\n"
              "f.write(str(os.getpid())); f.flush(); print('locked', flush=True)\n"
              "time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderBusyError, match=f"in use by pid {holder.pid}"):
            train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2)), data_dir, out,
                  progress=False)
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # The holder died: its .lock file remains, but the OS lock went with it.
    result = train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2)), data_dir, out,
                   progress=False)
    assert result.steps == 2


def test_resume_decisions(data_dir, tmp_path, caplog, capsys) -> None:
    """--resume with nothing says what it looked for; --resume auto starts; a real resume
    says where it starts; a finished run changes nothing."""
    import logging

    caplog.set_level(logging.INFO)
    cfg = TrainConfig(**dict(SHORT, max_steps=2))
    out = tmp_path / "typo"
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*looked for .*latest"):
        train(ModelConfig(**TINY), cfg, data_dir, out, resume=True, progress=False)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CheckpointError, match="metrics.jsonl of a run stopped before"):
        train(ModelConfig(**TINY), cfg, data_dir, out, resume=True, progress=False)
    assert train(ModelConfig(**TINY), cfg, data_dir, out, resume="auto",
                 progress=False).resumed_from is None
    more = TrainConfig(**dict(SHORT, max_steps=3))
    result = train(ModelConfig(**TINY), more, data_dir, out, resume="auto", progress=False)
    assert result.resumed_from == 2 and "resuming from step 2" in caplog.text
    files = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    again = train(ModelConfig(**TINY), more, data_dir, out, resume=True, progress=False)
    assert again.stop_reason == "finished" and again.steps == 3
    assert {p.name: p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.name != ".lock"} == files  # nothing changed
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--resume",
                 "--max-steps", "3"]) == 0
    assert "already finished at step 3; nothing changed" in capsys.readouterr().out


def test_resume_mode_follows_torchrun_restarts(monkeypatch) -> None:
    from tinylm.training import resume_mode

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume_mode(None) is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_mode(None) is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert resume_mode(None) == "auto" and resume_mode(True) is True
    with pytest.raises(ConfigError):
        resume_mode("yes")


def test_resume_refuses_data_with_another_tokenizer(reference_run, data_dir, tmp_path) -> None:
    """Same size, different ids: refused by content hash, and the message says what differs."""
    import shutil

    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus
    from tinylm.data.tokenizers import STANDARD_SPECIALS

    text = load_corpus("python-docs")[:40_000]
    present = sorted(set(text))
    absent = next(c for c in "~^`|" if c not in present)
    swapped = tmp_path / "swapped.txt"
    swapped.write_text(text.replace(present[-1], absent), encoding="utf-8")
    other = prepare(tmp_path / "other", [swapped], tokenizer="char", context_length=32,
                    progress=False)
    assert other.vocab_size == len(present) + len(STANDARD_SPECIALS)  # chars + end-of-text, chat
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    with pytest.raises(DataError, match=r"token ids map to different strings, e\.g\. id"):
        train(ModelConfig(**MODEL), TrainConfig(**dict(TRAIN, max_steps=30)), tmp_path / "other",
              out, resume=True, progress=False)
    model, tok = load_checkpoint(reference_run)  # fine-tuning checks the same way
    with pytest.raises(DataError, match="different strings"):
        train(model.config, TrainConfig(**dict(TRAIN, max_steps=2)), tmp_path / "other",
              tmp_path / "ft", model=model, model_tokenizer=tok, progress=False)
    assert not (tmp_path / "ft").exists()


def test_token_ids_outside_the_vocabulary_are_refused(data_dir, tmp_path) -> None:
    import shutil

    import numpy as np

    from tinylm.data import load_prepared

    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    data = load_prepared(bad)
    shard = sorted(bad.glob("train*.bin"))[0]  # train.bin, or the first train-NNNNN.bin
    ids = np.memmap(shard, dtype=data.dtype, mode="r+")
    ids[100] = data.vocab_size + 5
    ids.flush()
    del ids
    with pytest.raises(DataError, match=f"token id {data.vocab_size + 5}, outside the vocab"):
        train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2)), bad,
              tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "latest").exists()


def test_disk_full_is_one_line_with_the_path(data_dir, tmp_path, monkeypatch, capsys) -> None:
    import errno

    import tinylm.io.checkpoint_files as ck
    from tinylm.io.files import DiskFullError
    from tinylm.training.runlog import MetricsLog

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetricsLog, "_append", full)
    with pytest.raises(DiskFullError, match=r"disk full while writing .*metrics\.jsonl"):
        train(ModelConfig(**TINY), TrainConfig(**dict(SHORT, max_steps=2)), data_dir,
              tmp_path / "a", progress=False)
    monkeypatch.undo()

    def safetensors_full(*args, **kwargs):  # what safetensors raises: not an OSError
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: "
                           "StorageFull, message: \"No space left on device\" }) (os error 28)")

    monkeypatch.setattr(ck, "save_file", safetensors_full)
    code = main(["train", "--data", str(data_dir), "--out", str(tmp_path / "b"), "--max-steps",
                 "2", "--save-every", "1", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                 "--context-length", "32", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("tinylm train: error: disk full while writing")
    assert "latest/model.safetensors" in err[-1]
    assert not [p for p in (tmp_path / "b").iterdir() if ".tmp-" in p.name]


# --- the library entry for fine-tuning: loss masks and frozen parameters ----------------------


class _Masked:
    """Prepared data plus loss masks (the TrainData protocol)."""

    def __init__(self, data, train_mask, val_mask=None) -> None:
        self.tokenizer, self.train, self.val, self.dir = data.tokenizer, data.train, data.val, \
            data.dir
        self.train_mask, self.val_mask = train_mask, val_mask


def test_loss_mask_and_frozen_parameters(data_dir, tmp_path) -> None:
    import numpy as np

    from tinylm.data import load_prepared
    from tinylm.training.batches import draw_batch
    from tinylm.training.distributed import DistContext

    data = load_prepared(data_dir)
    cfg = TrainConfig(**dict(SHORT, max_steps=3, save_every=100))
    # A mask of ones trains exactly like no mask (same batches, same mean).
    plain = train(ModelConfig(**TINY), cfg, data_dir, tmp_path / "plain", progress=False)
    ones = _Masked(data, np.ones(len(data.train), np.uint8), np.ones(len(data.val), np.uint8))
    train(ModelConfig(**TINY), cfg, ones, tmp_path / "ones", progress=False)
    _weights_equal(plain.out_dir, tmp_path / "ones")
    # Masked targets become the ignore index exactly where the mask is 0.
    mask = (np.arange(len(data.train)) % 3 != 0).astype(np.uint8)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    x, y = draw_batch(data.train, mask, 4, 32, g1, DistContext(), torch.device("cpu"))
    starts = torch.randint(len(data.train) - 32, (4,), generator=g2).numpy()
    pos = starts[:, None] + 1 + np.arange(32)
    assert torch.equal(y == -100, torch.from_numpy(mask[pos] == 0))
    assert torch.equal(y[y != -100], torch.from_numpy(data.train[pos].astype(np.int64))[y != -100])
    # An all-masked batch is an error, not a NaN.
    zeros = _Masked(data, np.zeros(len(data.train), np.uint8))
    with pytest.raises(DataError, match="no target with loss mask 1"):
        train(ModelConfig(**TINY), cfg, zeros, tmp_path / "zeros", progress=False)
    # Only parameters with requires_grad=True change.
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**TINY, "vocab_size": data.vocab_size}))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if not n.startswith("blocks.0.ffn")}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model.config, cfg, data_dir, tmp_path / "frozen", model=model, progress=False)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        else:
            assert not torch.equal(p, before[n]), n


def test_train_gives_the_callers_model_its_own_classes_back(data_dir, tmp_path) -> None:
    """train() swaps the native fast paths' subclasses into the model it trains and
    undoes that when it returns and when it raises (as evaluate does): every module of
    the caller's model has its own class again."""
    from tinylm import acceleration
    from tinylm.data import load_prepared

    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**TINY, "vocab_size": load_prepared(data_dir).vocab_size}))
    before = [type(m) for m in model.modules()]
    during: list[bool] = []

    def look(step: int) -> None:
        during.append([type(m) for m in model.modules()] != before)

    cfg = TrainConfig(**dict(SHORT, max_steps=2, save_every=100))
    train(model.config, cfg, data_dir, tmp_path / "a", model=model, progress=False,
          on_step=look)
    assert [type(m) for m in model.modules()] == before
    if acceleration.plan(model, "cpu").paths & {"block", "attention", "ffn"}:
        assert during == [True, True]  # the fast paths were on while it trained

    def crash(step: int) -> None:
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model.config, cfg, data_dir, tmp_path / "b", model=model, progress=False,
              on_step=crash)
    assert [type(m) for m in model.modules()] == before


# --- hints, the CLI's rough edges -------------------------------------------------------------


def test_cli_hints_and_switches(reference_run, data_dir, tmp_path, capsys, caplog) -> None:
    code, err = _cli(capsys, "train", "--data", str(reference_run), "--out", str(tmp_path / "x"))
    assert code == 2 and "is a training run or checkpoint folder, not prepared data" in err
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, err = _cli(capsys, "train", "--data", str(data_dir), "--out", str(afile))
    assert code == 2 and "is a file, not a folder" in err and afile.read_text() == "mine"
    # --time-budget 0 switches off a config file's budget; a too-long warm-up is said.
    toml = tmp_path / "run.toml"
    toml.write_text("time_budget = 1000.0\nmax_steps = 2\n")
    out = tmp_path / "run"
    code = main(["train", "--data", str(data_dir), "--out", str(out), "--config", str(toml),
                 "--time-budget", "0", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                 "--context-length", "32", "--device", "cpu", "--no-progress",
                 "--threads", "1"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "time_budget" not in (out / "run.toml").read_text()
    assert read_config(out)["train"]["threads"] == 1
    assert "warm-up (warmup_steps 100) is as long as the run (max_steps 2)" in caplog.text
    assert f"loss curve: {out / 'loss.png'}" in printed
    for line in printed.splitlines():  # every printed path exists
        for word in line.split():
            if word.startswith(str(tmp_path)):
                assert Path(word.rstrip(")")).exists(), line


def test_no_loss_curve_is_printed_without_matplotlib(data_dir, tmp_path, capsys,
                                                     monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    code = main(["train", "--data", str(data_dir), "--out", str(tmp_path / "run"),
                 "--max-steps", "2", "--eval-every", "1", "--n-layer", "1", "--n-embd", "32",
                 "--n-head", "2", "--context-length", "32", "--device", "cpu",
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0 and "loss curve" not in captured.out
    assert not (tmp_path / "run" / "loss.png").exists()
    assert captured.err.count("loss.png not drawn") <= 1


def test_plot_formats_and_a_folder_as_out(reference_run, tmp_path, capsys) -> None:
    svg = tmp_path / "cmp.svg"
    assert main(["plot", str(reference_run), "--out", str(svg), "--log-scale"]) == 0
    assert b"<svg" in svg.read_bytes()[:500]
    code, err = _cli(capsys, "plot", str(reference_run), "--out", str(tmp_path / "x.jpg"))
    assert code == 2 and ".jpg" in err and not (tmp_path / "x.jpg").exists()
    folder = tmp_path / "figs"
    folder.mkdir()
    code, err = _cli(capsys, "plot", str(reference_run), "--out", str(folder))
    assert code == 2 and "is a folder" in err and err.count("\n") == 1
    assert list(folder.iterdir()) == [] and not [p for p in tmp_path.iterdir()
                                                 if ".tmp-" in p.name]


def test_throughput_collapse_is_said_once(caplog, monkeypatch) -> None:
    from tinylm.training.runlog import Progress, Throughput

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    watch, bar = Throughput(), Progress(True, False)
    for tok_s in (900.0, 1000.0, 1000.0, 1100.0, 200.0, 100.0, 50.0):
        watch.watch(tok_s, bar)
    assert caplog.text.count("throughput fell to") == 1
    assert "200 tokens/s from 1,100" in caplog.text
    assert "4 threads here): stop the other jobs or use fewer threads (--threads 2)" \
        in caplog.text


def test_throughput_warning_speaks_of_one_thread_and_suggests_no_value_in_use() -> None:
    """Issue 36 item 10: it said "1 threads" and suggested --threads 1 to a run on one."""
    from tinylm.training.runlog import slow_message

    one = slow_message(200.0, 1100.0, 3.5, 1, 1)
    assert "1 CPU, 1 thread here): stop the other jobs" in one and one.endswith("other jobs")
    assert "threads" not in one and "--threads" not in one
    two = slow_message(200.0, 1100.0, 3.5, 2, 2)
    assert two.endswith("2 CPUs, 2 threads here): stop the other jobs or use fewer threads "
                        "(--threads 1)")
    for threads in range(1, 17):
        text = slow_message(1.0, 9.0, 1.0, 16, threads)
        assert f"--threads {threads})" not in text and "\n" not in text


def test_no_function_over_60_lines_in_the_training_room() -> None:
    """Every module of tinylm.training (and the export command) under 800 lines, every
    function under 60, so each reads in one breath."""
    import ast

    import tinylm

    root = Path(tinylm.__file__).parent
    files = sorted((root / "training").glob("*.py")) + [root / "commands" / "export.py"]
    long = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 800, path
        long += [f"{path.stem}.{n.name} ({n.end_lineno - n.lineno + 1})"
                 for n in ast.walk(ast.parse(text))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_a_zero_column_terminal_gets_log_lines_not_a_bar(monkeypatch) -> None:
    import os as _os
    import shutil

    from tinylm.training.runlog import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=None: _os.terminal_size(
        (0, 0)))
    assert Progress(True, None).use_bar is False
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=None: _os.terminal_size(
        (120, 40)))
    assert Progress(True, None).use_bar is True


def test_default_threads_keep_every_core_on_a_quiet_machine(monkeypatch) -> None:
    from tinylm.core import config as cfg

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cfg, "available_cpus", lambda: 2)
    for load, want in [(0.0, 2), (0.9, 2), (1.2, 1), (5.0, 1)]:
        monkeypatch.setattr(cfg.os, "getloadavg", lambda load=load: (load, load, load))
        assert cfg.default_threads() == want, load
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cfg.default_threads() == 3


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_an_untied_token_embedding_trains_at_its_own_lr_ratio(optimizer: str) -> None:
    """AdamW's first step moves each looked-up row by lr·g/(|g| + eps) ≈ ±lr per
    element: ratio × lr for an untied token embedding; a tied one is the head and keeps
    the lr (its groups are unchanged)."""
    from tinylm.training import build_optimizer, set_lr

    cfg = dict(vocab_size=23, n_layer=1, n_head=2, n_embd=16, context_length=8, dropout=0.0)
    ids = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(0))
    moved = {}
    for tie, ratio in ((False, 1.0), (False, 10.0), (True, 10.0)):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**cfg, tie_embeddings=tie))
        train_cfg = TrainConfig(lr=1e-3, weight_decay=0.0, optimizer=optimizer,
                                embedding_lr_ratio=ratio)
        opt = build_optimizer(model, train_cfg, torch.device("cpu"))
        ratios = [g.get("lr_ratio", 1.0) for g in opt.param_groups]
        assert ratios.count(ratio) == (1 if ratio != 1.0 and not tie else 0 if ratio != 1.0
                                       else len(ratios))
        set_lr(opt, 1e-3)
        before = model.tok_emb.weight.detach().clone()
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        opt.step()
        moved[tie, ratio] = (model.tok_emb.weight.detach() - before).abs().max().item()
    assert moved[False, 1.0] == pytest.approx(1e-3, rel=1e-3)
    assert moved[False, 10.0] == pytest.approx(1e-2, rel=1e-3)
    assert moved[True, 10.0] == pytest.approx(1e-3, rel=1e-3)  # tied: the head's lr
    with pytest.raises(ConfigError, match="embedding_lr_ratio"):
        TrainConfig(embedding_lr_ratio=0)
