"""Architecture variants in the reference model: config validation, RoPE against its
closed form, grouped-query attention against multi-head attention with shared heads,
every path (SDPA, explicit maps, per-head sum form, KV cache, decoding, compress,
checkpoints) agreeing for every variant, presets, and old checkpoints loading unchanged."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tinylm.acceleration import accelerate, plan
from tinylm.commands.compress import compress
from tinylm.core.attention import MultiHeadAttention, apply_rope, rope_angles
from tinylm.core.config import ARCH_PRESETS, ModelConfig, resolve_arch
from tinylm.core.decoding import KVCache
from tinylm.core.errors import ConfigError
from tinylm.core.model import GPT, parameter_count
from tinylm.io.checkpoint import load_model
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.lowrank import dense_weight, structure_of

BASE = dict(vocab_size=53, context_length=24, n_layer=2, n_head=4, n_embd=32)
VARIANTS = {
    "gpt2": {},
    "llama-gqa2": dict(ARCH_PRESETS["llama"], n_kv_head=2),
    "modern-mqa": dict(ARCH_PRESETS["modern"], n_kv_head=1),
    "rope-layernorm-D6": dict(position="rope", head_dim=6, bias=True),
    "rmsnorm-relu2-qkvbias": dict(norm="rmsnorm", mlp="relu2", bias=False, qkv_bias=True,
                                  ffn_hidden=40),
    "swiglu-learned-qknorm": dict(mlp="swiglu", qk_norm=True, tie_embeddings=False),
}


def build(name: str, **changes) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**BASE, **VARIANTS[name], **changes})).eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "ln" in pname or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, field", [
    ({"norm": "batchnorm"}, "norm"), ({"position": "alibi"}, "position"),
    ({"mlp": "geglu"}, "mlp"), ({"n_kv_head": 3}, "n_kv_head"), ({"n_kv_head": 0}, "n_kv_head"),
    ({"position": "rope", "head_dim": 5}, "head_dim"), ({"rope_theta": 0}, "rope_theta"),
    ({"rope_theta": float("inf")}, "rope_theta"), ({"ffn_hidden": 0}, "ffn_hidden"),
    ({"qk_norm": "yes"}, "qk_norm"), ({"qkv_bias": 1}, "qkv_bias"), ({"norm_eps": 0}, "norm_eps"),
])
def test_bad_variant_fields_name_the_field(changes, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**BASE, **changes})


def test_contradictory_and_unknown_fields_in_config_json() -> None:
    with pytest.raises(ConfigError, match="layer_norm_eps.*norm_eps"):
        ModelConfig.from_dict({**BASE, "layer_norm_eps": 1e-5, "norm_eps": 1e-6})
    with pytest.raises(ConfigError, match="rope_scaling"):
        ModelConfig.from_dict({**BASE, "rope_scaling": 2.0})


def test_defaults_are_gpt2_and_presets_fill_fields_under_explicit_ones() -> None:
    cfg = ModelConfig(**BASE)
    assert cfg.gpt2_layout and cfg.n_kv_head == 4 and cfg.qkv_bias and cfg.ffn_dim == 128
    assert ModelConfig(**BASE, **resolve_arch("gpt2", {})).gpt2_layout
    modern = ModelConfig(**BASE, **resolve_arch("modern", {}))
    assert (modern.norm, modern.position, modern.mlp, modern.qk_norm, modern.bias,
            modern.tie_embeddings) == ("rmsnorm", "rope", "relu2", True, False, False)
    mixed = resolve_arch("modern", {"mlp": "gelu", "bias": True})
    assert mixed["mlp"] == "gelu" and mixed["bias"] is True and mixed["norm"] == "rmsnorm"
    assert ModelConfig(**BASE, mlp="swiglu").ffn_dim == 88  # 8·32/3 = 85.3 -> 88
    with pytest.raises(ConfigError, match="--arch"):
        resolve_arch("mamba", {})


@pytest.mark.parametrize("name", VARIANTS)
def test_parameter_count_closed_form(name) -> None:
    model = build(name)
    assert parameter_count(model.config) == model.num_parameters()


def test_checkpoint_written_before_the_variants_loads_unchanged(tmp_path) -> None:
    """A config.json of the old format: no new fields, layer_norm_eps instead of norm_eps."""
    model = build("gpt2")
    dest = save_checkpoint(tmp_path / "ck", model)
    path = dest / "config.json"
    doc = json.loads(path.read_text())
    new = {"norm", "norm_eps", "position", "rope_theta", "mlp", "ffn_hidden", "n_kv_head",
           "qk_norm", "qkv_bias"}
    old = {k: v for k, v in doc["model"].items() if k not in new}
    old["layer_norm_eps"] = doc["model"]["norm_eps"]
    path.write_text(json.dumps({**doc, "model": old}))
    loaded = load_model(dest)
    assert loaded.config == model.config
    ids = torch.randint(0, 53, (2, 24))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize("name", ["llama-gqa2", "modern-mqa"])
def test_variant_checkpoint_round_trip(name, tmp_path) -> None:
    model = build(name)
    loaded = load_model(save_checkpoint(tmp_path / "ck", model))
    assert loaded.config == model.config and loaded.pos_emb is None
    ids = torch.randint(0, 53, (1, 24))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


# --- RoPE against its closed form -------------------------------------------------------------


def test_rope_rotation_preserves_norms_and_position_zero_is_identity() -> None:
    x = torch.randn(2, 3, 16, 8)
    cos, sin = rope_angles(0, 16, 8, 10000.0)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[..., 0, :], x[..., 0, :])
    # pair 0 turns by exactly m radians (ω_0 = 1): the closed form of a 2-D rotation.
    m = 5
    c, s = math.cos(m), math.sin(m)
    x0, x4 = x[..., m, 0], x[..., m, 4]
    torch.testing.assert_close(rotated[..., m, 0], x0 * c - x4 * s)
    torch.testing.assert_close(rotated[..., m, 4], x4 * c + x0 * s)


def test_rope_score_depends_only_on_relative_position() -> None:
    torch.manual_seed(1)
    D = 12
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cm, sm = (t.double() for t in rope_angles(m, 1, D, 100.0))
        cn, sn = (t.double() for t in rope_angles(n, 1, D, 100.0))
        return float(apply_rope(q, cm[0], sm[0]) @ apply_rope(k, cn[0], sn[0]))

    for delta in (0, 1, 3, 7):
        scores = [score(n + delta, n) for n in (0, 2, 9, 15)]
        assert max(scores) - min(scores) < 1e-5, (delta, scores)  # float32 angles
    assert abs(score(3, 0) - score(0, 3)) > 1e-3  # but the sign of m − n matters


# --- grouped-query attention --------------------------------------------------------------


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_gqa_equals_multi_head_attention_with_shared_key_value_heads(n_kv_head) -> None:
    """GQA is MHA whose query heads i read key/value head i // (H / H_kv): copy the shared
    K/V weights into a full MHA and both give the same output."""
    torch.manual_seed(2)
    E, H, D = 24, 4, 6
    gqa = MultiHeadAttention(E, H, D, n_kv_head=n_kv_head, rope_theta=1e4, qk_norm=True).eval()
    mha = MultiHeadAttention(E, H, D, rope_theta=1e4, qk_norm=True).eval()
    rep = H // n_kv_head
    with torch.no_grad():
        wq, wk, wv = gqa.qkv.weight.split([H * D, n_kv_head * D, n_kv_head * D])
        bq, bk, bv = gqa.qkv.bias.split([H * D, n_kv_head * D, n_kv_head * D])

        def widen(t):
            return t.view(n_kv_head, D, *t.shape[1:]).repeat_interleave(rep, 0).reshape(
                H * D, *t.shape[1:])

        mha.qkv.weight.copy_(torch.cat([wq, widen(wk), widen(wv)]))
        mha.qkv.bias.copy_(torch.cat([bq, widen(bk), widen(bv)]))
        mha.out.load_state_dict(gqa.out.state_dict())
        mha.q_norm.load_state_dict(gqa.q_norm.state_dict())
        mha.k_norm.load_state_dict(gqa.k_norm.state_dict())
        x = torch.randn(2, 9, E)
        torch.testing.assert_close(gqa(x), mha(x))
        torch.testing.assert_close(gqa.forward_sum_form(x), mha(x))
        _, w_gqa = gqa(x, return_weights=True)
        _, w_mha = mha(x, return_weights=True)
        torch.testing.assert_close(w_gqa, w_mha)


# --- every path agrees, for every variant ----------------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_sdpa_explicit_sum_form_and_cache_agree(name) -> None:
    model = build(name)
    cfg = model.config
    ids = torch.randint(0, 53, (2, 24))
    with torch.no_grad():
        logits = model(ids)
        explicit, maps = model.forward_with_attention(ids)
        torch.testing.assert_close(explicit, logits, atol=1e-5, rtol=0)
        assert maps.shape == (cfg.n_layer, 2, cfg.n_head, 24, 24)
        torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]))
        assert torch.all(maps.triu(1) == 0)  # causal
        x = model.blocks[0].ln1(model._embed(ids, 0))
        attn = model.blocks[0].attn
        torch.testing.assert_close(attn.forward_sum_form(x), attn(x), atol=1e-5, rtol=0)
        cache = KVCache.for_model(model, 2)
        assert cache.k.numel() * cfg.n_head == KVCache(
            cfg.n_layer, 2, cfg.n_head, cfg.context_length, cfg.head_dim).k.numel() * cfg.n_kv_head
        steps = [model(ids[:, :7], cache)] + [model(ids[:, t:t + 3], cache)
                                              for t in range(7, 13, 3)]
        steps += [model(ids[:, t:t + 1], cache) for t in range(13, 24)]
        torch.testing.assert_close(torch.cat(steps, 1), logits, atol=1e-5, rtol=0)
        decision = plan(model)
        if not cfg.gpt2_layout:  # training's native paths implement GPT-2's layout only;
            # decoding has a fused step for every variant
            assert decision.paths == (frozenset({"decode"}) if decision.eligibility.native
                                      else frozenset())
        with decision.decoder(2) as decoder:
            if decision.eligibility.native:
                assert decoder.path == ("fused" if cfg.gpt2_layout else "fused-variant")
            out = [decoder.prefill(ids[:, :5])]
            out += [decoder.step(ids[:, t]) for t in range(5, 24)]
        torch.testing.assert_close(torch.stack(out, 1), logits[:, 4:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa2", "modern-mqa", "rope-layernorm-D6"])
def test_causality_and_training_gradients(name) -> None:
    model = build(name).train()
    accelerate(model)  # steps aside for every variant: the reference modules train
    assert type(model.blocks[0]).__name__ == "Block"
    ids = torch.randint(0, 53, (2, 24))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 53
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # reference autograd through explicit attention gives the same gradients
    model.zero_grad()
    explicit, _ = model.forward_with_attention(ids[:, :-1])
    torch.nn.functional.cross_entropy(explicit.reshape(-1, 53), ids[:, 1:].reshape(-1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4)


def test_compress_factorises_gate_up_and_down_of_a_gated_mlp() -> None:
    model = build("llama-gqa2")
    gate = model.blocks[1].ffn.gate.weight.detach().clone()
    compress(model, rank=4)
    kinds = {name.split(".", 2)[-1] for name in structure_of(model)}
    assert kinds == {"attn.qkv", "attn.out", "ffn.gate", "ffn.up", "ffn.down"}
    # the factorised gate is the best rank-4 approximation (Eckart–Young)
    u, s, vh = torch.linalg.svd(gate.double())
    best = (u[:, :4] * s[:4]) @ vh[:4]
    torch.testing.assert_close(dense_weight(model.blocks[1].ffn.gate).t().double(), best,
                               atol=1e-5, rtol=0)
    gpt2 = build("gpt2")
    compress(gpt2, rank=4)  # ffn.gate is a default kind GPT-2 lacks: skipped, not an error
    assert {n.split(".", 2)[-1] for n in structure_of(gpt2)} == {"attn.qkv", "attn.out",
                                                                 "ffn.up", "ffn.down"}


def test_explain_and_eval_run_on_a_variant() -> None:
    from tinylm.data.tokenizers import CharTokenizer
    from tinylm.use.evaluation import evaluate_text
    from tinylm.use.inspection import explain

    text = "the cat sat on the mat, and the dog sat on the log. "
    tok = CharTokenizer(sorted(set(text)))
    model = build("modern-mqa", vocab_size=tok.vocab_size)
    ex = explain(model, tok, "the cat sat")
    ids = torch.tensor([tok.encode("the cat sat")])
    assert ex.attention.shape == (2, 4, 11, 11)
    with torch.no_grad():
        torch.testing.assert_close(ex.probs, torch.softmax(model(ids)[0], -1), atol=1e-6, rtol=0)
        _, maps = model.forward_with_attention(ids)
    torch.testing.assert_close(ex.attention, maps[:, 0])
    window = text[:25]  # 25 tokens: one window of C = 24 inputs and their targets
    ids = torch.tensor([tok.encode(window)])
    with torch.no_grad():
        expected = model.loss(ids[:, :-1], ids[:, 1:]).item()
    assert abs(evaluate_text(model, tok, window).loss - expected) < 1e-5


@pytest.mark.parametrize("name", ["llama-gqa2", "modern-mqa", "swiglu-learned-qknorm"])
def test_variant_decoding_step_runs_quantized_layers_and_greedy_equals_full_forwards(
        name) -> None:
    """The variants' fused decoding step (int8 Linear layers included) gives the greedy
    tokens of repeated full forwards of the same (quantized) model."""
    from tinylm.commands.quantize import quantize
    from tinylm.use.sampling import generate

    model = build(name)
    quantize(model, include_head=not model.config.tie_embeddings)
    decision = plan(model)
    if decision.eligibility.native:
        with decision.decoder(1) as decoder:
            assert decoder.path == "fused-variant"
    ids = torch.randint(0, 53, (2, 5))
    want = ids
    with torch.no_grad():
        for _ in range(20):  # the reference: a whole forward per token, no cache
            nxt = model(want)[:, -1].argmax(-1, keepdim=True)
            want = torch.cat([want, nxt], 1)
    got = generate(model, ids, 20, temperature=0)
    assert torch.equal(got, want)


def test_run_toml_written_before_the_variants_still_reads(tmp_path) -> None:
    from tinylm.core.config import read_toml

    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_layer = 2\nlayer_norm_eps = 1e-06\n[train]\nlr = 0.001\n")
    model, _ = read_toml(path)
    cfg = ModelConfig.from_dict(model)
    assert cfg.norm_eps == 1e-6 and cfg.gpt2_layout


@pytest.mark.parametrize("edit, message", [
    ({"n_kv_head": 3}, "n_kv_head=3 does not divide n_head=4"),
    ({"n_kv_head": 4}, "attn.qkv.weight has shape"),  # valid, but not these weights
    ({"head_dim": 7}, "head_dim=7 is odd"),
    ({"mlp": "gelu"}, "weights do not match config.json"),
    ({"rope_scale": 2.0}, "rope_scale"),
])
def test_variant_checkpoint_with_a_bad_config_json_names_the_field(tmp_path, edit,
                                                                   message) -> None:
    from tinylm.core.errors import CheckpointError

    dest = save_checkpoint(tmp_path / "ck", build("llama-gqa2"))
    path = dest / "config.json"
    doc = json.loads(path.read_text())
    doc["model"].update(edit)
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=message):
        load_model(dest)
