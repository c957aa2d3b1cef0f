"""tinylm's GPT is exactly Hugging Face GPT-2 when configured so."""

from __future__ import annotations

import pytest
import torch
import transformers

from tinylm import GPT, ConfigError, ModelConfig
from tinylm.core.decoding import KVCache
from tinylm.io.hf import from_hf, to_hf

SHAPES = [
    # (vocab, positions, n_embd, n_layer, n_head, tie)
    (97, 32, 24, 2, 3, True),
    (131, 20, 30, 1, 5, True),
    (50, 16, 16, 3, 1, False),
]


def hf_model(vocab, positions, n_embd, n_layer, n_head, tie):
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    # Random, non-trivial LayerNorm parameters and biases (defaults are 1 and 0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("shape", SHAPES)
def test_import_gives_hf_logits(shape) -> None:
    hf = hf_model(*shape)
    model = from_hf(hf)
    ids = torch.randint(0, shape[0], (2, shape[1]))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trip(shape, tmp_path) -> None:
    hf = hf_model(*shape)
    ids = torch.randint(0, shape[0], (3, 11))
    exported = to_hf(from_hf(hf))
    exported.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(exported(ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)
    # And importing from the saved folder gives the same model again.
    again = from_hf(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), expected, atol=1e-5, rtol=0)


def test_kv_cache_matches_hf_incremental_logits() -> None:
    hf = hf_model(*SHAPES[0])
    model = from_hf(hf)
    ids = torch.randint(0, 97, (1, 12))
    cache = KVCache.for_model(model, 1)
    with torch.no_grad():
        ours = torch.cat([model(ids[:, :4], cache)] + [model(ids[:, t:t + 1], cache)
                                                       for t in range(4, 12)], 1)
        torch.testing.assert_close(ours, hf(ids).logits, atol=1e-5, rtol=0)


def test_bias_free_model_exports_with_zero_biases() -> None:
    model = GPT(ModelConfig(vocab_size=40, context_length=12, n_layer=2, n_head=2, n_embd=16,
                            bias=False)).eval()
    hf = to_hf(model)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=0)


def test_export_refuses_head_dim_gpt2_cannot_express() -> None:
    model = GPT(ModelConfig(vocab_size=40, context_length=12, n_layer=1, n_head=2, n_embd=16,
                            head_dim=4))
    with pytest.raises(ConfigError, match="n_head·head_dim == n_embd"):
        to_hf(model)


def test_import_refuses_unsupported_activation() -> None:
    cfg = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  activation_function="relu")
    with pytest.raises(ConfigError, match="activation_function"):
        from_hf(transformers.GPT2LMHeadModel(cfg))
