"""The variants' fused training block (tinylm.native.variants.VariantBlockFn) against the
reference modules: the same loss and every parameter's gradient, for each layout it
takes (RMSNorm or LayerNorm, RoPE or learned positions, QK-norm, GELU / ReLU² / SwiGLU,
biases or none, LoRA layers), and stepping aside where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch

from tinylm.core.config import ModelConfig, resolve_arch
from tinylm.core.model import GPT
from tinylm.layers.lora import apply_lora
from tinylm.use.evaluation import evaluate

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import variants  # noqa: E402

pytestmark = pytest.mark.skipif(not native.enabled() or native.load() is None,
                                reason="the native library is off (TINYLM_NATIVE=0)")

LAYOUTS = {
    "modern": resolve_arch("modern", {}),
    "llama": resolve_arch("llama", {}),
    "rms-gelu-bias": {"norm": "rmsnorm", "mlp": "gelu", "bias": True},
    "rope-layernorm-qkv-bias": {"position": "rope", "bias": False, "qkv_bias": True},
    "qknorm-learned-relu2-bias": {"qk_norm": True, "mlp": "relu2", "bias": True},
    "swiglu-bias-head32": {"mlp": "swiglu", "bias": True, "norm": "rmsnorm",
                           "head_dim": 32, "ffn_hidden": 72},
    "llama-gqa-2-of-4": {**resolve_arch("llama", {}), "n_head": 4, "n_kv_head": 2},
    "modern-mqa-qkv-bias": {**resolve_arch("modern", {}), "n_head": 4, "n_kv_head": 1,
                            "qkv_bias": True},
    "gpt2-gqa": {"n_head": 4, "n_kv_head": 2},
}


def _pair(fields: dict, vocab: int = 37) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": vocab, "context_length": 24, "n_layer": 2,
                         "n_head": 2, "n_embd": 48, "dropout": 0.0, **fields})
    reference = GPT(cfg).train()
    with torch.no_grad():  # non-trivial norm gains and biases
        for p in reference.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    fused = copy.deepcopy(reference)
    native.accelerate(fused, "cpu")
    return reference, fused


def _grads(model: GPT, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_variant_block_equals_the_reference_modules(name: str) -> None:
    fields = {"head_dim": 16, **LAYOUTS[name]}
    reference, fused = _pair(fields)
    assert type(fused.blocks[0]).__name__ == "NativeVariantBlock"
    ids = torch.randint(0, 37, (3, 21), generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 20, 48, requires_grad=True)
    assert type(fused.blocks[0](x).grad_fn).__name__ == "VariantBlockFnBackward"
    want_loss, want = _grads(reference, ids)
    got_loss, got = _grads(fused, ids)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got.keys() == want.keys() and len(got) == len(list(reference.parameters()))
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=2e-5, rtol=1e-4, msg=n)


def test_variant_block_trains_lora_adapters_only() -> None:
    reference, _ = _pair({"head_dim": 16, **LAYOUTS["modern"]})
    apply_lora(reference, 3)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)
    fused = copy.deepcopy(reference)
    assert native.accelerate(fused, "cpu").paths >= {"block"}
    assert type(fused.blocks[1]).__name__ == "NativeVariantBlock"
    ids = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(2))
    _, want = _grads(reference, ids)
    _, got = _grads(fused, ids)
    assert got.keys() == want.keys() and all(n.endswith(("lora_A", "lora_B")) for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=2e-5, rtol=1e-4, msg=n)


def test_variant_block_steps_aside_for_odd_heads_and_dropout_and_runs_in_eval() -> None:
    _, odd = _pair({"head_dim": 8, **resolve_arch("llama", {})})  # the kernel takes 16·k
    assert type(odd.blocks[0]).__name__ == "Block"
    decision = native.eligibility(odd, "cpu", native.load())
    assert not any(b.block for b in decision.blocks) and decision.decode_variant
    reference, fused = _pair({"head_dim": 16, **LAYOUTS["modern"]})
    ids = torch.randint(0, 37, (2, 17))
    for mode in (torch.no_grad, torch.inference_mode):  # evaluation takes the block too
        with mode():
            torch.testing.assert_close(fused(ids), reference(ids), atol=1e-5, rtol=1e-5)
    plain = fused.loss(ids[:, :-1], ids[:, 1:])
    fused.blocks[0].drop.p = 0.5  # active dropout: block 0's reference forward runs
    torch.manual_seed(3)
    a = fused.loss(ids[:, :-1], ids[:, 1:])
    reference.blocks[0].drop.p = 0.5
    torch.manual_seed(3)
    b = reference.loss(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # same dropout masks
    assert abs(a.item() - plain.item()) > 1e-3  # and the dropout was applied


def test_rope_tables_made_in_an_evaluation_serve_training() -> None:
    """The rotary tables are cached per shape; one made under inference_mode must
    still be saved for backward by a training step at the same context."""
    from tinylm.native.variants import rope_tables

    rope_tables.cache_clear()
    reference, fused = _pair({"head_dim": 16, **LAYOUTS["modern"]})
    ids = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        fused(ids[:, :-1])
    _, want = _grads(reference, ids)
    _, got = _grads(fused, ids)
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["gpt2", "modern", "llama-gqa-2-of-4",
                                  "rope-layernorm-qkv-bias", "qknorm-learned-relu2-bias"])
def test_blocks_without_gradients_run_the_inference_block_and_equal_the_reference(
        name: str) -> None:
    """Without gradients every block (GPT-2's too) is variants.block_inference: its
    temporaries in the reused per-thread buffers, the reference's logits, an output that
    a later call (another batch shape, then the same) does not overwrite, and
    ``evaluate``'s loss over a split equal to the reference model's."""
    reference, fused = _pair({"head_dim": 16, **LAYOUTS.get(name, {})})
    assert type(fused.blocks[0]).__name__ == ("NativeBlock" if name == "gpt2"
                                              else "NativeVariantBlock")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 37, (3, 20), generator=g), torch.randint(0, 37, (2, 24), generator=g)
    variants.INFERENCE.buffers.clear()
    with torch.inference_mode():
        got_a = fused(a)
        assert variants.INFERENCE.buffers["qkv"].shape[0] == 3 * 20  # the path ran
        got_b, again = fused(b), fused(a)
    with torch.no_grad():
        want_a, want_b = reference(a), reference(b)
        torch.testing.assert_close(fused(b), want_b, atol=1e-5, rtol=1e-5)
    for got, want in ((got_a, want_a), (got_b, want_b), (again, want_a)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tokens = torch.randint(0, 37, (300,), generator=g)
    want = evaluate(reference, tokens, context_length=24, batch_size=4)
    with native.disabled():  # the reference modules of the same model, as a second check
        off = evaluate(fused, tokens, context_length=24, batch_size=4)
    got = evaluate(fused, tokens, context_length=24, batch_size=4)
    assert got.tokens == want.tokens == 299
    assert got.loss == pytest.approx(want.loss, rel=1e-5) == off.loss
