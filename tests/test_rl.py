"""tinylm rl: the GRPO math against loops written here, the masking, a learning run on
a tiny model, exact resume after SIGKILL, and one-line errors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.training.grpo import group_advantages, policy_loss, token_logprobs
from tinylm.training.rl import RLConfig, rl
from tinylm.training.rollout import Sample, pack
from tinylm.use.rewards import pass_at_k


def test_advantages_match_a_loop():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0]])
    mean = group_advantages(r, "mean")
    std = group_advantages(r, "std", eps=1e-6)
    for p in range(3):
        m = sum(r[p].tolist()) / 4
        s = math.sqrt(sum((x - m) ** 2 for x in r[p].tolist()) / 4)
        for g in range(4):
            assert mean[p, g].item() == pytest.approx(r[p, g].item() - m, abs=1e-6)
            assert std[p, g].item() == pytest.approx((r[p, g].item() - m) / (s + 1e-6),
                                                     abs=1e-5)


def _reference_loss(logp, old, adv, mask, eps, ref, beta):
    total, n, kl_sum, clipped = 0.0, 0, 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[0])):
            if mask[i][t] == 0:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            c = min(max(ratio, 1 - eps), 1 + eps)
            term = -min(ratio * adv[i], c * adv[i])
            d = ref[i][t] - logp[i][t]
            k3 = math.exp(d) - d - 1
            total += term + beta * k3
            kl_sum += k3
            clipped += c != ratio
            n += 1
    return total / n, kl_sum / n, clipped / n


def test_clipped_objective_and_kl_match_a_loop():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.5)
    ref = logp + (torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]],
                        dtype=torch.float64)
    parts = policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.1)
    want, kl, frac = _reference_loss(logp.tolist(), old.tolist(), adv.tolist(),
                                     mask.tolist(), 0.2, ref.tolist(), 0.1)
    assert parts.loss.item() == pytest.approx(want, rel=1e-9)
    assert parts.kl.item() == pytest.approx(kl, rel=1e-9)
    assert parts.clip_fraction.item() == pytest.approx(frac)
    assert 0 < frac < 1  # both branches of the clip were exercised


def test_one_update_is_reinforce_with_the_group_baseline():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    policy_loss(logp, logp.detach(), adv, mask).loss.backward()
    want = torch.tensor([[-2.0, -2.0], [1.0, 0.0]]) / 3  # -A / tokens, masked
    assert torch.allclose(logp.grad, want)


def _tiny_model(tmp_path, seed=0):
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=?").with_special_tokens(
        STANDARD_SPECIALS)
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=2, n_head=2,
                      n_embd=32)
    path = save_checkpoint(tmp_path / "base", GPT(cfg), tok)
    return path, tok


def test_masking_gradient_reaches_only_completion_tokens(tmp_path):
    path, tok = _tiny_model(tmp_path)
    from tinylm.io.checkpoint import load_model
    model = load_model(path).train()
    samples = [Sample([1, 2, 3], [4, 5], "x"), Sample([1, 2], [6, 7, 8, 9], "y")]
    batch = pack(samples)
    assert batch.seq.tolist() == [[1, 2, 3, 4, 5, 0], [1, 2, 6, 7, 8, 9]]
    assert batch.mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    logits = model(batch.seq)
    logits.retain_grad()
    logp, _ = token_logprobs(logits, batch.seq)
    parts = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), batch.mask)
    parts.loss.backward()
    touched = logits.grad.abs().sum(-1)  # (N, T): which positions' predictions count
    # position t predicts token t + 1: only predictions of completion tokens get gradient
    want = [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]]
    assert (touched > 0).int().tolist() == want
    # the value: ratio 1 everywhere, so each counted token contributes -A; 6 tokens
    assert parts.loss.item() == pytest.approx((-1.0 * 2 + 1.0 * 4) / 6)


@dataclass(frozen=True)
class Rec:
    prompt: str
    answer: str
    data: dict


class LetterTask:
    """Reward: the share of the first 4 answer characters that are 'a' (learnable by a
    tiny model from its own samples in a few dozen steps)."""

    name = "letters"
    stop = ()

    def __init__(self):
        words = ["cat", "dog", "sun", "map", "pen", "box", "hat", "cup"]
        self.train = [Rec(w, "aaaa", {}) for w in words]
        self.held_out = [Rec(w + w, "aaaa", {}) for w in words[:4]]

    def reward(self, record, completion):
        head = completion[:4]
        return sum(c == "a" for c in head) / 4

    def correct(self, record, completion):
        return completion.startswith("aaaa")


def _cfg(**kw):
    base = dict(group_size=8, prompts_per_step=4, max_new_tokens=6, lr=1e-2, max_steps=40,
                eval_every=20, save_every=10, pass_k=2, seed=1)
    return RLConfig(**{**base, **kw})


def test_rl_raises_the_held_out_reward(tmp_path):
    path, _ = _tiny_model(tmp_path)
    res = rl(path, LetterTask(), tmp_path / "run", config=_cfg(), progress=False)
    assert res.steps == 40 and res.stop_reason == "max_steps"
    assert res.after["heldout_reward"] > res.before["heldout_reward"] + 0.3
    from tinylm.training.runlog import read_metrics
    recs = read_metrics(tmp_path / "run")
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 40
    for key in ("reward_mean", "response_length", "entropy", "clip_fraction", "kl", "loss"):
        assert all(key in r for r in steps)
    assert (tmp_path / "run" / "best").is_dir() and (tmp_path / "run" / "loss.png").is_file()


def test_pass_at_k():
    assert pass_at_k(4, 0, 2) == 0 and pass_at_k(4, 3, 2) == 1
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)


@pytest.mark.parametrize("bad", [dict(group_size=1), dict(advantage="median"),
                                 dict(temperature=0), dict(kl_coef=-1), dict(lr=0)])
def test_bad_settings_are_one_line_errors(bad):
    with pytest.raises(ConfigError) as exc:
        RLConfig(**bad)
    assert "\n" not in str(exc.value)


def _jsonl_task(tmp_path):
    import json
    path = tmp_path / "task.jsonl"
    words = ["cat", "dog", "sun", "map", "pen", "box", "hat", "cup", "bed", "car", "egg",
             "fox"]
    path.write_text("".join(json.dumps({"prompt": w, "answer": w[::-1]}) + "\n"
                            for w in words))
    return str(path)


RESUME = dict(group_size=4, prompts_per_step=2, max_new_tokens=4, lr=1e-2, max_steps=8,
              eval_every=4, save_every=3, pass_k=2, seed=3, n_train=8, n_held_out=4,
              updates_per_batch=2, kl_coef=0.05, lora_rank=2)


def _adapters(run):
    from safetensors.torch import load_file
    return load_file(str(run / "latest" / "model.safetensors"))


def _steps_log(run):
    from tinylm.training.runlog import read_metrics
    drop = ("elapsed", "samples_per_s", "generate_s", "update_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run)]


def test_kill_and_resume_is_bitwise_exact(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    path, _ = _tiny_model(tmp_path)
    task = _jsonl_task(tmp_path)
    ref = rl(path, task, tmp_path / "ref", config=RLConfig(**RESUME), progress=False)
    assert ref.steps == 8
    script = (
        "import json, os, signal, sys\n"
        "from tinylm.training.rl import RLConfig, rl\n"
        "def on_step(step):\n"
        "    if step == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "rl(sys.argv[1], sys.argv[2], sys.argv[3], config=RLConfig(**json.loads(sys.argv[4])),"
        " progress=False, on_step=on_step)\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script, str(path), task, str(out),
                           json.dumps(RESUME)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    from tinylm.io.checkpoint import load_train_state
    assert load_train_state(out / "latest")[1]["step"] == 3
    from tinylm.core.errors import CheckpointError
    with pytest.raises(CheckpointError, match="--resume"):
        rl(path, task, out, config=RLConfig(**RESUME), progress=False)
    got = rl(path, task, out, config=RLConfig(**RESUME), resume=True, progress=False)
    assert got.steps == 8 and got.resumed_from == 3
    a, b = _adapters(tmp_path / "ref"), _adapters(out)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert _steps_log(out) == _steps_log(tmp_path / "ref")


def test_cli_bad_flags_exit_2(tmp_path, capsys):
    from tinylm.cli import main
    path, _ = _tiny_model(tmp_path)
    for argv in (["--advantage", "median"], ["--kl-coef", "-1"], ["--group-size", "1"]):
        code = main(["rl", "--model", str(path), "--task", "builtin:arith", "--out",
                     str(tmp_path / "o"), *argv])
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err
