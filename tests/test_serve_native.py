"""Serving on the fast step (issue #30, item 3): the engine's continuous-batching step is
the fused native decoding step over a ragged batch (rows at their own positions,
joining and leaving), for fp32, int8 and 4-bit (GGUF Q4_0 / Q4_1 blocks) layers, GPT-2's
layout and a Llama-style GQA model -- and every answer equals ``tinylm.generate`` for
that prompt alone, and the reference step's answer. The real SmolLM2 (Q4_1 blocks kept
as stored) likewise, on a few requests."""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch

from serve_support import one_torch_thread  # noqa: F401  (autouse: one torch thread)
from test_blocks import kernel_forward
from tinylm import acceleration, generate
from tinylm.commands.quantize import quantize
from tinylm.core.config import ARCH_PRESETS, ModelConfig
from tinylm.core.model import GPT
from tinylm.layers.blocks import BlockLinear
from tinylm.serve.engine import End, Engine, Request, Token
from tinylm.use.sampling import SamplingConfig

pytest.importorskip("tinylm.native")

# name: (layout, quantize's arguments (None: fp32), the step's path)
MODELS = {
    "fp32": ("gpt2", None, "fused"),
    "int8": ("gpt2", {"bits": 8}, "fused"),
    "int8-group32": ("gpt2", {"bits": 8, "group_size": 32}, "fused"),
    "q4_0": ("gpt2", {"bits": 4, "group_size": 32}, "fused"),
    "q4_1": ("gpt2", {"bits": 4, "group_size": 32, "asymmetric": True}, "fused"),
    "llama-gqa": ("llama", None, "fused-variant"),
    "llama-gqa-int8": ("llama", {"bits": 8}, "fused-variant"),
    "llama-gqa-q4_1": ("llama", {"bits": 4, "group_size": 32, "asymmetric": True},
                       "fused-variant"),
}
CONTEXT, VOCAB, STOP = 32, 64, 7


def make_model(layout: str, scheme: dict | None) -> GPT:
    """A random model of far-apart logits (head scaled up: no greedy near-ties for float
    rounding to flip), quantized as ``tinylm quantize`` does (its library function, the
    head included)."""
    torch.manual_seed(0)
    arch = dict(ARCH_PRESETS["llama"], n_head=4, n_kv_head=2) if layout == "llama" \
        else {"n_head": 2}
    cfg = ModelConfig(**{"vocab_size": VOCAB, "n_layer": 2, "n_embd": 64,
                         "context_length": CONTEXT, "tie_embeddings": False, **arch})
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    if scheme is not None:
        quantize(model, include_head=True, **scheme)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    layout, scheme, path = MODELS[request.param]
    return make_model(layout, scheme), path


