"""tinylm.use.explorer: the data behind the explorer page, the page itself, `explain --html`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.cli import main
from tinylm.core.config import ARCH_PRESETS, ModelConfig, read_toml
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import CharTokenizer
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.use.explorer import (
    decode_tensor,
    encode_tensor,
    explorer_data,
    explorer_layers,
    head_weights,
    low_rank,
    render_explorer,
)
from tinylm.use.inspection import explain, plot_attention, trace

ALPHABET = "This apen.\n日本語<>/\"'&{}jcrt"
PROMPT = "This is a pen ."
# Any URL, scheme-relative link, resource attribute or CSS fetch.
URL = re.compile(r"https?:|//[A-Za-z0-9]|\b(src|href|action|srcset)\s*=|@import|url\(|"
                 r"\bwww\.|\.com\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


@pytest.fixture(scope="module")
def model(tokenizer: CharTokenizer) -> GPT:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=24, n_layer=2, n_head=3,
                      n_embd=24)
    m = GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    return m.eval()


@pytest.fixture(scope="module")
def data(model: GPT, tokenizer: CharTokenizer) -> dict:
    return explorer_data(model, tokenizer, PROMPT, top_k=4, layer=1, head=2)


def test_tensors_are_the_trace_exactly(model: GPT, tokenizer: CharTokenizer, data: dict) -> None:
    tr = trace(model, tokenizer.encode(PROMPT))
    assert data["ids"] == tokenizer.encode(PROMPT) and "".join(data["tokens"]) == PROMPT
    assert data["sizes"] == {"C": 15, "E": 24, "H": 3, "D": 8, "V": tokenizer.vocab_size,
                             "L": 2, "F": 96, "Hkv": 3}
    assert data["select"] == {"layer": 1, "head": 2} and data["detail"] == [0, 1]
    assert data["arch"]["norm"] == "layernorm" and data["arch"]["position"] == "learned"
    # per layer ln1, attn_out, attn_concat, ffn_pre, ffn_post, ffn_out; per head q, k, v,
    # scores, attn, out, contrib (GPT-2 has no q_lin, q_normed, ffn_gate: no such stage)
    assert len(data["tensors"]) == 2 * (6 + 3 * 7)
    for name, item in data["tensors"].items():
        assert torch.equal(decode_tensor(item), tr[name]), name
        assert "/" not in item["f32"] and "+" not in item["f32"]
    t = torch.tensor([[1.5, -2.0], [float("inf"), 3e-8]])
    assert torch.equal(decode_tensor(encode_tensor(t)), t)
    assert json.loads(json.dumps(data)) == data  # JSON as it is: what POST /v1/explore returns


def test_tables_lens_and_ablations(model: GPT, tokenizer: CharTokenizer, data: dict) -> None:
    ids = tokenizer.encode(PROMPT)
    probs = F.softmax(trace(model, ids)["logits"], -1)
    for t, row in enumerate(data["next"]):
        assert len(row) == 4
        top = torch.topk(probs[t], 4)
        assert [c[0] for c in row] == top.indices.tolist()
        assert [c[1] for c in row] == pytest.approx(top.values.tolist(), abs=1e-6)
    lens = data["lens"]
    assert [s["name"] for s in lens] == ["embed", "layer0.resid_post", "layer1.resid_post"]
    assert lens[-1]["top"] == data["next"]  # after the last layer: the model's own output
    assert lens[0]["top"] != data["next"]
    assert [a["key"] for a in data["ablations"]] == [
        "layer0.head0", "layer0.head1", "layer0.head2", "layer0.attn", "layer0.ffn",
        "layer1.head0", "layer1.head1", "layer1.head2", "layer1.attn", "layer1.ffn"]
    for a in data["ablations"][2:5]:  # a head, a layer's attention, a layer's FFN
        p = F.softmax(trace(model, ids, ablate=[a["key"]])["logits"], -1)
        assert [c[0] for c in a["top"][3]] == torch.topk(p[3], 4).indices.tolist()
        base_top = [row[0][0] for row in data["next"]]
        assert a["orig_top_prob"] == pytest.approx(
            [float(p[t, i]) for t, i in enumerate(base_top)], abs=1e-6)
    assert any(a["top"] != data["next"] for a in data["ablations"])
    shown = {c[0] for rows in [data["next"]] + [a["top"] for a in data["ablations"]]
             + [s["top"] for s in lens] for row in rows for c in row}
    assert shown | set(ids) == {int(k) for k in data["vocab"]}


def test_low_rank_of_a_real_head(model: GPT, tokenizer: CharTokenizer, data: dict) -> None:
    tr = trace(model, tokenizer.encode(PROMPT))
    E, D = 24, 8
    for l in range(2):
        for i in range(3):
            w_v, w_o, b_v = head_weights(model, l, i)
            p = f"layer{l}.head{i}."
            # the slices are the head's: they rebuild its V and its contribution
            assert torch.allclose(tr[f"layer{l}.ln1"] @ w_v + b_v, tr[p + "v"], atol=1e-5)
            assert torch.allclose(tr[p + "out"] @ w_o, tr[p + "contrib"], atol=1e-5)
            m = w_v.double() @ w_o.double()
            full = torch.linalg.svdvals(m)
            assert full.shape == (E,) and float(full[D:].max()) < 1e-9 * float(full[0])  # rank <= D
            lr = data["lowrank"][f"layer{l}.head{i}"]
            assert lr["singular"] == pytest.approx(full[:D].tolist(), rel=1e-6)
            assert lr["weight_error"][0] == pytest.approx(1.0)
            assert lr["weight_error"][D] == pytest.approx(0.0, abs=1e-6)
            assert lr["output_error"][D] == pytest.approx(0.0, abs=1e-4)
            assert lr["output_error"][0] == pytest.approx(
                float((tr[p + "contrib"] - tr[p + "attn"] @ (b_v @ w_o).expand(15, E)).norm()
                      / tr[p + "contrib"].norm()), rel=1e-4)
            u, s, vh = torch.linalg.svd(m)
            for r in (1, 3):  # Eckart–Young: the error of the truncated SVD
                m_r = (u[:, :r] * s[:r]) @ vh[:r]
                assert lr["weight_error"][r] == pytest.approx(
                    float((m - m_r).norm() / m.norm()), rel=1e-6)
            errors = lr["weight_error"]
            assert all(errors[r] >= errors[r + 1] - 1e-12 for r in range(D))
    assert low_rank(model, tr, 0, 0) == data["lowrank"]["layer0.head0"]


def test_page_is_one_offline_file(data: dict, model: GPT, tokenizer: CharTokenizer) -> None:
    page = render_explorer(data, title="a </title> & test")
    assert not URL.search(page), URL.search(page)
    assert page.count("<script") == 3 and "<link" not in page and "<img" not in page
    assert "<title>a &lt;/title&gt; &amp; test</title>" in page
    assert "{{" not in page.replace("{{}}", "")
    tricky = explorer_data(model, tokenizer, "</script>{{js}}日", top_k=2)
    page = render_explorer(tricky)
    assert page.count("</script>") == 3 and not URL.search(page)
    embedded = page[page.index('id=data>') + len('id=data>'):]
    embedded = embedded[:embedded.index("</script>")]
    assert json.loads(embedded) == tricky
    config = page[page.index('id=config>') + len('id=config>'):]
    assert json.loads(config[:config.index("</script>")])["endpoint"] is None
    live = render_explorer(None, endpoint="/v1/explore")
    assert '"endpoint":"/v1/explore"' in live
    with pytest.raises(ConfigError, match="needs its data"):
        render_explorer(None)


def test_page_size_for_32_tokens_on_the_demo_shape() -> None:
    cfg = read_toml(Path(__file__).parents[1] / "configs" / "demo.toml")[0]
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.")
    model = GPT(ModelConfig(vocab_size=1024, **cfg)).eval()  # make-demo's BPE has 1,024
    prompt = "the list is sorted in place, and"
    assert len(tok.encode(prompt)) == 32
    page = render_explorer(explorer_data(model, tok, prompt))
    size = len(page.encode("utf-8"))
    assert 500_000 < size < 2_500_000, size  # 2.08 MB: every layer's steps and FFN


def test_bad_choices(model: GPT, tokenizer: CharTokenizer) -> None:
    with pytest.raises(ConfigError, match="layer 2 is out of range"):
        explorer_data(model, tokenizer, PROMPT, layer=2)
    with pytest.raises(ConfigError, match="head -1 is out of range"):
        explorer_data(model, tokenizer, PROMPT, head=-1)
    with pytest.raises(DataError, match="empty"):
        explorer_data(model, tokenizer, "")
    with pytest.raises(DataError, match="context length"):
        explorer_data(model, tokenizer, "a" * 25)


# --- the command line -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, model: GPT,
               tokenizer: CharTokenizer) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", model, tokenizer)


def test_cli_html_writes_the_explorer(checkpoint: Path, tmp_path: Path, capsys) -> None:
    page = tmp_path / "sub" / "page.html"
    assert main(["explain", "--model", str(checkpoint), "--prompt", PROMPT, "--html",
                 str(page), "--layer", "1", "--head", "2", "--top-k", "3"]) == 0
    text = page.read_text(encoding="utf-8")
    assert not URL.search(text)
    assert '"select":{"layer":1,"head":2}' in text
    assert sorted(p.name for p in page.parent.iterdir()) == ["page.html"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert page.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_attention_writes_the_format_the_suffix_names(checkpoint: Path, tmp_path: Path,
                                                       model: GPT, tokenizer) -> None:
    out = tmp_path / "maps.jpg"
    assert main(["explain", "--model", str(checkpoint), "--prompt", "Th", "--attention",
                 str(out)]) == 0
    assert out.read_bytes().startswith(b"\xff\xd8\xff")  # JPEG, not PNG bytes
    e = explain(model, tokenizer, "Th")
    for name, magic in [("m.SVG", b"<?xml"), ("m.pdf", b"%PDF")]:
        assert plot_attention(e, tmp_path / name).read_bytes().startswith(magic), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["maps.jpg", "m.SVG", "m.pdf"])  # no temporaries left


class _RMSNormModel(GPT):
    """A stand-in for a variant architecture the trace does not know yet."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.final_norm = nn.RMSNorm(config.n_embd)


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "a" * 25], "context length is 24"),
    (["--prompt", ""], "empty"),
    (["--prompt", PROMPT, "--layer", "2"], "layer 2 is out of range"),
    (["--prompt", PROMPT, "--head", "3"], "head 3 is out of range"),
    (["--prompt", PROMPT, "--head", "-1"], "head -1 is out of range"),
    (["--prompt", PROMPT, "--attention", "{dir}/maps.gif"], "'.gif' is not a picture format"),
    (["--prompt", PROMPT, "--attention", "{dir}/maps"], "no suffix"),
    (["--prompt", PROMPT, "--html", "{dir}"], "it is a folder"),
    (["--prompt", PROMPT, "unknown-architecture"], "does not know this model's final norm"),
])
def test_cli_bad_input_writes_nothing(checkpoint: Path, tmp_path: Path, capsys, monkeypatch,
                                      extra: list[str], message: str) -> None:
    if "unknown-architecture" in extra:
        extra = extra[:-1]
        variant = _RMSNormModel(ModelConfig(vocab_size=20, context_length=24, n_layer=1,
                                            n_head=1, n_embd=8))
        monkeypatch.setattr("tinylm.use.explorer.load_checkpoint",
                            lambda path, device: (variant, CharTokenizer(ALPHABET)))
    out = tmp_path / "out"
    out.mkdir()
    args = [a.replace("{dir}", str(out)) for a in extra]
    if "--attention" not in args and "{dir}" not in " ".join(extra):
        args += ["--html", str(out / "page.html"), "--attention", str(out / "maps.png")]
    assert main(["explain", "--model", str(checkpoint), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("tinylm explain: error:")
    assert list(out.iterdir()) == []


def test_a_compressed_model_is_explored_through_its_factors(tokenizer: CharTokenizer) -> None:
    """tinylm compress's LowRankLinear layers go through the same trace: a head whose
    W_v^i·W_o^i comes from rank-3 factors shows at most 3 non-zero singular values."""
    from tinylm.layers.lowrank import LowRankLinear

    torch.manual_seed(2)
    m = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, context_length=16, n_layer=1,
                        n_head=2, n_embd=16)).eval()
    m.blocks[0].attn.out = LowRankLinear.from_linear(m.blocks[0].attn.out, 3)
    m.blocks[0].ffn.up = LowRankLinear.from_linear(m.blocks[0].ffn.up, 5)
    d = explorer_data(m, tokenizer, PROMPT)
    s = d["lowrank"]["layer0.head1"]["singular"]
    assert len(s) == 8 and s[2] > 1e-2 * s[0] and max(s[3:]) < 1e-6 * s[0]  # float32 factors
    assert d["lowrank"]["layer0.head1"]["weight_error"][3] < 1e-5


