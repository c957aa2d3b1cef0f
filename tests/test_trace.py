"""inspection.trace: every intermediate of one forward pass, recombined to the model's logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import CharTokenizer
from tinylm.use.inspection import SHAPES, Trace, ablated_logits, ablation_keys, explain, trace

IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def _model(bias: bool = True, tie: bool = True, seed: int = 3) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=17, context_length=16, n_layer=3, n_head=4, n_embd=32,
                      head_dim=6, bias=bias, tie_embeddings=tie)
    m = GPT(cfg)
    with torch.no_grad():  # larger weights and biases than the init: non-trivial maps
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


@pytest.fixture(scope="module")
def model() -> GPT:
    return _model()


def _letters(name: str, tr: Trace) -> tuple[int, ...]:
    sizes = {**tr.sizes, "H·D": tr.sizes["H"] * tr.sizes["D"]}
    return tuple(sizes[p] for p in Trace.shape(name).strip("()").split(", "))


def test_names_and_shapes_in_the_notes_letters(model: GPT) -> None:
    tr = trace(model, IDS)
    cfg = model.config
    assert tr.sizes == {"C": len(IDS), "E": 32, "H": 4, "D": 6, "F": 128, "V": 17, "L": 3}
    expected = {"embed.tok", "embed.pos", "embed", "final_norm", "logits"}
    for l in range(cfg.n_layer):
        expected |= {f"layer{l}.{n}" for n in ("resid_pre", "ln1", "concat", "attn_concat",
                                                "attn_out", "resid_mid", "ln2", "ffn_pre",
                                                "ffn_post", "ffn_out", "resid_post")}
        expected |= {f"layer{l}.head{i}.{n}" for i in range(cfg.n_head)
                     for n in ("q", "k", "v", "scores", "scaled", "masked", "attn", "out",
                               "contrib")}
    assert set(tr.names()) == expected
    assert {n.rsplit(".", 1)[-1] for n in expected} == set(SHAPES)
    for name in tr.names():
        assert tuple(tr[name].shape) == _letters(name, tr), name
        assert tr[name].dtype == torch.float32 and tr[name].device.type == "cpu"


def test_each_step_is_the_notes_equation(model: GPT) -> None:
    tr = trace(model, IDS)
    C, H, D = len(IDS), 4, 6
    for l, block in enumerate(model.blocks):
        x = tr[f"layer{l}.ln1"]
        ln = block.ln1
        assert torch.allclose(x, F.layer_norm(tr[f"layer{l}.resid_pre"], (32,), ln.weight,
                                              ln.bias, ln.eps), atol=1e-5)
        w, b = block.attn.qkv.weight.detach(), block.attn.qkv.bias.detach()
        w_o = block.attn.out.weight.detach()
        for i in range(H):
            p = f"layer{l}.head{i}."
            for part, name in enumerate("qkv"):  # [q | k | v], each H blocks of D rows
                rows = slice(part * H * D + i * D, part * H * D + (i + 1) * D)
                assert torch.allclose(tr[p + name], x @ w[rows].t() + b[rows], atol=1e-5)
            q, k = tr[p + "q"].double(), tr[p + "k"].double()
            assert torch.allclose(tr[p + "scores"].double(), q @ k.t(), atol=1e-4)
            assert torch.allclose(tr[p + "scaled"], tr[p + "scores"] / math.sqrt(D), atol=1e-6)
            upper = torch.ones(C, C, dtype=torch.bool).triu(1)
            assert torch.isneginf(tr[p + "masked"][upper]).all()
            assert torch.equal(tr[p + "masked"][~upper], tr[p + "scaled"][~upper])
            a = tr[p + "attn"]
            assert torch.allclose(a, torch.softmax(tr[p + "masked"], -1), atol=1e-6)
            assert (a[upper] == 0).all() and torch.allclose(a.sum(-1), torch.ones(C), atol=1e-6)
            assert torch.allclose(tr[p + "out"], a @ tr[p + "v"], atol=1e-5)
            assert torch.allclose(tr[p + "contrib"], tr[p + "out"] @ w_o[:, i * D:(i + 1) * D].t(),
                                  atol=1e-5)
        # the same maps as explain's (GPT.forward_with_attention, the explicit path)
    maps = explain(model, CharTokenizer("abcdefghijklmnopq"), IDS).attention  # (L, H, C, C)
    traced = torch.stack([torch.stack([tr[f"layer{l}.head{i}.attn"] for i in range(H)])
                          for l in range(3)])
    assert torch.allclose(maps, traced, atol=1e-6)


@pytest.mark.parametrize("bias, tie", [(True, True), (False, False)])
def test_traced_values_recombine_to_the_models_logits(bias: bool, tie: bool) -> None:
    model = _model(bias, tie)
    tr = trace(model, IDS)
    C = len(IDS)
    ids = torch.tensor(IDS)
    assert torch.equal(tr["embed.tok"], model.tok_emb.weight.detach()[ids])
    assert torch.equal(tr["embed.pos"], model.pos_emb.weight.detach()[:C])
    x = tr["embed.tok"] + tr["embed.pos"]
    for l, block in enumerate(model.blocks):
        p = f"layer{l}."
        assert torch.allclose(tr[p + "resid_pre"], x, atol=1e-6)
        heads = sum(tr[f"{p}head{i}.contrib"] for i in range(4))  # the sum form
        b_o = block.attn.out.bias
        attn = heads + (b_o.detach() if b_o is not None else 0)
        assert torch.allclose(tr[p + "attn_out"], attn, atol=1e-5)
        # the concat form, [R^1 … R^H]·W_o + b_o, is the same number
        concat = torch.cat([tr[f"{p}head{i}.out"] for i in range(4)], -1)
        assert torch.equal(tr[p + "concat"], concat)
        assert torch.allclose(tr[p + "attn_concat"], attn, atol=1e-5)
        x = x + attn
        assert torch.allclose(tr[p + "resid_mid"], x, atol=1e-5)
        up, down = block.ffn.up, block.ffn.down
        h = F.linear(tr[p + "ln2"], up.weight, up.bias)
        assert torch.allclose(tr[p + "ffn_pre"], h, atol=1e-5)
        assert torch.allclose(tr[p + "ffn_post"], F.gelu(h, approximate="tanh"), atol=1e-5)
        x = x + F.linear(tr[p + "ffn_post"], down.weight, down.bias)
        assert torch.allclose(tr[p + "resid_post"], x, atol=1e-4)
    fn = model.final_norm
    final = F.layer_norm(x, (32,), fn.weight, fn.bias, fn.eps)
    assert torch.allclose(tr["final_norm"], final, atol=1e-4)
    logits = final @ model.lm_head.weight.detach().t()
    with torch.inference_mode():
        own = model(ids[None])[0]  # the model's own (fast) forward
    assert torch.allclose(logits, own, atol=1e-4)
    assert torch.allclose(tr["logits"], own, atol=1e-4)


def _hooked_logits(model: GPT, key: str) -> torch.Tensor:
    """The model's own forward with one part switched off by a forward hook: the oracle
    for trace(..., ablate=[key])."""
    layer, part = key.split(".")
    block = model.blocks[int(layer[5:])]
    if part.startswith("head"):
        i, D = int(part[4:]), block.attn.head_dim

        def zero_head(module, args):
            r = args[0].clone()
            r[..., i * D:(i + 1) * D] = 0
            return (r,)
        handle = block.attn.out.register_forward_pre_hook(zero_head)
    else:
        target = block.attn if part == "attn" else block.ffn
        handle = target.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        with torch.inference_mode():
            return model(torch.tensor([IDS]))[0]
    finally:
        handle.remove()


def test_ablation_equals_the_model_with_a_hook(model: GPT) -> None:
    keys = ablation_keys(3, 4)
    assert len(keys) == 3 * (4 + 2) and "layer2.ffn" in keys and "layer1.head3" in keys
    base = trace(model, IDS)["logits"]
    for key in ["layer0.head1", "layer2.head3", "layer1.attn", "layer0.ffn", "layer2.ffn"]:
        tr = trace(model, IDS, ablate=[key])
        assert torch.allclose(tr["logits"], _hooked_logits(model, key), atol=1e-4), key
        assert not torch.allclose(tr["logits"], base, atol=1e-3), key
    batched = ablated_logits(model, IDS, keys)  # all of them in one pass
    for b, key in enumerate(keys):
        assert torch.allclose(batched[b], trace(model, IDS, ablate=[key])["logits"],
                              atol=1e-5), key
    tr = trace(model, IDS, ablate=["layer1.head2"])
    assert (tr["layer1.head2.out"] == 0).all() and (tr["layer1.head2.contrib"] == 0).all()
    with pytest.raises(ConfigError, match="unknown ablation"):
        trace(model, IDS, ablate=["layer3.head0"])


def test_bad_ids(model: GPT) -> None:
    with pytest.raises(DataError, match="1 to 16 tokens"):
        trace(model, [])
    with pytest.raises(DataError, match="1 to 16 tokens"):
        trace(model, [1] * 17)
    with pytest.raises(DataError, match="outside|must be in"):
        trace(model, [1, 17])


@dataclasses.dataclass(frozen=True)
class _VariantConfig(ModelConfig):
    attention_sink: bool = False  # a variant field the trace has never heard of


def test_unknown_architectures_are_refused() -> None:
    rms = _model()
    rms.blocks[1].ln1 = nn.RMSNorm(32)
    with pytest.raises(ConfigError, match="layer 1 ln1 .RMSNorm"):
        trace(rms, IDS)
    relu = _model()
    relu.blocks[0].ffn.act = nn.ReLU()
    with pytest.raises(ConfigError, match="FFN activation"):
        trace(relu, IDS)
    variant = _model()
    variant.config = _VariantConfig(**variant.config.to_dict(), attention_sink=True)
    with pytest.raises(ConfigError, match="attention_sink=True"):
        trace(variant, IDS)
    variant.config = _VariantConfig(**_model().config.to_dict())  # at its default: known
    trace(variant, IDS)

    class Doubled(GPT):  # the same modules, another forward: the self-check sees it
        def forward(self, ids, cache=None):
            return 2 * super().forward(ids, cache)

    other = Doubled(_model().config)
    with pytest.raises(ConfigError, match="does not reproduce"):
        trace(other, IDS)
    with pytest.raises(ConfigError, match="traces tinylm's GPT"):
        trace(nn.Linear(2, 2), IDS)
