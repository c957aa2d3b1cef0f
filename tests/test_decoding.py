"""The decoding plans, on every path, against the model's full forward; none of them
changes the model."""

from __future__ import annotations

import os

import pytest
import torch

from tinylm import GPT, ModelConfig, generate
from tinylm.commands.compress import compress
from tinylm.core.decoding import Decoder, KVCache, RaggedKVCache

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native.decoding import NativeKVCache  # noqa: E402

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


def snapshot(model: GPT) -> dict:
    """Everything a decoding plan must leave alone: classes, instance attributes (a
    patched ``forward``), parameter objects, values and strides."""
    return {name: (type(m), dict(m.__dict__.get("_parameters", {})),
                   sorted(k for k in m.__dict__ if not k.startswith("_")))
            for name, m in model.named_modules()} | {
        name: (p.data_ptr(), p.stride(), p.clone()) for name, p in model.named_parameters()}


def assert_unchanged(model: GPT, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value[2], torch.Tensor):
            assert after[key][:2] == value[:2] and torch.equal(after[key][2], value[2]), key
        else:
            assert after[key] == value, key


@pytest.mark.parametrize(("bias", "tie"), [(True, True), (False, False)])
def test_decoder_steps_equal_full_forward(bias: bool, tie: bool) -> None:
    model = model_for(bias, tie)
    before = snapshot(model)
    with torch.inference_mode(), native.plan(model, "cpu").decoder(3) as decoder:
        assert decoder.path == ("fused" if NATIVE else "torch")
        check_steps_equal_full_forward(model, decoder)
    assert_unchanged(model, before)


def test_compressed_model_takes_the_native_cache_path_and_is_left_alone() -> None:
    model = model_for()
    compress(model, rank=8)
    before = snapshot(model)
    with torch.inference_mode():
        with native.plan(model, "cpu").decoder(2) as decoder:
            assert decoder.path == ("cache" if NATIVE else "torch")
            assert isinstance(decoder.cache, NativeKVCache) == NATIVE
            check_steps_equal_full_forward(model, decoder, B=2)
    assert_unchanged(model, before)
    generate(model, torch.randint(0, 61, (2, 3)), 4, temperature=0)
    assert_unchanged(model, before)


def test_generate_leaves_an_accelerated_model_as_it_was() -> None:
    model = model_for()
    native.accelerate(model, "cpu")
    before = snapshot(model)
    generate(model, torch.randint(0, 61, (1, 3)), 5, temperature=0.8, seed=1)
    assert_unchanged(model, before)


def test_the_reference_decoder_equals_full_forward() -> None:
    model = model_for(False, False)
    with torch.inference_mode(), Decoder(model, 2) as decoder:
        check_steps_equal_full_forward(model, decoder, B=2)


def test_prefill_restarts_the_cache() -> None:
    model = model_for()
    with torch.inference_mode(), native.plan(model, "cpu").decoder(1) as decoder:
        decoder.prefill(torch.randint(0, 61, (1, 10)))
        ids = torch.randint(0, 61, (1, 4))
        torch.testing.assert_close(decoder.prefill(ids), model(ids)[:, -1])
        assert decoder.cache.length == 4


def test_fused_step_rejects_a_full_cache_and_bad_ids() -> None:
    model = model_for()
    with torch.inference_mode(), native.plan(model, "cpu").decoder(1) as decoder:
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


@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_ragged_cache_attends_several_tokens_per_row_as_each_row_alone(arch: str) -> None:
    """Rows of different lengths feed C = 4 tokens each in one forward (rows that have
    fewer real tokens padded): row b's logits at i equal a one-row cache's and the full
    forward's over its own sequence; after each row keeps only some of them (truncate,
    as a rejected draft), a one-token step still equals the full forward — the keys left
    behind a row's length are never seen."""
    from tinylm.core.config import ARCH_PRESETS

    torch.manual_seed(0)
    if arch == "llama-gqa":
        layout = dict(ARCH_PRESETS["llama"], n_kv_head=2)  # 4 query heads share 2
        config = ModelConfig(**{"vocab_size": 61, "context_length": 24, "n_layer": 2,
                                "n_embd": 48, **layout, "n_head": 4})
        model = GPT(config).eval()
    else:
        model = model_for()
    seqs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    feed = [[20, 21, 22, 23], [24, 25, 0, 0], [26, 0, 0, 0], [27, 28, 29, 30]]
    real = [4, 2, 1, 4]  # tokens of feed[b] that are row b's; the rest is padding
    keep = [2, 2, 1, 0]  # then each row keeps its fed token and `keep` more
    cache = RaggedKVCache.for_model(model, 6)
    with torch.inference_mode():
        for r, s in enumerate(seqs):
            one = KVCache.for_model(model, 1)
            model(torch.tensor([s]), one)
            cache.put(r, one)
        cache.rows = len(seqs)
        logits = model(torch.tensor(feed), cache)  # (rows, 4, V)
        assert cache.lengths.tolist()[:4] == [len(s) + 4 for s in seqs]
        for b, s in enumerate(seqs):
            full = s + feed[b][:real[b]]
            ref = model(torch.tensor([full]))[0, len(s):]  # (real, V)
            one = KVCache.for_model(model, 1)
            model(torch.tensor([s]), one)
            alone = model(torch.tensor([feed[b][:real[b]]]), one)[0]
            torch.testing.assert_close(logits[b, :real[b]], ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[b, :real[b]], alone, atol=1e-5, rtol=1e-5)
            cache.truncate(b, len(s) + 1 + keep[b])
            s.extend(feed[b][:1 + keep[b]])
        nxt = [[40 + b] for b in range(len(seqs))]
        logits = model(torch.tensor(nxt), cache)[:, -1]  # (rows, V)
        for b, s in enumerate(seqs):
            ref = model(torch.tensor([s + nxt[b]]))[0, -1]
            torch.testing.assert_close(logits[b], ref, atol=1e-5, rtol=1e-5)
        assert cache.lengths.tolist()[:4] == [len(s) + 1 for s in seqs]


def test_native_cache_still_attends_one_token_and_prefills_after_cached_ones() -> None:
    """The native KV cache attends one token (its C = 1 kernel); C > 1 tokens after
    cached positions (a prompt's rest after a reused prefix) take the reference path."""
    torch.manual_seed(0)
    model = model_for()
    from tinylm.native import ops

    lib = ops.load()
    if lib is None:  # TINYLM_NATIVE=0: the cache is not built; the reference path's is
        assert not NATIVE
        return
    cache = NativeKVCache.for_model(model, 1, lib=lib)
    assert cache.attends(1) and not cache.attends(3)
    seq = torch.randint(0, 61, (1, 12))
    with torch.inference_mode():
        model(seq[:, :5], cache)
        rest = model(seq[:, 5:11], cache)[0]
        step = model(seq[:, 11:], cache)[0, -1]
        full = model(seq)[0]
    torch.testing.assert_close(rest, full[5:11], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, full[11], atol=1e-5, rtol=1e-5)
