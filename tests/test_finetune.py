"""Fine-tuning: the loss counts only assistant tokens, LoRA runs save adapters and merge,
resume is bitwise exact for full and LoRA runs, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tinylm.cli import main
from tinylm.core.config import ModelConfig
from tinylm.core.errors import CheckpointError, DataError
from tinylm.core.model import GPT
from tinylm.data.chatdata import load_chat_data, prepare_chat
from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer
from tinylm.io.checkpoint import load_checkpoint, read_config, read_tensors
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.lora import is_adapter_key
from tinylm.training.finetune import finetune, merge
from tinylm.use.evaluation import estimate_loss

C = 31  # context length: rows of 32 tokens
QA = [{"prompt": f"what is {i}?", "completion": f"it is {i}."} for i in range(60)]
ALPHABET = "what is it 0123456789?.x"
STEPS = {"max_steps": 6, "batch_size": 4, "warmup_steps": 2, "min_lr_ratio": 1.0,
         "eval_every": 3, "eval_windows": 4, "save_every": 100, "log_every": 1,
         "device": "cpu"}


def _base(folder: Path, specials=STANDARD_SPECIALS) -> Path:
    tok = CharTokenizer(ALPHABET, special_tokens=specials)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=C, n_layer=2,
                            n_head=2, n_embd=32, dropout=0.0))
    return save_checkpoint(folder, model, tok)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ft")
    base = _base(root / "base")
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    prepare_chat(root / "chat", [root / "qa.jsonl"], tokenizer=base, context_length=C)
    return base, root / "chat"


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    model, _ = load_checkpoint(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- the loss mask -------------------------------------------------------------------------


def test_loss_counts_only_assistant_tokens(tmp_path, setup) -> None:
    base, _ = setup
    model, tok = load_checkpoint(base)
    # One conversation filling a whole row, ending in a user turn (mask 0).
    # role + "what is 1?" + end, role + "it is 1." + end, role + tail + end = C + 1 tokens
    user_tail = "x" * (C + 1 - (2 + 10 + 2 + 8 + 2))
    record = {"messages": [{"role": "user", "content": "what is 1?"},
                           {"role": "assistant", "content": "it is 1."},
                           {"role": "user", "content": user_tail}]}
    (tmp_path / "one.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(QA[2]) + "\n")
    data = prepare_chat(tmp_path / "d", [tmp_path / "one.jsonl"], tokenizer=tok,
                        context_length=C, val_fraction=0.5, seed=3)
    split = next(s for s in ("train", "val")
                 if tok.decode(np.asarray(getattr(data, s)[:C + 1])).endswith("x<|end|>"))
    tokens = np.array(getattr(data, split)[:C + 1], dtype=np.int64)
    mask = np.asarray(getattr(data, f"{split}_mask")[:C + 1])
    assert len(tokens) == C + 1 and mask[-3:].tolist() == [0, 0, 0] and mask.sum() > 0

    def loss(t: np.ndarray) -> float:
        return estimate_loss(model, t, np.array([0]), context_length=C, loss_mask=mask).loss

    reference = loss(tokens)
    changed = tokens.copy()
    changed[-2] = tok.token_to_id("0")  # a user token (a target with mask 0)
    assert loss(changed) == reference
    answer = int(np.flatnonzero(mask)[0])
    changed[answer] = tok.token_to_id("x")  # an assistant token
    assert loss(changed) != reference


def test_all_user_batch_is_an_error_not_nan(tmp_path, setup) -> None:
    base, chat = setup
    data = load_chat_data(chat)
    silent = dataclasses.replace(data, train_mask=np.zeros_like(data.train_mask))
    with pytest.raises(DataError, match="no target with loss mask 1"):
        finetune(base, silent, tmp_path / "run", overrides=STEPS, progress=False)


# --- LoRA checkpoints, merge, loading ------------------------------------------------------


def test_lora_run_saves_adapters_and_merges(tmp_path, setup) -> None:
    base, chat = setup
    out = tmp_path / "lora"
    result, info = finetune(base, chat, out, lora_rank=2, overrides=STEPS, progress=False,
                            merge_to=True)
    assert result.steps == 6 and info["mode"] == "lora"
    assert info["trainable"] == 2 * 2 * sum(a + b for a, b in [(32, 96), (32, 32), (32, 128),
                                                                (128, 32)])
    saved = read_tensors(out / "latest" / "model.safetensors")
    assert saved and all(is_adapter_key(k) for k in saved)  # adapters only
    config = read_config(out / "latest")
    assert config["lora_base"]["path"] == str(base.resolve()) and config["lora"]["layers"]
    # Only adapters changed; the frozen weights are the base's.
    got, before = _weights(out), _weights(base)
    for k, v in got.items():
        if not is_adapter_key(k):
            assert torch.equal(v, before[k]), k
    assert any(not torch.all(v == 0) for k, v in got.items() if k.endswith("lora_B"))
    # The merged checkpoint gives the adapted model's logits and needs no base.
    ids = torch.randint(0, 20, (2, C))
    adapted, _ = load_checkpoint(out)
    merged, _ = load_checkpoint(info["merged"])
    with torch.no_grad():
        assert (merged(ids) - adapted(ids)).abs().max() < 1e-5
    moved = tmp_path / "moved-base"
    shutil.move(base, moved)
    try:
        with pytest.raises(CheckpointError, match="cannot be read"):
            load_checkpoint(out)
        load_checkpoint(info["merged"])  # still loads
    finally:
        shutil.move(moved, base)
    assert main(["merge", "--model", str(out), "--out", str(tmp_path / "m2")]) == 0
    assert main(["eval", "--model", str(tmp_path / "m2"), "--data", str(chat)]) == 0
    assert main(["eval", "--model", str(out), "--data", str(chat)]) == 0
    with pytest.raises(Exception, match="no LoRA adapters"):
        merge(info["merged"], tmp_path / "m3")


def test_vocabulary_grows_when_the_base_lacks_chat_tokens(tmp_path) -> None:
    base = _base(tmp_path / "plain", specials=["<|endoftext|>"])
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    data = prepare_chat(tmp_path / "chat", [tmp_path / "qa.jsonl"], tokenizer=base,
                        context_length=C)
    assert data.tokenizer.vocab_size == load_checkpoint(base)[1].vocab_size + 4
    result, _ = finetune(base, data, tmp_path / "run", lora_rank=2, overrides=STEPS,
                         progress=False)
    model, tok = load_checkpoint(result.checkpoint)
    assert model.config.vocab_size == tok.vocab_size == data.tokenizer.vocab_size
    before, _ = load_checkpoint(base)
    old = before.config.vocab_size
    assert torch.equal(model.tok_emb.weight[:old], before.tok_emb.weight)
    saved = read_tensors(result.checkpoint / "model.safetensors")
    assert "tok_emb.weight" in saved  # the grown rows are saved with the adapters


# --- exact resume --------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [None, 2])
def test_resume_is_bitwise_exact(tmp_path, setup, lora) -> None:
    base, chat = setup
    straight, _ = finetune(base, chat, tmp_path / "straight", lora_rank=lora, overrides=STEPS,
                           progress=False)
    half, _ = finetune(base, chat, tmp_path / "halves", lora_rank=lora,
                       overrides={**STEPS, "max_steps": 3}, progress=False)
    assert half.steps == 3
    again, _ = finetune(base, chat, tmp_path / "halves", lora_rank=lora, overrides=STEPS,
                        resume=True, progress=False)
    assert again.steps == 6 and again.resumed_from == 3
    ref, got = _weights(straight.checkpoint), _weights(again.checkpoint)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


# --- the CLI --------------------------------------------------------------------------------


def test_cli_finetune_and_chat(tmp_path, setup, capsys) -> None:
    base, chat = setup
    out = tmp_path / "cli"
    args = ["finetune", "--model", str(base), "--data", str(chat), "--out", str(out),
            "--lora-rank", "2", "--lora-targets", "qkv,out", "--max-steps", "3",
            "--batch-size", "4", "--eval-every", "3", "--eval-windows", "2", "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "fine-tuned (lora) 3 steps" in text and "val loss on assistant tokens" in text
    assert main(args) == 2  # an existing run is never overwritten
    assert "--resume" in capsys.readouterr().err
    assert main(["chat", "--model", str(out), "--prompt", "what is 3?", "--seed", "0",
                 "--max-new-tokens", "4"]) == 0
    assert main(["finetune", "--model", str(base), "--data", str(chat), "--out",
                 str(tmp_path / "x"), "--lora-rank", "2", "--lora-targets", "ffn"]) == 2
    assert "lora-targets" in capsys.readouterr().err
    assert main(["finetune", "--model", str(base), "--data", str(tmp_path), "--out",
                 str(tmp_path / "y")]) == 2


def test_dropout_is_off_unless_asked_and_a_bad_value_is_refused(tmp_path, capsys) -> None:
    """The base's pretraining dropout is not carried into fine-tuning (default 0, the
    fused native block then runs); --dropout P sets it; an absurd P is one line, exit 2."""
    tok = CharTokenizer(ALPHABET, special_tokens=STANDARD_SPECIALS)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=C, n_layer=2,
                            n_head=2, n_embd=32, dropout=0.2))
    base = save_checkpoint(tmp_path / "base", model, tok)
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    chat = prepare_chat(tmp_path / "chat", [tmp_path / "qa.jsonl"], tokenizer=base,
                        context_length=C)
    steps = {**STEPS, "max_steps": 2}
    off, _ = finetune(base, chat, tmp_path / "off", overrides=steps, progress=False)
    assert read_config(off.checkpoint)["model"]["dropout"] == 0.0
    on, _ = finetune(base, chat, tmp_path / "on", overrides=steps, progress=False,
                     lora_rank=2, dropout=0.1)
    assert read_config(on.checkpoint)["model"]["dropout"] == 0.1
    for p in ("1.5", "-0.1"):
        assert main(["finetune", "--model", str(base), "--data", str(chat.dir), "--out",
                     str(tmp_path / "bad"), "--dropout", p]) == 2
        err = capsys.readouterr().err
        assert "dropout" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()