# --- every architecture tinylm builds: the page's numbers are the reference model's ---------


VARIANTS = {  # tiny models of each family: RoPE, grouped-query / multi-query attention
    "llama": {**ARCH_PRESETS["llama"], "n_kv_head": 2},
    "modern": {**ARCH_PRESETS["modern"], "n_kv_head": 1},
    "qwen2": {**ARCH_PRESETS["llama"], "qkv_bias": True, "tie_embeddings": True,
              "n_kv_head": 2, "rope_theta": 1e6},
}


def _variant(name: str, tokenizer: CharTokenizer) -> GPT:
    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=24, n_layer=2, n_head=4,
                      n_embd=32, **VARIANTS[name])
    m = GPT(cfg)
    with torch.no_grad():  # weights well above the init, biases and gains not all 1 / 0
        for p in m.parameters():
            p.mul_(6.0) if p.dim() > 1 else p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def _reference_intermediates(model: GPT, ids: list[int]) -> dict[str, torch.Tensor]:
    """The model's own values, by hooks on its own modules in its own forward, and q, k, v
    from its own MultiHeadAttention._heads (QK-norm and RoPE included)."""
    got: dict[str, torch.Tensor] = {}
    hooks = []
    for l, b in enumerate(model.blocks):
        def keep(name):
            return lambda mod, args, out: got.__setitem__(name, out[0].detach())
        hooks += [b.ln1.register_forward_hook(keep(f"layer{l}.ln1")),
                  b.attn.register_forward_hook(keep(f"layer{l}.attn_out")),
                  b.ffn.register_forward_hook(keep(f"layer{l}.ffn_out")),
                  b.attn.qkv.register_forward_hook(keep(f"layer{l}.qkv"))]
    x = torch.tensor([ids])
    try:
        with torch.no_grad():
            got["logits"] = model(x)[0]
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        _, maps = model.forward_with_attention(x)  # (L, 1, H, C, C)
        for l, b in enumerate(model.blocks):
            q, k, v = b.attn._heads(got[f"layer{l}.ln1"][None])
            got[f"layer{l}.q"], got[f"layer{l}.k"], got[f"layer{l}.v"] = q[0], k[0], v[0]
            got[f"layer{l}.maps"] = maps[l, 0]
    return got


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_explorer_data_is_the_reference_models(name: str,
                                                       tokenizer: CharTokenizer) -> None:
    model = _variant(name, tokenizer)
    cfg = model.config
    ids = tokenizer.encode(PROMPT)
    data = explorer_data(model, tokenizer, PROMPT, top_k=3, layer=1, head=3)
    ref = _reference_intermediates(model, ids)
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    assert data["sizes"]["Hkv"] == Hkv and data["arch"]["position"] == "rope"
    assert data["detail"] == [0, 1]  # a tiny model: every layer in full

    def t(key: str) -> torch.Tensor:
        return decode_tensor(data["tensors"][key])

    for l in range(cfg.n_layer):
        p = f"layer{l}."
        for key in ("ln1", "attn_out", "ffn_out"):
            torch.testing.assert_close(t(p + key), ref[p + key], atol=2e-5, rtol=1e-5)
        q_lin, k_lin, _ = ref[p + "qkv"].split([H * D, Hkv * D, Hkv * D], dim=-1)
        for i in range(H):
            j = i // (H // Hkv)  # the key/value head query head i reads
            first = f"{p}head{j * (H // Hkv)}."  # the name its K and V go by
            hq = f"{p}head{i}."
            torch.testing.assert_close(t(hq + "q"), ref[p + "q"][i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(t(first + "k"), ref[p + "k"][j], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(t(first + "v"), ref[p + "v"][j], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(t(hq + "q_lin"), q_lin[:, i * D:(i + 1) * D])
            torch.testing.assert_close(t(first + "k_lin"), k_lin[:, j * D:(j + 1) * D])
            # the scores are those of the rotated q and k, and the maps the model's own
            torch.testing.assert_close(t(hq + "scores"), ref[p + "q"][i] @ ref[p + "k"][j].t(),
                                       atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(t(hq + "attn"), ref[p + "maps"][i], atol=1e-6, rtol=1e-5)
            if j * (H // Hkv) != i:  # a shared key/value head is carried once
                assert hq + "k" not in data["tensors"] and hq + "v" not in data["tensors"]
        if cfg.qk_norm:  # modern: q_lin -> RMSNorm -> rotation
            attn = model.blocks[l].attn
            torch.testing.assert_close(t(p + "head2.q_normed"),
                                       attn.q_norm(q_lin[:, 2 * D:3 * D]).detach())
        else:
            assert p + "head0.q_normed" not in data["tensors"]
        assert (p + "ffn_gate" in data["tensors"]) == (cfg.mlp == "swiglu")
    probs = F.softmax(ref["logits"], -1)
    assert [r[0][0] for r in data["next"]] == probs.argmax(-1).tolist()
    assert data["lens"][-1]["top"] == data["next"]


@pytest.mark.parametrize("name", ["llama", "modern"])
def test_variant_ablation_and_low_rank(name: str, tokenizer: CharTokenizer) -> None:
    """A head switched off by a hook on the model's own output projection gives the
    precomputed table; the low-rank spectrum is W_v^j·W_o^i's from the raw weights."""
    model = _variant(name, tokenizer)
    cfg, ids = model.config, tokenizer.encode(PROMPT)
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    data = explorer_data(model, tokenizer, PROMPT, top_k=3)
    assert [a["key"] for a in data["ablations"]][:6] == [
        "layer0.head0", "layer0.head1", "layer0.head2", "layer0.head3", "layer0.attn",
        "layer0.ffn"]
    head = 3
    out = model.blocks[1].attn.out

    def zero_head(module, args):
        r = args[0].clone()
        r[..., head * D:(head + 1) * D] = 0
        return (r,)

    hook = out.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            p = F.softmax(model(torch.tensor([ids]))[0], -1)
    finally:
        hook.remove()
    a = [x for x in data["ablations"] if x["key"] == f"layer1.head{head}"][0]
    assert [[c[0] for c in row] for row in a["top"]] == torch.topk(p, 3).indices.tolist()
    base_top = [row[0][0] for row in data["next"]]
    assert a["orig_top_prob"] == pytest.approx([float(p[t, i]) for t, i in enumerate(base_top)],
                                               abs=1e-6)
    w = model.blocks[1].attn.qkv.weight.detach().double()  # rows: [q | k | v]
    j = head // (H // Hkv)
    w_v = w[(H + Hkv + j) * D:(H + Hkv + j + 1) * D].t()  # (E, D)
    w_o = out.weight.detach().double()[:, head * D:(head + 1) * D].t()  # (D, E)
    expected = torch.linalg.svdvals(w_v @ w_o)[:D]
    lr = data["lowrank"][f"layer1.head{head}"]
    assert lr["singular"] == pytest.approx(expected.tolist(), rel=1e-6)
    assert lr["output_error"][D] == pytest.approx(0.0, abs=1e-4)


def test_a_big_model_carries_a_bounded_part_and_the_rest_is_fetched(
        tokenizer: CharTokenizer) -> None:
    """Past the budget the page carries the opened layer's steps (and its neighbours');
    explorer_layers gives any other layer's, equal to what a full page carries."""
    model = _variant("llama", tokenizer)
    full = explorer_data(model, tokenizer, PROMPT, top_k=3)
    small = explorer_data(model, tokenizer, PROMPT, top_k=3, layer=1, max_bytes=1)
    assert small["detail"] == [1]
    assert not any(k.startswith("layer0.") and not k.endswith(".attn")
                   for k in small["tensors"])
    assert all(f"layer0.head{i}.attn" in small["tensors"] for i in range(4))  # every map
    assert {a["key"] for a in small["ablations"]} == {
        "layer0.attn", "layer0.ffn", "layer1.head0", "layer1.head1", "layer1.head2",
        "layer1.head3", "layer1.attn", "layer1.ffn"}
    assert small["lowrank"] == full["lowrank"] and small["lens"] == full["lens"]
    part = explorer_layers(model, tokenizer, PROMPT, [0], top_k=3)
    assert part["detail"] == [0] and part["norms"]["0"] == full["norms"]["0"]
    for key, item in part["tensors"].items():
        assert item == full["tensors"][key], key
    assert set(part["tensors"]) == {k for k in full["tensors"]
                                    if k.startswith("layer0.") and not k.endswith(".attn")}
    assert part["ablations"] == [a for a in full["ablations"] if a["key"].startswith(
        "layer0.head")]
    with pytest.raises(ConfigError, match="layer 2 is out of range"):
        explorer_layers(model, tokenizer, PROMPT, [2])
    with pytest.raises(ConfigError, match="layers must be"):
        explorer_layers(model, tokenizer, PROMPT, "0")


def test_the_norm_statistics_are_the_norms(tokenizer: CharTokenizer) -> None:
    """Step 1's note: rows of h, rescaled to RMS 1, times the gain: x. The page's numbers
    for an RMSNorm and a LayerNorm model."""
    for model in (_variant("llama", tokenizer), GPT(ModelConfig(
            vocab_size=tokenizer.vocab_size, context_length=24, n_layer=1, n_head=2,
            n_embd=16)).eval()):
        data = explorer_data(model, tokenizer, PROMPT)
        tr = trace(model, tokenizer.encode(PROMPT))
        n = data["norms"]["0"]
        h, x = tr["layer0.resid_pre"], tr["layer0.ln1"]
        assert n["h_rms"] == pytest.approx(h.pow(2).mean(-1).sqrt().tolist(), rel=1e-5)
        assert n["x_rms"] == pytest.approx(x.pow(2).mean(-1).sqrt().tolist(), rel=1e-4)
        # RMS 1 but for the ε inside the root: √(m / (m + ε)), m = mean(h²) or var(h)
        m = h.pow(2).mean(-1) if model.config.norm == "rmsnorm" else h.var(-1, unbiased=False)
        assert n["n_rms"] == pytest.approx((m / (m + 1e-5)).sqrt().tolist(), rel=1e-5)
        assert n["x_var"] == pytest.approx(float(x.var(unbiased=False)), rel=1e-4)
        g = model.blocks[0].ln1.weight.detach()
        assert n["g_rms"] == pytest.approx(float(g.pow(2).mean().sqrt()), rel=1e-5)
        assert n["kind"] == model.config.norm


def _embedded(page: str, name: str) -> str:
    """The raw text of the page's <script id=NAME> block, as the HTML puts it."""
    start = page.index(f"id={name}>") + len(f"id={name}>")
    return page[start:page.index("</script>", start)]


def test_a_prompt_with_html_in_it_cannot_break_the_static_page() -> None:
    """Issue #32: "<!--<script" in the prompt sent the HTML parser into a script's escaped
    states, so the data block swallowed the page's own script and the page was blank."""
    tok = CharTokenizer("<!-script>/&a ")
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, n_layer=1,
                            n_head=2, n_embd=8)).eval()
    prompt = "<!--<script a</script>&a"
    data = explorer_data(model, tok, prompt, top_k=2)
    page = render_explorer(data, title="<!--<script")
    embedded = _embedded(page, "data")
    assert not set("<>&") & set(embedded)  # each one a \u escape instead
    assert "\\u003c!--\\u003cscript" in embedded
    parsed = json.loads(embedded)
    assert parsed == data and parsed["prompt"] == prompt
    assert json.loads(_embedded(page, "config"))["title"] == "<!--<script"
    assert page.count("<script") == 3 and page.count("</script>") == 3
