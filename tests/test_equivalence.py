"""Every accelerated path equals the reference model, end to end.

The reference is the model as written, through the note's explicit attention
(``GPT.forward_with_attention``: scores, mask, softmax, weighted sum). Against it:

- ``sdpa``: the same modules through ``F.scaled_dot_product_attention``;
- ``ffn``: + the FFN as one recomputing autograd step (what CUDA gets);
- ``ops``: + the native causal attention (per-module native ops, CPU);
- ``block``: + the whole block as one native autograd step (CPU), i.e. ``accelerate``.

A whole training step is compared: the loss and every parameter's gradient. Tolerances:
the loss to rtol 1e-5 / atol 1e-6 and each gradient to rtol 1e-4 / atol 1e-5 (float32;
the paths sum in different orders). Greedy decoding is compared exactly: 64 tokens from
each decoding plan equal those of repeated full forwards of the reference model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import pytest
import torch
from torch import nn

from tinylm import GPT, ModelConfig, generate
from tinylm.commands.compress import compress
from tinylm.commands.quantize import quantize
from tinylm.core.config import ModelConfig as _Config
from tinylm.core.decoding import Decoder
from tinylm.core.model import lm_loss

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import functions  # noqa: E402

NATIVE = os.environ.get("TINYLM_NATIVE") != "0"
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)

# name -> (config, C): biases on/off, odd head counts, untied head, a head size the
# native attention does not take (D=12), and a context over its limit (C=260 > 256).
SHAPES = {
    "bias-tied": (dict(n_layer=2, n_head=2, n_embd=32), 37),
    "nobias-untied-3heads": (dict(n_layer=2, n_head=3, n_embd=48, bias=False,
                                  tie_embeddings=False), 21),
    "5heads-D16": (dict(n_layer=1, n_head=5, n_embd=80), 9),
    "D12-not-native": (dict(n_layer=1, n_head=3, n_embd=36), 17),
    "C-over-limit": (dict(n_layer=1, n_head=1, n_embd=16, context_length=300), 260),
}
PATHS = {"sdpa": (), "ffn": ("ffn",), "ops": ("ffn", "attention"),
         "block": ("ffn", "attention", "block")}


def make(shape: str, seed: int = 0) -> tuple[GPT, torch.Tensor]:
    kw, C = SHAPES[shape]
    kw = dict(dict(vocab_size=50, context_length=40), **kw)
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():  # off the init values (ones/zeros): all grads differ
            p += 0.05 * torch.randn_like(p)
    return model, torch.randint(0, 50, (3, C + 1))


def reference_step(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logits, _ = model.forward_with_attention(ids[:, :-1])  # the explicit path
    loss = lm_loss(logits, ids[:, 1:])
    return loss, list(torch.autograd.grad(loss, list(model.parameters())))


def step(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    return loss, list(torch.autograd.grad(loss, list(model.parameters())))


class Calls:
    """Counts the applications of each accelerated autograd Function."""

    def __init__(self, monkeypatch) -> None:
        self.n = {"block": 0, "attention": 0, "ffn": 0}
        for name, fn in (("block", functions.BlockFn), ("attention", functions.CausalAttentionFn),
                         ("ffn", functions.FeedForwardFn)):
            real = fn.apply
            monkeypatch.setattr(fn, "apply", self._counting(name, real))

    def _counting(self, name, real):
        def apply(*args):
            self.n[name] += 1
            return real(*args)
        return apply


def expected_calls(shape: str, path: str) -> dict[str, int]:
    kw, C = SHAPES[shape]
    L = kw["n_layer"]
    native_attention = NATIVE and kw["n_embd"] // kw["n_head"] % 16 == 0 and C <= 256
    want = {"block": 0, "attention": 0, "ffn": 0}
    on = PATHS[path] if NATIVE else ()  # TINYLM_NATIVE=0: every path off
    if "block" in on and native_attention:
        want["block"] = L
    else:
        if "attention" in on and native_attention:
            want["attention"] = L
        if "ffn" in on:
            want["ffn"] = L
    return want


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_training_step_equals_the_reference(monkeypatch, shape: str, path: str) -> None:
    model, ids = make(shape)
    want_loss, want_grads = reference_step(model, ids)
    plan = native.plan(model, "cpu").apply(PATHS[path])
    calls = Calls(monkeypatch)
    loss, grads = step(model, ids)
    assert calls.n == expected_calls(shape, path)
    torch.testing.assert_close(loss, want_loss, **LOSS_TOL)
    names = [n for n, _ in model.named_parameters()]
    for name, g, w in zip(names, grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    plan.restore()
    assert all(type(b).__name__ == "Block" for b in model.blocks)


def assert_step_equals(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], **LOSS_TOL)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL)


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fast path, no scratch buffers")
@pytest.mark.parametrize("one_call", [True, False], ids=["one-native-call", "composed"])
def test_reused_scratch_buffers_keep_every_step_equal_to_the_reference(one_call) -> None:
    """The whole-block step keeps its temporaries in per-thread buffers that every block
    and step reuses: interleaved steps of models of other sizes, and steps in two
    threads at once, still give the reference's loss and gradients -- both as one native
    call per block and direction (csrc/train_block.c, where every product is on
    tinylm's kernel, as at these sizes) and composed kernel by kernel in Python."""
    with contextlib.nullcontext() if one_call else functions.composed_blocks():
        _scratch_buffers_reused(one_call)


def _scratch_buffers_reused(one_call: bool) -> None:
    functions.SCRATCH.buffers.clear()
    runs = [make("bias-tied"), make("5heads-D16", seed=1), make("nobias-untied-3heads", 2)]
    wants = [reference_step(m, ids) for m, ids in runs]
    for m, _ in runs:
        native.plan(m, "cpu").apply()
    for _ in range(2):  # each model after the others: every buffer changes shape
        for (m, ids), want in zip(runs, wants, strict=True):
            assert_step_equals(step(m, ids), want)
    kept = {n: t.data_ptr() for n, t in functions.SCRATCH.buffers.items()}
    # dL/dqkv and dL/dR live in the FFN's two buffers (dead by then): no buffers of their
    # own; the one call keeps its two (B·C, E) temporaries too
    assert set(kept) == {"ffn_act", "ffn_grad"} | (
        {"block_t1", "block_gx1"} if one_call else set())
    step(*runs[-1])  # the same shapes again: the same buffers
    assert {n: t.data_ptr() for n, t in functions.SCRATCH.buffers.items()} == kept
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, step(*runs[i])))
               for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 2):
        assert_step_equals(got[i], wants[i])


