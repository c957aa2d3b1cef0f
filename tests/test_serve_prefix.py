"""Prefix reuse (tinylm.serve.prefix): the block cache's hits, misses and LRU eviction
under its byte budget, a prefill from cached blocks against the plain prefill, and the
engine's answers (tokens, logprobs) with the cache on and off over shared-prefix
requests in flight together; live over HTTP with the openai client, and on SmolLM2."""

from __future__ import annotations

import os
import random
from unittest import mock

import httpx
import openai
import pytest
import torch

from serve_support import (
    layout_model,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    run_engine,
    tiny_model_and_tokenizer,
)
from tinylm.core.decoding import KVCache
from tinylm.serve.engine import Engine
from tinylm.serve.prefix import PrefixCache, chain_keys
from tinylm.use.sampling import SamplingConfig


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def model(request):
    m = layout_model(request.param, context_length=96)
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # far-apart logits: no greedy near-ties
    return m


def block_bytes(model, block: int = 4) -> int:
    cfg = model.config
    return 2 * cfg.n_layer * cfg.n_kv_head * block * cfg.head_dim * 4  # k and v, float32


def test_chain_keys_name_a_block_by_its_whole_prefix() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # whole blocks only: token 9 of a is not one
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a


def test_prefill_from_cached_blocks_equals_the_plain_prefill(model) -> None:
    """A prompt that shares 2 whole blocks (8 tokens) with an earlier one reuses them,
    and its logits and every cached key and value equal a plain prefill's; a prompt of
    exactly the cached blocks still prefills its last token (reusing one block)."""
    pc = PrefixCache(1 << 20, block=4)
    first, second = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32]
    with torch.inference_mode():
        pc.prefill(model, first, 96)
        assert (pc.hits, pc.misses, pc.tokens_reused, len(pc)) == (0, 1, 0, 2)
        logits, cache = pc.prefill(model, second, 96)
        assert (pc.hits, pc.misses, pc.tokens_reused, len(pc)) == (1, 1, 8, 2)
        plain = KVCache.for_model(model, 1, 96)
        ref = model(torch.tensor([second]), plain)[0, -1]
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        assert cache.length == plain.length == len(second)
        torch.testing.assert_close(cache.k[:, :, :, :11], plain.k[:, :, :, :11])
        torch.testing.assert_close(cache.v[:, :, :, :11], plain.v[:, :, :, :11])
        logits, _ = pc.prefill(model, first[:8], 96)  # 8 tokens: 1 block reused, 4 run
        assert pc.tokens_reused == 12
        torch.testing.assert_close(logits, model(torch.tensor([first[:8]]))[0, -1],
                                   atol=1e-5, rtol=1e-5)


def test_lru_eviction_under_the_byte_budget_drops_tails_first(model) -> None:
    """Room for 3 blocks: a second prompt of 2 new blocks evicts the least recently used
    of the first's, its tail (block 2) before its head; a hit refreshes a chain."""
    one = block_bytes(model)
    pc = PrefixCache(3 * one, block=4)
    a, b = list(range(1, 9)), list(range(20, 28))  # 2 whole blocks each
    with torch.inference_mode():
        pc.prefill(model, a + [0], 96)
        assert pc.nbytes == 2 * one
        pc.prefill(model, b + [0], 96)  # 4 blocks > 3: a's tail goes
        assert pc.nbytes == 3 * one and len(pc) == 3
        assert len(pc.lookup(a + [0])) == 1  # a's head is still there
        assert len(pc.lookup(b + [0])) == 2
        pc.prefill(model, a + [0], 96)  # reuses a's head, re-adds its tail: b's tail goes
        assert len(pc.lookup(a + [0])) == 2 and len(pc.lookup(b + [0])) == 1
        assert pc.nbytes == 3 * one <= pc.budget
    small = PrefixCache(one - 1, block=4)  # not even one block fits: nothing is held
    with torch.inference_mode():
        small.prefill(model, a + [0], 96)
    assert len(small) == 0 and small.nbytes == 0
    with pytest.raises(ValueError, match="positive budget"):
        PrefixCache(0)


