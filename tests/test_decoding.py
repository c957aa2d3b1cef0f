"""The decoding step, on every path, against the model's full forward."""

from __future__ import annotations

import os

import pytest
import torch

from tinylm import GPT, ModelConfig, generate
from tinylm.decoding import Decoder, NativeKVCache
from tinylm.lowrank import compress

NATIVE = os.environ.get("TINYLM_NATIVE") != "0"


def model_for(bias: bool = True, tie: bool = True, **kw) -> GPT:
    config = ModelConfig(vocab_size=kw.pop("vocab_size", 61), context_length=24, n_layer=2,
                         n_head=3, n_embd=48, bias=bias, tie_embeddings=tie, **kw)
    return GPT(config).eval()


def check_steps_equal_full_forward(model: GPT, decoder: Decoder, B: int = 3) -> None:
    """prefill + 6 steps give the same last-position logits as forwards over the sequence."""
    V = model.config.vocab_size
    seq = torch.randint(0, V, (B, 5))
    torch.testing.assert_close(decoder.prefill(seq), model(seq)[:, -1], rtol=1e-4, atol=1e-5)
    for _ in range(6):
        nxt = torch.randint(0, V, (B,))
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        torch.testing.assert_close(decoder.step(nxt), model(seq)[:, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("bias", "tie"), [(True, True), (False, False)])
def test_decoder_steps_equal_full_forward(bias: bool, tie: bool) -> None:
    model = model_for(bias, tie)
    with torch.inference_mode(), Decoder(model, 3) as decoder:
        assert decoder.path == ("fused" if NATIVE else "torch")
        check_steps_equal_full_forward(model, decoder)


@pytest.mark.skipif(not NATIVE, reason="native kernels turned off by TINYLM_NATIVE=0")
def test_compressed_model_takes_the_patched_path_and_is_restored() -> None:
    model = model_for()
    compress(model, rank=8)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        with Decoder(model, 2) as decoder:
            assert decoder.path == "patched"
            assert isinstance(decoder.cache, NativeKVCache)
            assert all("forward" in m.__dict__ for m in linears)
            check_steps_equal_full_forward(model, decoder, B=2)
        assert not any("forward" in m.__dict__ for m in linears)  # back to nn.Linear's


def test_prefill_restarts_the_cache() -> None:
    model = model_for()
    with torch.inference_mode(), Decoder(model, 1) as decoder:
        decoder.prefill(torch.randint(0, 61, (1, 10)))
        ids = torch.randint(0, 61, (1, 4))
        torch.testing.assert_close(decoder.prefill(ids), model(ids)[:, -1])
        assert decoder.cache.length == 4


def test_fused_step_rejects_a_full_cache_and_bad_ids() -> None:
    model = model_for()
    with torch.inference_mode(), Decoder(model, 1) as decoder:
        decoder.prefill(torch.randint(0, 61, (1, 24)))  # fills the context
        with pytest.raises(ValueError, match="overflow"):
            decoder.step(torch.tensor([1]))
        if decoder.path == "fused":
            decoder.prefill(torch.tensor([[1, 2]]))
            with pytest.raises(ValueError, match=r"\[0, 61\)"):
                decoder.step(torch.tensor([61]))


def test_generate_after_training_steps_sees_the_new_weights() -> None:
    # The packed weight copies are cached between generate calls; an optimizer step
    # changes the weights in place and must invalidate them.
    model = model_for()
    prompt = torch.randint(0, 61, (1, 4))
    generate(model, prompt, 4, temperature=0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model.loss(torch.randint(0, 61, (2, 8)), torch.randint(0, 61, (2, 8))).backward()
        opt.step()
    model.eval()
    got = generate(model, prompt, 6, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq)