def requests(seed: int = 0, n: int = 18) -> list[tuple[list[int], int, dict]]:
    """Prompts of 1..20 tokens, budgets of 1..30 (some outgrow the context of 32 and
    slide), a stop id; every third sampled with a seed."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        kw = {"stop_ids": (STOP,)}
        if i % 3 == 2:
            kw |= {"sampling": SamplingConfig(1.0, top_k=20), "seed": i}
        reqs.append((prompt, rng.randint(1, 30), kw))
    return reqs


def serve_in_waves(engine: Engine, reqs: list[tuple[list[int], int, dict]], waves: int = 3
                   ) -> list[list[int]]:
    """Each request's tokens; the requests are submitted in ``waves`` waves, each after
    the previous wave's first answer ended, so rows join a batch already decoding."""
    outs: list[list[int]] = [[] for _ in reqs]
    ended = [threading.Event() for _ in reqs]

    def emitter(i):
        def emit(ev):
            if isinstance(ev, Token):
                outs[i].append(ev.id)
            else:
                assert isinstance(ev, End) and ev.reason in ("stop", "length"), ev
                ended[i].set()
        return emit
    size = -(-len(reqs) // waves)
    for start in range(0, len(reqs), size):
        wave = range(start, min(start + size, len(reqs)))
        engine.submit([Request(reqs[i][0], reqs[i][1], emitter(i), **reqs[i][2])
                       for i in wave])
        assert ended[wave[0]].wait(60)
    for e in ended:
        assert e.wait(60)
    return outs


def alone(model: GPT, prompt: list[int], n: int, kw: dict) -> list[int]:
    """tinylm.generate's answer for ``prompt`` alone (cut after its stop id)."""
    s = kw.get("sampling")
    out = generate(model, prompt, n, temperature=s.temperature if s else 0,
                   top_k=s.top_k if s else None, seed=kw.get("seed"),
                   stop_ids=[STOP])[0, len(prompt):].tolist()
    return out[:out.index(STOP) + 1] if STOP in out else out


def counting_steps(engine: Engine) -> list[int]:
    """The rows of every batched step the engine's decoder runs (recorded in place)."""
    rows: list[int] = []
    step = engine.decoder.step

    def counted(ids):
        rows.append(len(ids))
        return step(ids)
    engine.decoder.step = counted
    return rows


def test_served_answers_equal_generate_alone_on_the_native_step(case, monkeypatch) -> None:
    """Rows of different prompt lengths join (in waves) and leave (different budgets,
    stop ids) a batch that the fused native step decodes; each answer equals
    tinylm.generate for its prompt alone, and the reference step's answer (for GGUF
    blocks the reference with the kernel's arithmetic, activations quantized per block
    of 32 as llama.cpp does: tests/test_blocks.py holds the kernel to it)."""
    model, path = case
    reqs = requests()
    engine = Engine(model, max_batch=5, max_queue=100)
    assert (engine.decoder.path, engine.decoder.reason) == (path, None)
    steps = counting_steps(engine)
    with engine:
        native = serve_in_waves(engine, reqs)
    assert max(steps) == 5 and min(steps) < 5  # full batches, and ragged ones
    assert sum(steps) == sum(len(o) - 1 for o in native)  # every later token: the step
    for (prompt, n, kw), out in zip(reqs, native, strict=True):
        assert out == alone(model, prompt, n, kw)
    monkeypatch.setattr(BlockLinear, "forward", kernel_forward)
    with acceleration.disabled():  # the decision is made here, once
        reference = Engine(model, max_batch=5, max_queue=100)
    assert reference.decoder.path == "torch" and "off" in reference.decoder.reason
    with reference:
        assert serve_in_waves(reference, reqs) == native


@pytest.mark.parametrize("name", ["q4_1", "llama-gqa-int8"])
def test_prefix_reuse_on_the_native_step_equals_generate(name) -> None:
    """With the prefix cache (on by default in tinylm serve), a prompt's rest after its
    reused blocks runs through the same plan as generate's prefill (int8 and GGUF-block
    layers: the fused step, the kernel's arithmetic), so answers still equal generate."""
    layout, scheme, path = MODELS[name]
    model = make_model(layout, scheme)
    rng = random.Random(2)
    shared = [rng.randrange(VOCAB) for _ in range(17)]  # one whole block of 16 reused
    reqs = [(shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
             rng.randint(2, 12), {"stop_ids": (STOP,)}) for _ in range(8)]
    engine = Engine(model, max_batch=3, max_queue=100, prefix_cache=1 << 20)
    with engine:
        outs = serve_in_waves(engine, reqs)
    assert engine.prefix.tokens_reused >= 16 * 5
    for (prompt, n, kw), out in zip(reqs, outs, strict=True):
        assert out == alone(model, prompt, n, kw)


def test_the_step_is_logged_once_and_falls_back_for_a_model_it_does_not_take(caplog
                                                                             ) -> None:
    """A model with a low-rank layer (no fused step for it) serves on the reference step,
    saying why, with the same answers as generate."""
    from tinylm.layers.lowrank import LowRankLinear

    model = make_model("gpt2", None)
    model.blocks[0].ffn.up = LowRankLinear.from_linear(model.blocks[0].ffn.up, 8)
    with caplog.at_level(logging.INFO, logger="tinylm.serve.engine"):
        engine = Engine(model, max_batch=3, max_queue=100)
        with engine:
            outs = serve_in_waves(engine, requests(1, 6))
    assert engine.decoder.path == "torch"
    lines = [r.getMessage() for r in caplog.records if "serving on" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("serving on the reference step: ")
    assert "fused decoding step steps aside" in lines[0]
    for (prompt, n, kw), out in zip(requests(1, 6), outs, strict=True):
        assert out == alone(model, prompt, n, kw)


def test_smollm2_served_on_the_native_step_equals_generate(smollm2_gguf) -> None:
    """The real model, its Q4_1 blocks kept as stored (--keep-quantized): chat prompts of
    different lengths decode together in the variants' fused step; each greedy answer
    equals tinylm.generate for its prompt alone."""
    from tinylm.data.chat import render_chat
    from tinylm.io.gguf_checkpoint import load_gguf

    model, tok, _ = load_gguf(smollm2_gguf, keep_quantized=True)
    questions = ["What is the capital of France?", "Name three colours.",
                 "Write a Python function that adds two numbers.", "Say hello."]
    prompts = [render_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    reqs = [(p, n, {}) for p, n in zip(prompts, (12, 20, 16, 6), strict=True)]
    engine = Engine(model, max_batch=4, max_queue=10, threads=1)
    assert engine.decoder.path == "fused-variant"
    steps = counting_steps(engine)
    with engine:
        outs = serve_in_waves(engine, reqs, waves=2)
    assert max(steps) > 1
    for (prompt, n, _), out in zip(reqs, outs, strict=True):
        want = generate(model, prompt, n, temperature=0)[0, len(prompt):].tolist()
        assert out == want