def _shared_prefix_requests(seed: int = 0) -> list[tuple[list[int], int, dict]]:
    """Prompts of one 40-token system prefix (and some of a second) + different
    questions, greedy and sampled, with logprobs; some outgrow the context of 96 and
    slide."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50) for _ in range(40)], [rng.randrange(50) for _ in range(35)]]
    reqs = []
    for i in range(16):
        system = systems[i % 5 == 4]
        question = [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        kw = {"logprobs": 2, "stop_ids": (7,)}
        if i % 3 == 2:
            kw |= {"sampling": SamplingConfig(1.0, top_k=20), "seed": i}
        reqs.append((system + question, rng.choice([3, 10, 60]), kw))
    reqs.append((systems[0][:32], 5, {"logprobs": 0}))  # exactly 2 blocks of 16
    return reqs


def test_engine_answers_are_the_same_with_the_prefix_cache_on_and_off(model) -> None:
    """16 requests sharing system prompts, 4 decoding at a time (so cached prefixes are
    reused by requests in flight together): the same tokens, logprobs within float
    tolerance and the same ends as without the cache; the cache was used."""
    reqs = _shared_prefix_requests()
    with Engine(model, max_batch=4, max_queue=100) as engine:
        off = run_engine(engine, reqs)
    with Engine(model, max_batch=4, max_queue=100, prefix_cache=1 << 20) as engine:
        on = run_engine(engine, reqs)
        metrics = engine.metrics
    for (t0, lp0, e0), (t1, lp1, e1) in zip(off, on, strict=True):
        assert t0 == t1 and e0 == e1
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp0), atol=1e-4, rtol=0)
    assert metrics.prefix_hits >= 13 and metrics.prefix_tokens_reused >= 13 * 32
    assert metrics.prefix_misses >= 2  # the two system prompts' first requests
    assert 0 < metrics.prefix_bytes <= 1 << 20
    assert "tinylm_prefix_cache_hits_total" in metrics.render()


def test_live_server_reuses_a_shared_prompt_through_the_openai_client() -> None:
    """Two completions with one long shared start, through the official client: the
    second reuses the first's blocks (/metrics) and both answer as without the cache."""
    model, tok = tiny_model_and_tokenizer(context_length=128)
    system = "You are a helpful assistant. The cat sat on the mat. A dog ran in the park. "
    prompts = [system + "Numbers", system + "Café"]
    answers = {}
    for mib in (0, 1):
        with live_server(model, tok, model_name="m", prefix_cache=mib << 20) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            answers[mib] = [client.completions.create(
                model="m", prompt=p, max_tokens=8, temperature=0, logprobs=1)
                for p in prompts]
            text = httpx.get(url + "/metrics").text
            hits = next(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("tinylm_prefix_cache_hits_total"))
            assert hits == mib  # the second prompt reused the first's blocks (or no cache)
    for a, b in zip(answers[0], answers[1], strict=True):
        assert a.choices[0].text == b.choices[0].text
        torch.testing.assert_close(torch.tensor(b.choices[0].logprobs.token_logprobs),
                                   torch.tensor(a.choices[0].logprobs.token_logprobs),
                                   atol=1e-4, rtol=0)


def test_smollm2_answers_the_same_with_a_reused_system_prompt(smollm2_gguf, tmp_path) -> None:
    """The real model: two chat prompts sharing a system message; the second reuses its
    blocks, and both answers (greedy, 6 tokens) equal those without the cache."""
    from tinylm.io.checkpoint import load_checkpoint

    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(tmp_path)}):
        model, tok = load_checkpoint(smollm2_gguf)
    system = ("You answer questions about geography in one short sentence. " * 6).strip()
    prompts = [tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}"
                          f"<|im_end|>\n<|im_start|>assistant\n")
               for q in ("What is the capital of France?", "Where is Kyoto?")]
    reqs = [(p, 6, {"logprobs": 0}) for p in prompts]
    with Engine(model, max_batch=1, max_queue=4, threads=1) as engine:
        off = run_engine(engine, reqs)
    with Engine(model, max_batch=1, max_queue=4, threads=1, prefix_cache=64 << 20) as engine:
        on = run_engine(engine, reqs)
        assert engine.metrics.prefix_hits == 1
        assert engine.metrics.prefix_tokens_reused >= 64
    for (t0, lp0, _), (t1, lp1, _) in zip(off, on, strict=True):
        assert t0 == t1
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp0), atol=1e-3, rtol=0)