def test_scratch_views_share_a_buffer_only_where_it_holds_enough() -> None:
    scratch = functions.Scratch()
    host = scratch.get("a", (4, 8))
    view = scratch.get("b", (3, 8), within="a")
    assert view.data_ptr() == host.data_ptr() and view.shape == (3, 8)
    assert "b" not in scratch.buffers
    own = scratch.get("b", (5, 8), within="a")  # more than "a" holds: a buffer of its own
    assert own.data_ptr() != host.data_ptr() and scratch.buffers["b"] is own
    assert scratch.get("b", (3, 8), within="a").data_ptr() == host.data_ptr()
    assert "b" not in scratch.buffers  # the own buffer is dropped again
    assert scratch.get("c", (2, 2), within="missing").shape == (2, 2)


def reference_greedy(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model.forward_with_attention(seq)  # the whole sequence, every time
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def decoders(model: GPT):
    lib = native.load()
    yield Decoder(model, 2)
    if lib is not None:
        yield native.decoding.NativeCacheDecoder(model, 2, lib)
        yield native.decoding.FusedDecoder(model, 2, lib)


def plan_tokens(decoder: Decoder, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    with torch.inference_mode():
        logits = decoder.prefill(prompt)
        for i in range(n):
            nxt = decoder.argmax(logits)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if i < n - 1:
                logits = decoder.step(nxt)
    return seq


@pytest.mark.parametrize("kw", [dict(bias=True), dict(bias=False, tie_embeddings=False,
                                                      n_head=3, n_embd=48)])
def test_64_greedy_tokens_of_every_decoding_plan_equal_full_forwards(kw: dict) -> None:
    cfg = dict(vocab_size=61, context_length=80, n_layer=2, n_head=2, n_embd=32) | kw
    torch.manual_seed(1)
    model = GPT(ModelConfig(**cfg)).eval()
    prompt = torch.randint(0, 61, (2, 8))
    want = reference_greedy(model, prompt, 64)
    paths = []
    for decoder in decoders(model):
        paths.append(decoder.path)
        assert torch.equal(plan_tokens(decoder, prompt, 64), want), decoder.path
    assert paths == (["torch", "cache", "fused"] if NATIVE else ["torch"])
    assert torch.equal(generate(model, prompt, 64, temperature=0), want)  # generate's plan


def test_64_greedy_tokens_of_a_quantized_model_equal_full_forwards() -> None:
    """The int8 kernel of the fused step (csrc/quant.c) against the reference
    QuantizedLinear (dequantize, then F.linear): the same 64 greedy tokens, and every
    step's logits within 1e-4 of the reference decoder's (float32 summation order)."""
    cfg = dict(vocab_size=61, context_length=80, n_layer=1, n_head=3, n_embd=45,
               tie_embeddings=False)  # 45, 135, 180, 61: no multiple of a vector width
    torch.manual_seed(2)
    model = GPT(ModelConfig(**cfg)).eval()
    quantize(model, 8, 7, layers=["attn.qkv", "ffn.up", "ffn.down"], include_head=True)
    quantize(model, 8, None, layers=["attn.out"])  # per channel and per group of 7
    prompt = torch.randint(0, 61, (2, 8))
    want = reference_greedy(model, prompt, 64)
    paths = []
    for decoder in decoders(model):
        paths.append(decoder.path)
        assert torch.equal(plan_tokens(decoder, prompt, 64), want), decoder.path
    assert paths == (["torch", "cache", "fused"] if NATIVE else ["torch"])
    assert torch.equal(generate(model, prompt, 64, temperature=0), want)
    if NATIVE:
        plan = native.plan(model, "cpu")
        assert plan.paths == {"decode"}  # training paths step aside for QuantizedLinear
        assert any("QuantizedLinear" in r for r in plan.eligibility.reasons)
        ref, fused = Decoder(model, 2), plan.decoder(2)
        with torch.inference_mode():
            a, b = ref.prefill(want[:, :8]), fused.prefill(want[:, :8])
            for t in range(8, 72):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
                a, b = ref.step(want[:, t]), fused.step(want[:, t])


# --- replaced parts are honoured or step aside ---------------------------------------------


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fast path to step aside")
def test_a_replaced_activation_is_honoured_in_training(monkeypatch) -> None:
    model, ids = make("bias-tied")
    model.blocks[0].ffn.act = nn.SiLU()  # an architecture change in one block
    want_loss, want_grads = reference_step(model, ids)
    plan = native.accelerate(model, "cpu")
    assert not plan.eligibility.blocks[0].ffn and not plan.eligibility.blocks[0].block
    assert plan.eligibility.blocks[1].ffn and not plan.eligibility.decode
    assert any("SiLU" in r for r in plan.eligibility.reasons)
    calls = Calls(monkeypatch)
    loss, grads = step(model, ids)
    torch.testing.assert_close(loss, want_loss, **LOSS_TOL)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL)
    assert calls.n["ffn"] + calls.n["block"] == 1  # block 1 only
    model.blocks[1].ffn.act = nn.ReLU()  # replaced after the decision: steps aside too
    calls.n = dict.fromkeys(calls.n, 0)
    want_loss, _ = reference_step(model, ids)
    loss, _ = step(model, ids)
    torch.testing.assert_close(loss, want_loss, **LOSS_TOL)
    assert calls.n == {"block": 0, "attention": calls.n["attention"], "ffn": 0}


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fast path to step aside")
def test_lowrank_layers_make_the_paths_step_aside() -> None:
    model, ids = make("bias-tied")
    compress(model, rank=8)
    want_loss, want_grads = reference_step(model, ids)
    plan = native.accelerate(model, "cpu")
    assert not any(b.block or b.ffn for b in plan.eligibility.blocks)
    assert not plan.eligibility.decode
    loss, grads = step(model, ids)
    torch.testing.assert_close(loss, want_loss, **LOSS_TOL)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **GRAD_TOL)
    with plan.decoder(1) as decoder:
        assert decoder.path == "cache"


