"""Continuous batching: the ragged KV cache against full forwards of each row alone,
the engine against tinylm.generate, and a 64-client load test over HTTP."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm import generate
from tinylm.core.config import ModelConfig
from tinylm.core.decoding import KVCache, RaggedKVCache
from tinylm.core.model import GPT
from tinylm.serve.engine import End, Engine, QueueFull, Request, Token
from tinylm.use.sampling import generate_text


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def model(request):
    """GPT-2's layout, and Llama's (RMSNorm, RoPE: each row's own positions rotate its
    queries and keys; SwiGLU; 4 query heads sharing 2 key/value heads)."""
    from tinylm.core.config import ARCH_PRESETS

    torch.manual_seed(0)
    arch = dict(ARCH_PRESETS["llama"], n_head=4, n_kv_head=2) \
        if request.param == "llama-gqa" else {"n_head": 2}
    cfg = ModelConfig(**{"vocab_size": 50, "n_layer": 2, "n_embd": 32, "context_length": 24,
                         "tie_embeddings": False, **arch})
    m = GPT(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # far-apart logits: no greedy near-ties
    return m


def test_ragged_cache_rows_equal_each_sequence_alone(model):
    """Rows of different lengths step together; each row's logits equal a full forward
    of its own sequence — also after a row is removed and the last moved into its place."""
    seqs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    cache = RaggedKVCache.for_model(model, 6)
    with torch.inference_mode():
        for r, s in enumerate(seqs):
            one = KVCache.for_model(model, 1)
            model(torch.tensor([s]), one)
            cache.put(r, one)
        cache.rows = len(seqs)
        for step in range(3):
            if step == 1:
                cache.remove(1)  # row 3 moves into row 1
                seqs[1] = seqs.pop()
            nxt = [[20 + step + r] for r in range(len(seqs))]
            logits = model(torch.tensor(nxt), cache)[:, -1]  # (rows, V)
            for r, s in enumerate(seqs):
                s.append(nxt[r][0])
                ref = model(torch.tensor([s]))[0, -1]
                torch.testing.assert_close(logits[r], ref, atol=1e-5, rtol=1e-5)
        assert cache.lengths[:cache.rows].tolist() == [len(s) for s in seqs]


def test_ragged_cache_refuses_what_it_cannot_do(model):
    cache = RaggedKVCache.for_model(model, 2)
    cache.rows = 1
    one = KVCache.for_model(model, 1)
    with torch.inference_mode():
        model(torch.tensor([list(range(20))]), one)
        cache.put(0, one)
        with pytest.raises(ValueError, match="KV cache overflow: 25 positions > max_len 24"):
            model(torch.tensor([[1] * 5]), cache)  # 20 + 5 > 24
        with pytest.raises(ValueError, match="attends its rows' new tokens itself"):
            cache.update(0, one.k[0, :1, :, :2], one.v[0, :1, :, :2])
        with pytest.raises(ValueError, match="cannot keep 21"):
            cache.truncate(0, 21)


def _run(engine: Engine, requests: list[tuple[list[int], int, dict]]) -> list[list[int]]:
    outs = [[] for _ in requests]
    ends: list[End | None] = [None] * len(requests)
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            if isinstance(ev, Token):
                outs[i].append(ev.id)
            else:
                ends[i] = ev
                done.release()
        return emit
    engine.submit([Request(p, n, emitter(i), **kw) for i, (p, n, kw) in enumerate(requests)])
    for _ in requests:
        assert done.acquire(timeout=60)
    assert all(e.reason in ("stop", "length") for e in ends)
    return outs


def test_engine_answers_equal_generate_alone(model):
    """Requests of different prompt lengths and budgets join and leave the batch at
    different steps (some outgrow the context of 24 and slide); greedy answers equal
    tinylm.generate for each prompt alone, sampled ones with a seed too."""
    rng = random.Random(0)
    from tinylm.use.sampling import SamplingConfig
    reqs = []
    for i in range(24):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        kw = {"stop_ids": (7,)}
        if i % 3 == 2:
            kw |= {"sampling": SamplingConfig(1.0, top_k=20), "seed": i}
        reqs.append((prompt, rng.randint(1, 30), kw))
    with Engine(model, max_batch=5, max_queue=100) as engine:
        outs = _run(engine, reqs)
    for (prompt, n, kw), out in zip(reqs, outs, strict=True):
        s = kw.get("sampling")
        ref = generate(model, prompt, n, temperature=s.temperature if s else 0,
                       top_k=s.top_k if s else None, seed=kw.get("seed"),
                       stop_ids=[7])[0, len(prompt):].tolist()
        if 7 in ref:
            ref = ref[:ref.index(7) + 1]
        assert out == ref


def test_engine_queue_is_bounded(model):
    engine = Engine(model, max_batch=2, max_queue=3)  # not started: nothing leaves
    noop = lambda ev: None  # noqa: E731
    engine.submit([Request([1], 4, noop) for _ in range(5)])  # 2 free rows + 3 queued
    with pytest.raises(QueueFull) as e:
        engine.submit([Request([1], 4, noop)])
    assert e.value.retry_after >= 1
    assert len(engine.pending) == 5


def test_load_64_clients_x_4_requests():
    """64 concurrent clients × 4 greedy requests with different prompts and lengths:
    every request ends with a complete answer or a 429, none is lost, and every answer
    equals tinylm's generation for its prompt alone."""
    model, tok = tiny_model_and_tokenizer()
    rng = random.Random(1)
    words = "the cat sat on a mat dog ran in park café naïve 日本 attention is all".split()
    jobs = [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))),
             rng.randint(1, 16)) for _ in range(64 * 4)]
    results: list[tuple[int, str | None]] = [(0, None)] * len(jobs)
    with live_server(model, tok, max_batch=16, max_queue=64, max_tokens=16) as (url, srv):
        def client(c: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                for i in range(c * 4, c * 4 + 4):
                    prompt, n = jobs[i]
                    r = http.post("/v1/completions", json={
                        "prompt": prompt, "max_tokens": n, "temperature": 0})
                    results[i] = (r.status_code, r.json()["choices"][0]["text"]
                                  if r.status_code == 200 else None)
        with ThreadPoolExecutor(64) as pool:
            list(pool.map(client, range(64)))  # re-raises any client's exception
        assert not srv.engine.rows and not srv.engine.pending
    assert {status for status, _ in results} <= {200, 429}
    ok = [(job, text) for job, (status, text) in zip(jobs, results, strict=True)
          if status == 200]
    assert len(ok) >= len(jobs) // 2
    for (prompt, n), text in ok:
        ref = "".join(p for _, p in generate_text(model, tok, prompt, n, temperature=0))
        assert text == ref, prompt
