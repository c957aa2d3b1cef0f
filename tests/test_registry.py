"""tinylm.layers.registry and tinylm.layers.selection: every replaced-layer kind declared
once, the one layer-selection rule, and a model mixing all kinds through a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tinylm import GPT, ConfigError, ModelConfig
from tinylm.commands.compress import compress
from tinylm.commands.quantize import quantize
from tinylm.io.checkpoint import load_model
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers import registry
from tinylm.layers.blocks import BlockLinear
from tinylm.layers.lora import LoRALinear, apply_lora
from tinylm.layers.lowrank import LowRankLinear
from tinylm.layers.quantized import QuantizedLinear
from tinylm.layers.selection import select_layers


def tiny(**kw) -> GPT:
    cfg = dict(vocab_size=40, context_length=16, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(ModelConfig(**cfg)).eval()


def mixed() -> GPT:
    """Every kind at once: low-rank qkv, int8 FFN up, Q4_0 blocks for the LM head (an
    untied one), LoRA on out and down."""
    model = tiny(tie_embeddings=False)
    compress(model, rank=4, layers=["attn.qkv"])
    quantize(model, layers=["ffn.up"])
    model.lm_head = BlockLinear.from_linear(model.lm_head, "Q4_0")
    apply_lora(model, 2, targets="out,down")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.1)
    return model.eval()


def test_the_kinds_and_their_sections() -> None:
    assert registry.SECTIONS == ("lowrank", "quantize", "gguf_blocks", "lora")
    assert registry.kind_of(LowRankLinear(4, 4, 2)) is registry.LOWRANK
    assert registry.kind_of(QuantizedLinear(4, 4)) is registry.QUANTIZED
    assert registry.kind_of(nn.Linear(4, 4)) is None
    assert registry.training_classes() == (LoRALinear,)
    assert registry.kind_of(BlockLinear(4, 4)) is registry.BLOCKS
    assert registry.decoding_classes() == (QuantizedLinear, BlockLinear)
    assert registry.decoding_of(QuantizedLinear(4, 4)) == "int8"
    assert registry.decoding_of(BlockLinear(4, 4)) == "blocks"
    assert registry.decoding_of(nn.Linear(4, 4)) is None


def test_structure_round_trip_of_a_model_with_every_kind(tmp_path) -> None:
    model = mixed()
    structure = registry.structure_of(model)
    assert set(structure) == {"lowrank", "quantize", "gguf_blocks", "lora"}
    assert structure["gguf_blocks"] == {"lm_head": {"type": "Q4_0"}}
    assert structure["lowrank"] == {"blocks.0.attn.qkv": 4, "blocks.1.attn.qkv": 4}
    dest = save_checkpoint(tmp_path / "ckpt", model)
    config = json.loads((dest / "config.json").read_text())
    assert {k: config[k] for k in registry.SECTIONS} == structure  # the format as before
    loaded = load_model(dest)
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    assert registry.structure_of(loaded) == structure
    assert registry.structure_of(tiny()) == {}


def test_densified_is_the_same_function_with_plain_layers() -> None:
    model = mixed()
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        want = model(ids)
        dense = registry.densified(model)
        torch.testing.assert_close(dense(ids), want, atol=1e-5, rtol=1e-5)
    assert all(registry.kind_of(m) is None for m in dense.modules())
    assert registry.structure_of(dense) == {}


def test_training_weight_is_the_effective_weight_for_lora_only() -> None:
    lora = LoRALinear.from_linear(nn.Linear(8, 6), rank=2, alpha=4)
    with torch.no_grad():
        lora.lora_B.normal_()
    torch.testing.assert_close(registry.training_weight(lora), lora.effective_weight())
    plain = nn.Linear(8, 6)
    assert registry.training_weight(plain) is plain.weight


def test_one_selection_rule() -> None:
    model = tiny(mlp="swiglu", norm="rmsnorm", position="rope", bias=False)
    names = [n for n, _ in select_layers(model, ["ffn.up", "blocks.0.attn.qkv"])]
    assert names == ["blocks.0.attn.qkv", "blocks.0.ffn.up", "blocks.1.ffn.up"]  # model order
    every = [n for n, _ in select_layers(model)]  # None: every Linear of the blocks
    assert every == [n for n, m in model.named_modules()
                     if type(m) is nn.Linear and n.startswith("blocks.")]
    with pytest.raises(ConfigError, match="unknown layer name 'lm_head'"):
        select_layers(model, ["lm_head"])  # the LM head is never a candidate
    with pytest.raises(ConfigError, match="unknown layer name 'ffn.nope'; choose from"):
        select_layers(model, ["ffn.nope"])
    with pytest.raises(ConfigError, match="unknown layer name ''"):
        select_layers(model, [" "])
    plain = tiny()  # no ffn.gate: an optional pattern is skipped only among several
    assert len(select_layers(plain, ["ffn.gate", "ffn.up"], optional=("ffn.gate",))) == 2
    with pytest.raises(ConfigError, match="ffn.gate"):
        select_layers(plain, ["ffn.gate"], optional=("ffn.gate",))


def test_selection_parameters_take_and_empty() -> None:
    model = tiny()
    quantize(model)  # no plain Linear left in the blocks
    assert select_layers(model) == []
    with pytest.raises(ConfigError, match="no linear layers to compress"):
        select_layers(model, ["ffn.up"], empty="the model has no linear layers to compress")
    found = select_layers(model, ["ffn.up"], take=(QuantizedLinear,))
    assert [n for n, _ in found] == ["blocks.0.ffn.up", "blocks.1.ffn.up"]
    with pytest.raises(ConfigError, match="is a QuantizedLinear, not a plain linear layer"):
        apply_lora(model, 2)  # LoRA takes any module in a target's place, then refuses it


def test_the_low_rank_export_refusal_comes_from_the_registry() -> None:
    from tinylm.io.hf import to_hf

    pytest.importorskip("transformers")
    model = tiny()
    compress(model, rank=4, layers=["attn.qkv"])
    with pytest.raises(ConfigError, match="a compressed \\(low-rank\\) model has no "
                                          "GPT2LMHeadModel equivalent"):
        to_hf(model)
