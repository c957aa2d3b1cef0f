"""The Transformer LM: shapes, causality, KV cache, parameter count, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinylm import GPT, ConfigError, ModelConfig
from tinylm.core.decoding import KVCache
from tinylm.core.model import lm_loss, parameter_count


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=61, context_length=24, n_layer=2, n_head=3, n_embd=36)
    base.update(kw)
    return ModelConfig(**base)


def test_forward_shape_and_distributions() -> None:
    model = GPT(tiny()).eval()
    ids = torch.randint(0, 61, (2, 10))
    logits = model(ids)
    assert logits.shape == (2, 10, 61)
    probs = model.probabilities(ids)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 10))
    torch.testing.assert_close(probs, F.softmax(logits, -1))


def test_embedding_is_a_row_lookup_equal_to_one_hot_product() -> None:
    model = GPT(tiny())
    ids = torch.tensor([[42, 0, 7]])
    one_hot = F.one_hot(ids, 61).float()  # (B, C, V)
    torch.testing.assert_close(model.tok_emb(ids), one_hot @ model.tok_emb.weight)
    torch.testing.assert_close(model.tok_emb(ids)[0, 0], model.tok_emb.weight[42])


def test_full_model_is_causal() -> None:
    model = GPT(tiny()).eval()
    ids = torch.randint(0, 61, (1, 12))
    base = model(ids)
    for t in range(11):
        ids2 = ids.clone()
        ids2[0, t + 1] = (ids2[0, t + 1] + 1) % 61
        out = model(ids2)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=0, rtol=0)
        assert not torch.allclose(out[:, t + 1], base[:, t + 1])


def test_explicit_path_logits_equal_fast_path() -> None:
    model = GPT(tiny()).eval()
    ids = torch.randint(0, 61, (2, 9))
    logits, maps = model.forward_with_attention(ids)
    assert maps.shape == (2, 2, 3, 9, 9)  # (L, B, H, C, C)
    torch.testing.assert_close(logits, model(ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 2, 3, 9))


@pytest.mark.parametrize("chunks", [[1] * 20, [5, 1, 1, 7, 6], [20], [3, 17]])
def test_kv_cache_decoding_equals_full_forward(chunks: list[int]) -> None:
    model = GPT(tiny(bias=False, head_dim=8)).eval()
    ids = torch.randint(0, 61, (3, 20))
    full = model(ids)
    cache = KVCache.for_model(model, batch_size=3)
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(model(ids[:, pos:pos + n], cache))
            pos += n
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


def test_sequence_longer_than_context_is_a_clear_error() -> None:
    model = GPT(tiny(context_length=8))
    with pytest.raises(ConfigError, match="context_length 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "kw",
    [{}, {"bias": False}, {"tie_embeddings": False}, {"head_dim": 5}, {"n_layer": 3}],
)
def test_parameter_count_closed_form(kw: dict) -> None:
    cfg = tiny(**kw)
    model = GPT(cfg)
    assert parameter_count(cfg) == model.num_parameters()
    assert model.num_parameters() == sum(p.numel() for p in set(model.parameters()))


def test_weight_tying() -> None:
    model = GPT(tiny())
    assert model.lm_head.weight is model.tok_emb.weight
    untied = GPT(tiny(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_gpt2_init_scales_residual_projections() -> None:
    cfg = ModelConfig(vocab_size=100, context_length=16, n_layer=8, n_head=4, n_embd=256)
    model = GPT(cfg)
    expected = 0.02 / math.sqrt(2 * 8)
    assert abs(model.blocks[0].attn.out.weight.std().item() - expected) < expected * 0.1
    assert abs(model.blocks[0].ffn.down.weight.std().item() - expected) < expected * 0.1
    assert abs(model.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.002
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)


def test_loss_is_row_t_against_token_t_plus_1() -> None:
    model = GPT(tiny()).eval()
    seq = torch.randint(0, 61, (2, 11))
    ids, targets = seq[:, :-1], seq[:, 1:]
    logits = model(ids)
    manual = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(model.loss(ids, targets), manual)
    torch.testing.assert_close(lm_loss(logits, targets), manual)
    # An untrained model is close to uniform: loss ≈ ln V.
    assert abs(manual.item() - math.log(61)) < 0.3


def test_tiny_model_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = GPT(tiny(n_embd=48, n_head=4, context_length=16))
    seq = torch.randint(0, 61, (4, 17))
    ids, targets = seq[:, :-1], seq[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model.loss(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.1


def test_dropout_only_in_training() -> None:
    model = GPT(tiny(dropout=0.5))
    ids = torch.randint(0, 61, (2, 8))
    model.eval()
    torch.testing.assert_close(model(ids), model(ids))
    model.train()
    assert not torch.allclose(model(ids), model(ids))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"n_embd": 30, "n_head": 4}, "n_head"),
        ({"n_head": 0}, "n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"context_length": -1}, "context_length"),
        ({"dropout": 1.0}, "dropout"),
        ({"head_dim": 0}, "head_dim"),
        ({"n_layer": 2.5}, "n_layer"),
        ({"bias": "yes"}, "bias"),
        ({"norm_eps": 0}, "norm_eps"),
    ],
)
def test_bad_configs_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny(**kw)


def test_head_dim_error_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="set head_dim explicitly"):
        ModelConfig(n_embd=30, n_head=4)


def test_config_json_round_trip_and_unknown_keys() -> None:
    cfg = tiny(head_dim=7)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="n_layers"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


def test_training_step_under_bf16_autocast_runs_and_matches_fp32() -> None:
    # CUDA trains under bf16 autocast; the FFN's custom backward must cope with bf16
    # activations and fp32 weights. CPU autocast exercises the same code path.
    config = ModelConfig(vocab_size=50, context_length=8, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    ids, targets = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    model.loss(ids, targets).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(ids, targets)
    loss.backward()
    for p, w in zip(model.parameters(), want, strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.allclose(p.grad, w, rtol=0.1, atol=2e-2 * w.abs().max().item() + 1e-4)
