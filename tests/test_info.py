"""`tinylm info` says what a checkpoint is (issue 36 item 7): an int8 or 4-bit model's
real parameter count and bytes, its quantization; a low-rank model's ranks; a LoRA run's
base, rank, alpha and targets; and what made each one, with the training its source
reached instead of "training unknown". Tiny checkpoints made by the commands themselves;
the oracles are the models' own tensors, files and config.json records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tinylm.cli import main
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data import prepare
from tinylm.data.chatdata import prepare_chat
from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer
from tinylm.io.checkpoint import load_model, read_config
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.io.describe import describe_checkpoint, info_lines, layer_summary
from tinylm.layers.lora import LoRALinear
from tinylm.layers.quantized import QuantizedLinear

TEXT = "the quick brown fox jumps over the lazy dog. attention is all you need!\n" * 40
QA = [{"prompt": f"what is {i}?", "completion": f"it is {i}."} for i in range(40)]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A trained run, its int8 and 4-bit copies, a low-rank copy, a plain saved model and
    a LoRA fine-tune of it, each written by its own command."""
    root = tmp_path_factory.mktemp("info")
    (root / "t.txt").write_text(TEXT)
    prepare(root / "data", [root / "t.txt"], context_length=16, progress=False)
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--context-length", "16",
                 "--max-steps", "4", "--batch-size", "4", "--eval-every", "2",
                 "--warmup-steps", "1", "--device", "cpu", "--seed", "3"]) == 0
    run = str(root / "run")
    assert main(["quantize", "--model", run, "--out", str(root / "q8")]) == 0
    assert main(["quantize", "--model", run, "--out", str(root / "q4"), "--bits", "4",
                 "--group-size", "8", "--layers", "ffn.up,ffn.down"]) == 0
    assert main(["compress", "--model", run, "--out", str(root / "lr"), "--rank", "3",
                 "--layers", "attn.qkv,ffn.up", "--device", "cpu"]) == 0
    tok = CharTokenizer("what is it 0123456789?.x", special_tokens=STANDARD_SPECIALS)
    torch.manual_seed(0)
    save_checkpoint(root / "base", GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=31,
                                                   n_layer=2, n_head=2, n_embd=32)), tok)
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    prepare_chat(root / "chat", [root / "qa.jsonl"], tokenizer=root / "base", context_length=31)
    assert main(["finetune", "--model", str(root / "base"), "--data", str(root / "chat"),
                 "--out", str(root / "lora"), "--lora-rank", "2", "--lora-alpha", "8",
                 "--lora-targets", "qkv,out", "--max-steps", "3", "--batch-size", "4",
                 "--eval-every", "3", "--device", "cpu"]) == 0
    return root


def _lines(folder: Path, capsys) -> dict[str, str]:
    capsys.readouterr()
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines()[1:])


def _source_training(made: Path) -> tuple[int, float]:
    info = describe_checkpoint(made / "run")
    assert info["step"] == 4 and info["val_loss"] is not None
    return info["step"], info["val_loss"]


@pytest.mark.parametrize("name, bits, group, layers", [
    ("q8", 8, None, ("attn.qkv", "attn.out", "ffn.up", "ffn.down")),
    ("q4", 4, 8, ("ffn.up", "ffn.down")),
])
def test_a_quantized_model_shows_every_parameter_its_bytes_and_its_scheme(
        made, capsys, name, bits, group, layers) -> None:
    float_model = load_model(made / "run")
    model = load_model(made / name)
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert [n.split(".", 2)[2] for n, _ in quantized] == [f"{x}" for _ in range(2) for x in layers]
    info = describe_checkpoint(made / name)
    # every weight the model computes with: the float model's count, not the floats alone
    assert info["parameters"] == float_model.num_parameters()
    assert info["parameter_kinds"] == {
        "quantized": sum(m.in_features * m.out_features for _, m in quantized),
        "float": model.num_parameters()}
    assert info["bytes"]["disk"] == (made / name / "model.safetensors").stat().st_size
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert info["bytes"]["memory"] == sum(t.numel() * t.element_size() for t in seen.values())
    assert info["quantized"] == [{"bits": bits, "group_size": group, "minimum": False,
                                  "layers": [n for n, _ in quantized]}]
    rows = _lines(made / name, capsys)
    kinds = info["parameter_kinds"]
    assert rows["parameters"] == (f"{info['parameters']:,} ({kinds['quantized']:,} quantized "
                                  f"weights + {model.num_parameters():,} float)")
    kind = "int8" if bits == 8 else "4-bit (stored in int8)"
    per = "per output channel" if group is None else f"groups of {group} inputs"
    assert rows["quantized"] == (f"{kind}, {per}: {len(quantized)} layers "
                                 f"({', '.join(layers)} of all 2 blocks)")
    assert rows["size"].endswith(" in memory") and "on disk" in rows["size"]
    # not "training unknown": the run it was made from, and what made it
    step, val = _source_training(made)
    assert rows["training"] == (f"none of its own; made from {made / 'run' / 'latest'}, "
                                f"trained to step {step}, val loss {val:.4f}")
    scheme = read_config(made / name)["quantized_from"]["scheme"]
    assert rows["made by"].startswith(f"tinylm quantize ({scheme}) of {made / 'run'}")


