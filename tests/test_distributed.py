"""Issue 18: --strategy fsdp|zero1 under torchrun (gloo, CPU), sharded checkpoints,
export to an ordinary checkpoint, elastic resume (2 -> 1 -> 3 ranks), a SIGKILLed rank
restarted by torchrun, per-rank memory, and two torchrun "nodes" on 127.0.0.1.

What is compared, and how exactly:

* bitwise: a run resumed with the same number of ranks and strategy, and two nodes of
  one rank vs one node of two ranks (the same arithmetic in the same order);
* within rtol 1e-4 / atol 1e-5 (weights) and rel 1e-5 (logged loss): N ranks vs one
  process of the same global batch, and any resume with another number of ranks (the
  gradient is the same sum, reduced in another order). The data order is identical:
  the windows are drawn from one generator, a function of the windows drawn so far.

All runs here are launched once per world size (tests/dist_runs.py runs several in
one process group): torchrun's start-up dominates on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinylm.cli import main
from tinylm.commands.export import export_checkpoint
from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.checkpoint import is_sharded, load_checkpoint, load_train_state
from tinylm.training import read_metrics, train

HERE = Path(__file__).parent
MODEL = dict(n_layer=2, n_head=2, n_embd=32, context_length=32, dropout=0.0)
# 12 windows per step: 2 ranks x batch 2 x accum 3 = 1 x 2 x 6 = 3 x 2 x 2.
TRAIN = dict(batch_size=2, grad_accum=3, lr=3e-3, warmup_steps=3, min_lr_ratio=1.0,
             max_steps=4, eval_every=100, eval_windows=4, save_every=2, log_every=2, seed=7,
             device="cpu")
# A model whose optimizer state dominates (7M parameters, 64 tokens per step).
BIG = dict(n_layer=4, n_head=4, n_embd=384, context_length=32, dropout=0.0)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prepare(root: Path, chars: int) -> Path:
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus

    text = root / "text.txt"
    text.write_text(load_corpus("python-docs")[:chars], encoding="utf-8")
    prepare(root / "prepared", [text], tokenizer="char", context_length=32, progress=False)
    return root / "prepared"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return _prepare(tmp_path_factory.mktemp("dist-data"), 40_000)


def _single(data_dir: Path, out: Path, **changes) -> Path:
    cfg = {**TRAIN, "grad_accum": 6, **changes}
    train(ModelConfig(**MODEL), TrainConfig(**cfg), data_dir, out, progress=False)
    return out


def _spec(out: Path, model: dict | None = None, resume: bool = False, **changes) -> dict:
    return {"out": str(out), "model": model or MODEL, "train": {**TRAIN, **changes},
            "resume": resume}


def _torchrun(data_dir: Path, tmp: Path, runs: list[dict], nproc: int = 2,
              timeout: int = 240) -> None:
    spec = tmp / f"spec-{nproc}-{len(list(tmp.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"data": str(data_dir), "runs": runs}), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(nproc), str(HERE / "dist_runs.py"), str(spec)],
        capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _weights(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The whole weights of a run's latest/, through export-checkpoint when sharded."""
    latest = run / "latest"
    if not is_sharded(latest):
        return load_file(str(latest / "model.safetensors"))
    out = tmp / f"export-{run.name}-{load_train_state(latest)[1]['step']}"
    assert main(["export-checkpoint", str(run), "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


def _losses(run: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(run) if "train_loss" in r]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **TOL)


@pytest.fixture(scope="module")
def two_ranks(data_dir, tmp_path_factory) -> dict[str, Path]:
    """One torchrun of 2 ranks: the memory pair first (peak RSS only grows), then fsdp and
    zero1 with AdamW and Muon, 4 steps each."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    small = _prepare(tmp_path_factory.mktemp("small-data"), 6_000)  # a short final eval
    runs = {"mem_fsdp": dict(model=BIG, strategy="fsdp"),
            "mem_ddp": dict(model=BIG, strategy="ddp")}
    for strategy in ("fsdp", "zero1"):
        for optimizer in ("adamw", "muon"):
            runs[f"{strategy}_{optimizer}"] = dict(strategy=strategy, optimizer=optimizer)
    specs = []
    for name, kw in runs.items():
        big = kw.get("model") is BIG
        extra = dict(batch_size=1, grad_accum=1, max_steps=2, warmup_steps=1) if big else {}
        specs.append(_spec(tmp / name, kw.get("model"), strategy=kw["strategy"],
                           optimizer=kw.get("optimizer", "adamw"), **extra))
        if big:
            specs[-1]["data"] = str(small)
    _torchrun(data_dir, tmp, specs)
    return {name: tmp / name for name in runs}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_two_ranks_equal_one_process(two_ranks, data_dir, tmp_path, strategy,
                                     optimizer) -> None:
    run = two_ranks[f"{strategy}_{optimizer}"]
    latest = run / "latest"
    assert is_sharded(latest)
    shards = sorted((latest / "shards").iterdir())
    assert len(shards) == 2  # every rank wrote its own shard
    config = json.loads((latest / "config.json").read_text())
    assert config["sharded"] == {"strategy": strategy, "world_size": 2}
    assert not (latest / "model.safetensors").exists()
    single = _single(data_dir, tmp_path / "single", optimizer=optimizer)
    _assert_same_weights(_weights(single, tmp_path), _weights(run, tmp_path))
    assert _losses(run) == pytest.approx(_losses(single), rel=1e-5)
    assert [r["step"] for r in read_metrics(run) if "train_loss" in r] == [2, 4]
    # The final evaluation (under fsdp a collective of both ranks on the sharded model)
    final = [r["val_loss"] for r in read_metrics(run) if r.get("final")]
    assert final == pytest.approx([r["val_loss"] for r in read_metrics(single)
                                   if r.get("final")], rel=1e-5)
    # best/ is an ordinary checkpoint, whole, that every command reads.
    model, _ = load_checkpoint(run / "best")
    assert model.num_parameters() == load_checkpoint(single / "best")[0].num_parameters()


def test_fsdp_holds_less_per_rank_than_ddp(two_ranks) -> None:
    """The same 7M-parameter model, 2 ranks: fsdp's weights, gradients and AdamW moments
    per rank are half of ddp's (computed from the tensors each rank holds), and each
    rank's measured peak RSS is lower (asserted loosely: sharding saves ~68 MiB of state
    here; torch itself, the allocator, gloo buffers, every rank building the whole
    initial model and a block's gathered weights add noise)."""
    fsdp = load_train_state(two_ranks["mem_fsdp"] / "latest")[1]["memory"]
    ddp = load_train_state(two_ranks["mem_ddp"] / "latest")[1]["memory"]
    for rank in (0, 1):
        for key in ("weights_mib", "grads_mib", "optimizer_mib"):
            assert fsdp[key][rank] == pytest.approx(ddp[key][rank] / 2, rel=0.02), key
    saved = sum(ddp[k][1] - fsdp[k][1] for k in ("weights_mib", "grads_mib", "optimizer_mib"))
    assert saved > 40  # MiB: the model is large enough for the RSS to show it
    for rank in (0, 1):
        assert fsdp["peak_rss_mib"][rank] < ddp["peak_rss_mib"][rank], (fsdp, ddp)
    # zero1 shards the optimizer state only, by whole tensors (so not exactly halves).
    zero = load_train_state(two_ranks["zero1_adamw"] / "latest")[1]["memory"]
    small = load_train_state(two_ranks["fsdp_adamw"] / "latest")[1]["memory"]
    whole = sum(small["optimizer_mib"])
    assert sum(zero["optimizer_mib"]) == pytest.approx(whole, rel=0.01)
    assert max(zero["optimizer_mib"]) < 0.75 * whole
    assert zero["weights_mib"][0] == zero["weights_mib"][1] == pytest.approx(
        sum(small["weights_mib"]), rel=0.02)  # zero1 keeps the whole weights


def test_elastic_resume_2_to_1_to_3_ranks(two_ranks, data_dir, tmp_path) -> None:
    """The fsdp run saved by 2 ranks at step 4 continues in one process (accum 6) to step
    6, then with 3 ranks (accum 2) to step 8: the same loss curve and weights as one
    uninterrupted process. zero1's 2-rank checkpoint resumes in one process too."""
    run = tmp_path / "elastic"
    shutil.copytree(two_ranks["fsdp_adamw"], run)
    one = train(ModelConfig(**MODEL), TrainConfig(**{**TRAIN, "strategy": "fsdp",
                                                     "max_steps": 6}),
                data_dir, run, resume=True, progress=False)
    assert one.resumed_from == 4 and one.steps == 6
    state = load_train_state(run / "latest")[1]
    assert (state["world_size"], state["grad_accum"]) == (1, 6)
    assert is_sharded(run / "latest")  # one process still writes the sharded layout
    _torchrun(data_dir, tmp_path, [_spec(run, resume=True, strategy="fsdp", max_steps=8)],
              nproc=3)
    state = load_train_state(run / "latest")[1]
    assert (state["step"], state["world_size"], state["grad_accum"]) == (8, 3, 2)
    assert state["tokens_per_step"] == 12 * 32
    single = _single(data_dir, tmp_path / "single", max_steps=8)
    _assert_same_weights(_weights(single, tmp_path), _weights(run, tmp_path))
    assert _losses(run) == pytest.approx(_losses(single), rel=1e-5)
    zero = tmp_path / "zero1"
    shutil.copytree(two_ranks["zero1_adamw"], zero)
    train(ModelConfig(**MODEL), TrainConfig(**{**TRAIN, "strategy": "zero1", "max_steps": 6}),
          data_dir, zero, resume=True, progress=False)
    single6 = _single(data_dir, tmp_path / "single6", max_steps=6)
    _assert_same_weights(_weights(single6, tmp_path), _weights(zero, tmp_path))
    # A global batch that the new layout cannot split is refused before any step.
    with pytest.raises(ConfigError, match="global batch of 12 windows"):
        train(ModelConfig(**MODEL), TrainConfig(**{**TRAIN, "strategy": "fsdp",
                                                   "batch_size": 5, "max_steps": 10}),
              data_dir, run, resume=True, progress=False)
    assert load_train_state(run / "latest")[1]["step"] == 8  # nothing was lost


def test_same_world_resume_is_bitwise_and_export_is_resumable(data_dir,
                                                              tmp_path) -> None:
    """A sharded checkpoint resumed by the same layout (one process, fsdp layout) ends
    bitwise equal to an uninterrupted one; the exported checkpoint holds the whole
    optimizer state and resumes as an ordinary (ddp) run to the same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = {**TRAIN, "grad_accum": 6, "strategy": "fsdp"}
    train(ModelConfig(**MODEL), TrainConfig(**{**cfg, "max_steps": 6}), data_dir, a,
          progress=False)
    train(ModelConfig(**MODEL), TrainConfig(**cfg), data_dir, b, progress=False)
    train(ModelConfig(**MODEL), TrainConfig(**{**cfg, "max_steps": 6}), data_dir, b,
          resume=True, progress=False)
    wa, wb = _weights(a, tmp_path), _weights(b, tmp_path)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # export at step 4, put it as a run's latest/, resume with ddp: the same step 6.
    c = tmp_path / "c"
    train(ModelConfig(**MODEL), TrainConfig(**cfg), data_dir, c, progress=False)
    exported = tmp_path / "exported"
    assert main(["export-checkpoint", str(c), "--out", str(exported)]) == 0
    assert not is_sharded(exported)
    shutil.rmtree(c / "latest")
    shutil.copytree(exported, c / "latest")
    train(ModelConfig(**MODEL), TrainConfig(**{**cfg, "strategy": "ddp", "max_steps": 6}),
          data_dir, c, resume=True, progress=False)
    wc = load_file(str(c / "latest" / "model.safetensors"))
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    with pytest.raises(CheckpointError, match="already an ordinary checkpoint"):
        export_checkpoint(exported, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match="export-checkpoint"):
        load_checkpoint(a)  # a sharded checkpoint says how to consolidate it


def test_sigkilled_rank_restarts_and_ends_like_uninterrupted(data_dir, tmp_path) -> None:
    """fsdp, 2 ranks: rank 1 is SIGKILLed once latest/ holds step 4; torchrun
    --max-restarts 1 restarts both, they resume from the sharded latest/ and end at step
    8 with the weights of an uninterrupted run. Periodic evaluations (steps 3 and 6, a
    collective of both ranks) write best/ as an ordinary checkpoint."""
    run = tmp_path / "run"
    flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--context-length", "32",
             "--dropout", "0", "--batch-size", "2", "--grad-accum", "3", "--lr", "3e-3",
             "--warmup-steps", "3", "--min-lr-ratio", "1", "--max-steps", "8",
             "--eval-every", "3", "--eval-windows", "4", "--save-every", "2",
             "--log-every", "2", "--seed", "7", "--device", "cpu", "--strategy", "fsdp"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "--max-restarts", "1", str(HERE / "torchrun_crash_once.py"), "train",
         "--data", str(data_dir), "--out", str(run), *flags],
        capture_output=True, text=True, timeout=240,
        env={**ENV, "CRASH_AFTER": "4", "CRASH_SIGKILL": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(exitcode: -9) local_rank: 1" in proc.stderr, proc.stderr[-3000:]  # SIGKILL
    assert "resuming from step" in proc.stderr, proc.stderr[-3000:]
    assert load_train_state(run / "latest")[1]["step"] == 8
    estimates = [r["step"] for r in read_metrics(run) if "val_loss_estimate" in r]
    assert estimates[:2] == [3, 6]
    assert not is_sharded(run / "best") and load_checkpoint(run / "best")[0] is not None
    single = _single(data_dir, tmp_path / "single", max_steps=8)
    _assert_same_weights(_weights(single, tmp_path), _weights(run, tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_equal_one_node(two_ranks, data_dir, tmp_path) -> None:
    """Two torchrun agents (--nnodes 2, one rank each, c10d rendezvous on 127.0.0.1) train
    bitwise like one agent with two ranks (fsdp)."""
    spec = tmp_path / "spec.json"
    out = tmp_path / "nodes"
    spec.write_text(json.dumps({"data": str(data_dir),
                                "runs": [_spec(out, strategy="fsdp")]}), encoding="utf-8")
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
         "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", "tinylm-test", "--node-rank", str(rank),
         str(HERE / "dist_runs.py"), str(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for rank in (0, 1)]
    try:
        results = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), [r[1][-2000:] for r in results]
    one_node = _weights(two_ranks["fsdp_adamw"], tmp_path)
    two_nodes = _weights(out, tmp_path)
    assert all(torch.equal(one_node[k], two_nodes[k]) for k in one_node)
    assert _losses(out) == _losses(two_ranks["fsdp_adamw"])


@pytest.mark.parametrize("point", ["write tokenizer.json", "write config.json",
                                   "rename tmp to dest", "remove old"])
def test_a_kill_inside_a_sharded_save_keeps_one_complete_checkpoint(data_dir, tmp_path,
                                                                    point) -> None:
    """SIGKILL before a file operation of the step-4 sharded save (its shards already
    written by then): --resume finds step 2 until config.json is in the new folder, step 4
    after, and ends like an uninterrupted run (one process, fsdp layout)."""
    import signal

    import tinylm.io.checkpoint_files as ck

    cfg = TrainConfig(**{**TRAIN, "grad_accum": 6, "strategy": "fsdp"})
    out = tmp_path / "run"
    pid = os.fork()
    if pid == 0:  # the child trains and dies before ``point`` of the second latest/ save
        try:
            seen = {"latest": 0}

            def die(label: str) -> None:
                seen["latest"] += label == "mkdir tmp for latest"
                if seen["latest"] == 2 and label == point:
                    os.kill(os.getpid(), signal.SIGKILL)

            ck._before_file_op = die
            train(ModelConfig(**MODEL), cfg, data_dir, out, progress=False)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    result = train(ModelConfig(**MODEL), cfg, data_dir, out, resume=True, progress=False)
    whole = point in ("rename tmp to dest", "remove old")  # config.json was written
    assert result.resumed_from == (4 if whole else 2), point
    assert is_sharded(out / "latest")
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    if not whole:
        single = _single(data_dir, tmp_path / "single", strategy="fsdp")
        wa, wb = _weights(single, tmp_path), _weights(out, tmp_path)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_surviving_rank_reports_its_peers_death_in_one_line(data_dir, tmp_path) -> None:
    """Issue #32: rank 1 is SIGKILLed mid-run; rank 0's next collective fails inside gloo
    ("Read error ... Connection reset by peer"), which it reports in one line with exit
    status 2, not a raw gloo traceback. The two ranks get torchrun's environment
    directly: torchrun's agent would SIGTERM the survivor at a moment of its choosing."""
    port = _free_port()
    flags = ["train", "--data", str(data_dir), "--out", str(tmp_path / "run"), "--n-layer",
             "1", "--n-head", "2", "--n-embd", "16", "--context-length", "32",
             "--batch-size", "2", "--max-steps", "200", "--save-every", "2",
             "--log-every", "100", "--eval-every", "1000", "--device", "cpu"]
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RESTART_COUNT": "0", "CRASH_AFTER": "2", "CRASH_SIGKILL": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "torchrun_crash_once.py"), *flags], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -9  # SIGKILL
    err = results[0][1]
    assert procs[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err and "gloo" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("tinylm train: error: rank 0 of 2: "
                                                     "another rank of the run died"), err
    assert "--resume" in errors[0] and "--max-restarts" in errors[0]


def test_peer_lost_recognises_gloo_and_nccl_messages() -> None:
    from tinylm.training.distributed import DistContext, PeerLostError, reraise

    ctx = DistContext(rank=1, world_size=3)
    for text in ["[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10631: "
                 "Connection reset by peer. This is typically caused by a remote worker",
                 "[pair.cc:598] Connection closed by peer [10.0.0.2]:4242",
                 "NCCL error: remote process exited or there was a network error"]:
        with pytest.raises(PeerLostError, match="^rank 1 of 3: another rank") as info:
            reraise(RuntimeError(text), ctx)
        assert "\n" not in str(info.value) and info.value.__cause__ is None
    with pytest.raises(PeerLostError, match="from 127.0.0.1:10631"):
        reraise(RuntimeError("Read error [127.0.0.1]:10631"), ctx)
    for exc, where in [(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ctx),
                       (RuntimeError("Connection reset by peer"), DistContext()),  # 1 process
                       (ValueError("Connection reset by peer"), ctx)]:  # not a collective's
        with pytest.raises(type(exc)) as info:
            reraise(exc, where)
        assert info.value is exc
