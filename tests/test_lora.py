"""LoRA: adapter sizes, only adapters train, merging gives the same logits, gradients equal
the plain formula's on the fused native training path too, and the decoding steps step
aside for a LoRA layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.core.config import ModelConfig
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.core.model import GPT
from tinylm.layers.lora import (
    TARGETS,
    LoRALinear,
    adapter_parameters,
    apply_lora,
    apply_lora_structure,
    lora_structure,
    merge_lora,
)

CFG = ModelConfig(vocab_size=61, context_length=16, n_layer=2, n_head=2, n_embd=32,
                  dropout=0.0)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _randomise_adapters(model: nn.Module) -> None:
    """B starts at zero (no change); give it values so the adapters matter."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(0, 0.05)


def test_rank_r_adapter_has_r_times_in_plus_out_parameters() -> None:
    for rank in (1, 4, 8):
        model = apply_lora(_model(), rank)
        expected = 0
        for block in model.blocks:
            for path in TARGETS.values():
                layer = block.get_submodule(path)
                assert isinstance(layer, LoRALinear)
                n = layer.lora_A.numel() + layer.lora_B.numel()
                assert n == rank * (layer.in_features + layer.out_features)
                expected += n
        assert adapter_parameters(model) == expected
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


def test_fresh_adapter_changes_nothing_and_merge_matches_within_1e_5() -> None:
    ids = torch.randint(0, CFG.vocab_size, (3, CFG.context_length))
    base = _model().eval()
    with torch.no_grad():
        want = base(ids)
    adapted = apply_lora(_model(), 4, alpha=16, targets="qkv,down").eval()
    with torch.no_grad():
        # B = 0 (equal up to float rounding: the plain model may take a fused path)
        torch.testing.assert_close(adapted(ids), want, atol=1e-6, rtol=0)
    _randomise_adapters(adapted)
    with torch.no_grad():
        with_adapters = adapted(ids)
    assert (with_adapters - want).abs().max() > 1e-3  # the adapters matter
    merged = merge_lora(adapted)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert all(type(b.attn.qkv) is nn.Linear for b in merged.blocks)
    with torch.no_grad():
        assert (merged(ids) - with_adapters).abs().max() < 1e-5
    assert all(p.requires_grad for p in merged.parameters())


def test_only_adapter_parameters_change_in_training() -> None:
    model = apply_lora(_model(), 4).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1))
    for _ in range(3):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == n.endswith((".lora_A", ".lora_B")), n


class _MergedForm(nn.Module):
    """The reference computation: one dense product with W + (α/r)·(A·B)ᵀ, sharing the
    LoRA layer's tensors (so gradients flow to the same A and B)."""

    def __init__(self, lora: LoRALinear) -> None:
        super().__init__()
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.lora
        return F.linear(x, m.weight + (m.lora_A @ m.lora_B).t() * m.scale, m.bias)


@pytest.mark.parametrize("fast", [True, False], ids=["fused-block", "reference"])
def test_training_step_gradients_equal_the_plain_formula(fast: bool) -> None:
    from tinylm import native

    model = apply_lora(_model(), 4).train()
    _randomise_adapters(model)
    if fast:  # as training does: the LoRA blocks take the fused native block
        plan = native.accelerate(model, "cpu")
        if native.enabled():
            assert plan.paths >= {"block", "attention", "ffn"}
            assert type(model.blocks[0]).__name__ == "NativeBlock"
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.context_length + 1))

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        for p in m.parameters():
            p.grad = None
        logits = m(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    got = grads(model)
    reference = GPT(CFG)
    reference.load_state_dict(merge_lora(_copy(model)).state_dict())
    # Swap the LoRA layers into the reference as merged-form products of the same tensors.
    for i, block in enumerate(model.blocks):
        for path in TARGETS.values():
            parent, _, child = path.rpartition(".")
            setattr(reference.blocks[i].get_submodule(parent), child,
                    _MergedForm(block.get_submodule(path)))
    want = grads(reference)
    assert got.keys() == want.keys() and len(got) == 4 * CFG.n_layer * 2
    for n in got:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-4)


def _copy(model: GPT) -> GPT:
    import copy

    return copy.deepcopy(model)


def test_training_paths_take_lora_layers_and_decoding_steps_aside() -> None:
    from tinylm import native

    plain = native.eligibility(_model(), "cpu", native.load())
    model = apply_lora(_model(), 2, targets="qkv,up")
    got = native.eligibility(model, "cpu", native.load())
    assert not isinstance(model.blocks[0].attn.qkv, nn.Linear)
    if not native.enabled():  # TINYLM_NATIVE=0: every fast path is off anyway
        assert not got.blocks and not got.decode
        return
    assert plain.decode
    for before, after in zip(plain.blocks, got.blocks, strict=True):
        assert after == before  # block, attention and ffn: the same paths as the plain model
    assert not got.decode
    assert any("LoRALinear" in r for r in got.reasons)


def test_fused_block_with_partial_targets_trains_only_the_adapters() -> None:
    """Frozen layers next to adapted ones in one fused block: the frozen weights and
    norms get no gradient, the adapters get the reference gradients."""
    from tinylm import native

    model = apply_lora(_model(), 3, targets="out,down").train()
    _randomise_adapters(model)
    reference = _copy(model)
    native.accelerate(model, "cpu")
    ids = torch.randint(0, CFG.vocab_size, (3, CFG.context_length + 1))
    for m in (model, reference):
        F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                              strict=True):
        assert (p.grad is None) == (q.grad is None) == (not n.endswith(("lora_A", "lora_B")))
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4)


def test_structure_round_trip_and_bad_settings() -> None:
    model = apply_lora(_model(), 3, alpha=5, targets=["out", "up"])
    structure = lora_structure(model)
    assert structure["layers"] == {f"blocks.{i}.{p}": 3 for i in range(2)
                                   for p in ("attn.out", "ffn.up")}
    rebuilt = apply_lora_structure(_model(), structure)
    assert lora_structure(rebuilt) == structure
    assert set(rebuilt.state_dict()) == set(model.state_dict())
    assert lora_structure(_model()) == {}
    for kwargs, match in [({"rank": 0}, "rank must be"), ({"rank": 2, "alpha": -1}, "alpha"),
                          ({"rank": 2, "targets": "qkv,lm_head"}, "lm_head"),
                          ({"rank": 99}, "exceeds")]:
        with pytest.raises(ConfigError, match=match):
            apply_lora(_model(), **kwargs)
    with pytest.raises(CheckpointError, match="not a linear layer"):
        apply_lora_structure(_model(), {"layers": {"blocks.0.nope": 2},
                                        "alpha": {"blocks.0.nope": 4}})
    with pytest.raises(CheckpointError, match="malformed"):
        apply_lora_structure(_model(), [1, 2])


def test_hugging_face_export_of_a_lora_model_carries_the_adapters() -> None:
    from tinylm.io.hf import to_hf

    model = apply_lora(_model(), 2).eval()
    _randomise_adapters(model)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.context_length))
    hf = to_hf(model).eval()
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() < 1e-4
    assert any(isinstance(m, LoRALinear) for m in model.modules())  # the model is untouched