@dataclasses.dataclass(frozen=True)
class _VariantConfig(_Config):
    alibi: bool = False  # a field a later architecture variant might add


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fast path to step aside")
def test_an_unknown_config_field_makes_every_path_step_aside() -> None:
    base = dict(vocab_size=50, context_length=16, n_layer=1, n_head=1, n_embd=16)
    assert native.plan(GPT(_VariantConfig(**base)), "cpu").paths == {
        "block", "attention", "ffn", "decode"}
    odd = native.plan(GPT(_VariantConfig(**base, alibi=True)), "cpu")
    assert odd.paths == set() and any("alibi" in r for r in odd.eligibility.reasons)
    # a known variant (RMSNorm) keeps the variants' training block and decoding step,
    # unless a field is new
    rms = native.plan(GPT(_VariantConfig(**base, norm="rmsnorm")), "cpu")
    assert rms.paths == {"block", "decode"} and rms.decoder(1).path == "fused-variant"
    both = native.plan(GPT(_VariantConfig(**base, norm="rmsnorm", alibi=True)), "cpu")
    assert both.paths == set() and any("alibi" in r for r in both.eligibility.reasons)


# --- one switch --------------------------------------------------------------------------


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fast path to step aside")
def test_disabled_turns_off_every_fast_path(monkeypatch) -> None:
    model, ids = make("bias-tied")
    native.accelerate(model, "cpu")
    calls = Calls(monkeypatch)
    with native.disabled():
        assert not native.enabled()
        step(model, ids)
        assert calls.n == {"block": 0, "attention": 0, "ffn": 0}  # the FFN's too
        assert native.plan(model, "cpu").paths == set()
        with native.plan(model, "cpu").decoder(1) as decoder:
            assert decoder.path == "torch"
    step(model, ids)
    assert sum(calls.n.values()) > 0