def test_a_low_rank_model_shows_its_ranks_and_its_source(made, capsys) -> None:
    info = describe_checkpoint(made / "lr")
    assert info["lowrank"] == read_config(made / "lr")["lowrank"]
    assert set(info["lowrank"].values()) == {3} and len(info["lowrank"]) == 4
    assert info["parameters"] == load_model(made / "lr").num_parameters()
    assert info["quantized"] == []
    rows = _lines(made / "lr", capsys)
    assert rows["low-rank"].startswith("4 layers, ranks 3..3: ")
    assert rows["made by"] == f"tinylm compress (rank=3) of {made / 'run'}"
    assert rows["training"].startswith(f"none of its own; made from {made / 'run' / 'latest'}")
    assert rows["quantized"] == "none (float weights)"


def test_a_lora_run_shows_its_base_rank_alpha_and_targets(made, capsys) -> None:
    model = load_model(made / "lora")
    adapters = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    config = read_config(made / "lora")
    info = describe_checkpoint(made / "lora")
    lora = info["lora"]
    assert lora["layers"] == [n for n, _ in adapters]  # model order
    assert set(lora["layers"]) == set(config["lora"]["layers"])
    assert lora["rank"] == [2] and lora["alpha"] == [8.0]
    assert lora["adapter_parameters"] == sum(m.lora_A.numel() + m.lora_B.numel()
                                             for _, m in adapters)
    assert lora["base"] == str((made / "base").resolve()) and lora["base_found"]
    assert info["bytes"]["disk"] == (made / "lora" / "latest" / "model.safetensors").stat().st_size
    assert info["bytes"]["disk"] < info["bytes"]["memory"]  # the adapters only
    rows = _lines(made / "lora", capsys)
    assert rows["LoRA"] == (f"rank 2, alpha 8 on 4 layers (attn.qkv, attn.out of all 2 "
                            f"blocks), {lora['adapter_parameters']:,} adapter parameters; "
                            f"base {(made / 'base').resolve()} (found)")
    assert rows["made by"].startswith(f"tinylm finetune (lora) of {(made / 'base').resolve()} "
                                      f"on {made / 'chat'}: 3 of 3 steps")
    assert rows["training"].startswith("step 3, val loss ")
    assert "the adapters" in rows["size"]


def test_a_plain_run_and_a_bare_save_say_what_is_known(made, capsys) -> None:
    rows = _lines(made / "run", capsys)
    state = json.loads((made / "run" / "latest" / "train_state.json").read_text())
    assert rows["made by"] == (f"tinylm train: 4 of 4 steps, stopped by {state['stop_reason']}, "
                               f"{state['tokens_seen']:,} tokens, adamw lr 0.001, batch 4")
    assert rows["training"].startswith("step 4, val loss ")
    rows = _lines(made / "base", capsys)
    assert rows["made by"] == "not recorded"
    assert rows["training"] == ("none recorded (saved without tinylm train, and no run "
                                "folder around it)")
    assert "unknown" not in rows["training"]


def test_info_json_carries_the_same_record(made, capsys) -> None:
    capsys.readouterr()
    assert main(["info", "--json", str(made / "q4")]) == 0
    record = json.loads(capsys.readouterr().out)["checkpoint"]
    assert record == json.loads(json.dumps(describe_checkpoint(made / "q4")))
    assert dict(info_lines(record))["quantized"].startswith("4-bit")


def test_layer_summary() -> None:
    names = [f"blocks.{i}.{s}" for i in range(4) for s in ("attn.qkv", "ffn.up")]
    assert layer_summary(names, 4) == "attn.qkv, ffn.up of all 4 blocks"
    assert layer_summary(["blocks.0.ffn.up", "blocks.1.ffn.up", "blocks.3.ffn.up", "lm_head"],
                         4) == "ffn.up of blocks 0-1, 3; lm_head"
