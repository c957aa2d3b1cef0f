"""GGUF files in: tinylm's import equals transformers' own GGUF loader.

Tiny random Hugging Face models (llama, qwen2, gpt2) are written as GGUF here the way
llama.cpp's converter writes them (its tensor names, GPT-2's Conv1D weights transposed,
llama's query/key rows permuted into the interleaved rotary layout), in float32 and in
quantized types (``gguf.quants.quantize``; the K-quants, which that package cannot
quantize, as random blocks). Each is loaded by tinylm and by
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``: the same weights and the
same logits. The real SmolLM2-135M-Instruct GGUF (``TINYLM_SMOLLM2_GGUF``) is held to
the same oracle.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from tinylm import CheckpointError, ConfigError
from tinylm.core.errors import TinyLMError
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.io.gguf import (
    GGUFModel,
    block_codes,
    gguf_state_dict,
    gguf_to_tinylm,
    read_gguf,
    unpermute_rows,
)
from tinylm.io.hf import from_hf
from tinylm.layers.blocks import BlockLinear
from tinylm.layers.quantized import QuantizedLinear

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# K-quants need rows of 256 weights.
WIDE = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


# --- a GGUF writer as llama.cpp's converter ----------------------------------------------


def hf_model(arch: str, tie: bool = False, **shape) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = {**SMALL, **shape}
    if arch == "gpt2":  # transformers reads gpt2.context_length as n_ctx, not n_positions:
        cfg = transformers.GPT2Config(  # GPT-2's own 1024 positions, which both agree on
            vocab_size=shape["vocab_size"], n_positions=1024,
            n_embd=shape["hidden_size"], n_layer=shape["num_hidden_layers"],
            n_head=shape["num_attention_heads"], tie_word_embeddings=tie,
            layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None)
    else:
        cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
        cfg = cls(**shape, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 50000.0},
                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (defaults are 1 and 0)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (half-split -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(hf: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and layouts."""
    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    if arch == "gpt2":
        out["token_embd.weight"], out["position_embd.weight"] = \
            sd["transformer.wte.weight"], sd["transformer.wpe.weight"]
        out["output.weight"] = sd["lm_head.weight"]  # llama.cpp always writes the head
        for w in ("weight", "bias"):
            out[f"output_norm.{w}"] = sd[f"transformer.ln_f.{w}"]
        names = [("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"),
                 ("attn.c_proj", "attn_output"), ("ln_2", "ffn_norm"), ("mlp.c_fc", "ffn_up"),
                 ("mlp.c_proj", "ffn_down")]
        for i in range(c.n_layer):
            for hf_name, g in names:
                for w in ("weight", "bias"):
                    t = sd[f"transformer.h.{i}.{hf_name}.{w}"]
                    out[f"blk.{i}.{g}.{w}"] = t.T.copy() if t.ndim == 2 else t
        return out
    out["token_embd.weight"], out["output_norm.weight"] = \
        sd["model.embed_tokens.weight"], sd["model.norm.weight"]
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            for w in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{w}"
                if key not in sd:
                    continue
                t = sd[key]
                if arch == "llama" and g in ("attn_q", "attn_k"):
                    t = _permute(t, c.num_attention_heads if g == "attn_q"
                                 else c.num_key_value_heads)
                out[f"blk.{i}.{g}.{w}"] = t
    return out


def _kquant_blocks(t: np.ndarray, qtype: Q) -> np.ndarray:
    """Random K-quant blocks (every bit pattern is a valid code) with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(t.size)
    raw = rng.integers(0, 256, (t.shape[0], t.shape[1] // block, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
        raw[:, :, -2:] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    else:  # d, dmin, scales, ...
        raw[:, :, 0:2] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
        raw[:, :, 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(t.shape[0], -1)


def encode(t: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """``t`` in ``qtype`` where llama.cpp would store it (2-D, rows of whole blocks);
    1-D tensors (norms, biases) stay float32 as llama.cpp keeps them."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if t.ndim != 2 or t.shape[1] % block:
        return t.astype(np.float32), Q.F32
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _kquant_blocks(t, qtype), qtype
    return gguf.quants.quantize(t.astype(np.float32), qtype), qtype


def write_gguf(path: Path, arch: str, hf: torch.nn.Module | None, qtype: Q = Q.F32, *,
               meta: dict | None = None, tensors: dict | None = None, skip: tuple = ()
               ) -> Path:
    """``hf`` written as llama.cpp would (``meta`` adds or overrides keys: value, or
    (value, "f32"/"str") to force the type; None removes one)."""
    c = hf.config if hf is not None else None
    w = gguf.GGUFWriter(str(path), arch)
    keys: dict = {}
    if c is not None and arch == "gpt2":
        keys = {"context_length": c.n_positions, "embedding_length": c.n_embd,
                "block_count": c.n_layer, "feed_forward_length": 4 * c.n_embd,
                "attention.head_count": c.n_head, "attention.layer_norm_epsilon": (1e-5, "f32")}
    elif c is not None:
        keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
                "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
                "attention.head_count": c.num_attention_heads,
                "attention.head_count_kv": c.num_key_value_heads,
                "rope.freq_base": (50000.0, "f32"), "vocab_size": c.vocab_size,
                "attention.layer_norm_rms_epsilon": (1e-6, "f32")}
        if arch == "llama":
            keys["rope.dimension_count"] = c.hidden_size // c.num_attention_heads
    keys = {f"{arch}.{k}": v for k, v in keys.items()}
    for k, v in {**keys, **(meta or {})}.items():
        if v is None:
            continue
        v, kind = v if isinstance(v, tuple) else (v, None)
        if kind == "f32" or isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    if c is not None:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    all_tensors = {**(gguf_tensors(hf, arch) if hf is not None else {}), **(tensors or {})}
    for name, t in all_tensors.items():
        if name in skip:
            continue
        data, kind = t if isinstance(t, tuple) else encode(t, qtype)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_from(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def tinylm_state(theirs: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' loaded weights under tinylm's names (io/hf.py's own mapping); its
    config's note that the weights came from a GGUF file is not a model feature, nor is
    the name it copies from general.name, nor the gpt2 feed_forward_length it copies from
    the file (GPT-2's MLP is 4·E anyway)."""
    d = theirs.config.to_dict()
    assert d.pop("feed_forward_length", 4 * d.get("n_embd", 0)) == 4 * d.get("n_embd", 0)
    d.pop("quantization_config", None)
    d.pop("_model_name_or_path", None)
    shim = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: d),
                           state_dict=theirs.state_dict)
    return from_hf(shim).state_dict()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


# --- float32: the original weights back, exactly ------------------------------------------


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("gpt2", False)])
def test_float32_gives_the_original_model(tmp_path, arch, tie) -> None:
    hf = hf_model(arch, tie=tie)
    path = write_gguf(tmp_path / "m.gguf", arch, hf)
    model = gguf_to_tinylm(path)
    original = from_hf(hf).state_dict()
    ours = model.state_dict()
    assert ours.keys() == original.keys()
    for name in ours:  # the q/k permutation undone exactly; nothing else moved
        assert torch.equal(ours[name], original[name]), name
    ids = torch.randint(0, 100, (2, 40))
    theirs = transformers_from(path)
    assert (_logits(model, ids) - _logits(theirs, ids)).abs().max() < 1e-5
    assert (_logits(model, ids) - _logits(hf, ids)).abs().max() < 1e-5
    assert model.config.tie_embeddings is (tie if arch != "gpt2" else False)


def test_config_from_metadata(tmp_path) -> None:
    gm = read_gguf(write_gguf(tmp_path / "m.gguf", "qwen2", hf_model("qwen2", tie=True)))
    c = gm.config
    assert isinstance(gm, GGUFModel) and gm.arch == "qwen2"
    assert (c.vocab_size, c.context_length, c.n_layer, c.n_embd, c.n_head, c.n_kv_head,
            c.head_dim, c.ffn_hidden) == (100, 64, 2, 64, 4, 2, 16, 128)
    assert (c.norm, c.position, c.mlp, c.bias, c.qkv_bias, c.tie_embeddings) == \
        ("rmsnorm", "rope", "swiglu", False, True, True)
    assert c.rope_theta == 50000.0 and c.norm_eps == 1e-6  # float32 keys at their short repr
    assert gm.fields["qwen2.block_count"] == 2
    assert gm.fields["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    assert gm.tensor_types["blk.0.attn_q.weight"] == "F32"
    g2 = read_gguf(write_gguf(tmp_path / "g.gguf", "gpt2", hf_model("gpt2"))).config
    assert (g2.norm, g2.position, g2.mlp, g2.bias, g2.ffn_hidden) == \
        ("layernorm", "learned", "gelu", True, None)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    idx = unpermute_rows(48, 6)
    assert torch.equal(torch.from_numpy(_permute(w, 6))[idx], torch.from_numpy(w))


# --- every tensor type: the same weights and logits as transformers' loader --------------


TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_equals_transformers(tmp_path, qtype) -> None:
    hf = hf_model("llama", **WIDE)
    path = write_gguf(tmp_path / "m.gguf", "llama", hf, qtype)
    gm = read_gguf(path)
    assert gm.tensor_types["blk.0.ffn_down.weight"] == qtype.name
    model = gguf_to_tinylm(gm)
    theirs = transformers_from(path)
    expected = tinylm_state(theirs)
    for name, value in model.state_dict().items():  # the same dequantized floats
        assert torch.equal(value, expected[name]), name
    ids = torch.randint(0, 64, (1, 48))
    assert (_logits(model, ids) - _logits(theirs, ids)).abs().max() < 1e-4
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # a quantization of the original weights
        w, original = model.blocks[0].ffn.down.weight, hf.model.layers[0].mlp.down_proj.weight
        assert (w - original).abs().max() < 0.25 * original.abs().max()


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_1), ("qwen2", Q.Q4_0),
                                        ("gpt2", Q.Q8_0)], ids=str)
def test_quantized_models_equal_transformers(tmp_path, arch, qtype) -> None:
    hf = hf_model(arch)
    path = write_gguf(tmp_path / "m.gguf", arch, hf, qtype)
    model = gguf_to_tinylm(path)
    theirs = transformers_from(path)
    expected = tinylm_state(theirs)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    ids = torch.randint(0, 100, (2, 40))
    assert (_logits(model, ids) - _logits(theirs, ids)).abs().max() < 1e-4


# --- keep_quantized: BlockLinear layers (the file's bytes), bit-exact ------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_block_codes_are_bit_exact(qtype) -> None:
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)

    class Tensor:  # what GGUFReader hands out, for one tensor
        tensor_type, shape = qtype, np.array([96, 8])

    Tensor.data = data
    q, s, m = block_codes(Tensor)
    assert q.dtype == torch.int8 and s.shape == (8, 3) and (m is None) == (qtype != Q.Q4_1)
    layer = QuantizedLinear(96, 8, 8 if qtype == Q.Q8_0 else 4, 32, bias=False,
                            minimum=m is not None)
    layer.qweight.copy_(q)
    layer.scale.copy_(s)
    if m is not None:
        layer.minimum.copy_(m)
    assert torch.equal(layer.weight, torch.from_numpy(gguf.quants.dequantize(data, qtype)))
    lo, hi = {Q.Q8_0: (-127, 127), Q.Q4_0: (-8, 7), Q.Q4_1: (0, 15)}[qtype]
    assert lo <= q.min() and q.max() <= hi


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_1), ("llama", Q.Q4_0),
                                        ("qwen2", Q.Q8_0), ("gpt2", Q.Q8_0)], ids=str)
def test_keep_quantized_is_bit_exact(tmp_path, arch, qtype) -> None:
    path = write_gguf(tmp_path / "m.gguf", arch, hf_model(arch), qtype)
    gm = read_gguf(path)
    dense, kept = gguf_to_tinylm(gm), gguf_to_tinylm(gm, keep_quantized=True)
    layers = {n: m for n, m in kept.named_modules() if isinstance(m, BlockLinear)}
    per_block = 5 if arch != "gpt2" else 4  # qkv, out, (gate,) up, down
    assert len(layers) == per_block * 2 + 1  # and the LM head (output, or token_embd tied)
    assert all(n.startswith("blocks.") for n in layers if n != "lm_head")
    if dense.config.tie_embeddings:  # the head is the embedding's blocks, the same numbers
        assert torch.equal(kept.lm_head.weight, kept.tok_emb.weight)
    for name, layer in layers.items():
        assert layer.block_type == qtype.name
        assert torch.equal(layer.weight, dense.get_submodule(name).weight), name
    # the file's bytes as they are: no round trip through float32
    out = gguf.GGUFReader(str(path)).get_tensor(
        [t.name for t in gguf.GGUFReader(str(path)).tensors].index("blk.1.ffn_down.weight"))
    assert np.array_equal(kept.blocks[1].ffn.down.blocks.numpy(), np.asarray(out.data))
    assert type(kept.tok_emb) is torch.nn.Embedding  # embeddings dequantized
    ids = torch.randint(0, 100, (2, 24))
    assert torch.equal(_logits(kept, ids), _logits(dense, ids))
    state = gguf_state_dict(gm, keep_quantized=True)
    assert state["blocks.0.attn.qkv.blocks"].dtype == torch.uint8


def test_kept_blocks_survive_a_checkpoint_and_decoding(tmp_path) -> None:
    from tinylm import acceleration
    from tinylm.use.sampling import generate

    path = write_gguf(tmp_path / "m.gguf", "llama", hf_model("llama"), Q.Q4_1)
    kept = gguf_to_tinylm(path, keep_quantized=True)
    save_checkpoint(tmp_path / "ck", kept)
    config = (tmp_path / "ck" / "config.json").read_text()
    assert '"gguf_blocks"' in config and '"type": "Q4_1"' in config
    back, _ = load_checkpoint(tmp_path / "ck")
    assert torch.equal(back.blocks[0].attn.qkv.blocks, kept.blocks[0].attn.qkv.blocks)
    ids = torch.randint(0, 100, (1, 20))
    assert torch.equal(_logits(back, ids), _logits(kept, ids))
    prompt = torch.randint(0, 100, (1, 5))
    assert torch.equal(generate(back, prompt, 12, temperature=0.0),
                       generate(kept, prompt, 12, temperature=0.0))
    with acceleration.disabled():  # the reference path: dequantized weights, float32
        dense = gguf_to_tinylm(path)
        assert torch.equal(generate(kept, prompt, 12, temperature=0.0),
                           generate(dense, prompt, 12, temperature=0.0))


def test_fused_decoding_reads_every_kept_type(tmp_path) -> None:
    pytest.importorskip("tinylm.native")
    from tinylm import acceleration

    for qtype in (Q.Q4_1, Q.Q4_0, Q.Q8_0):  # csrc/blocks.c reads each (tests/test_blocks.py)
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", hf_model("llama"), qtype)
        kept = gguf_to_tinylm(path, keep_quantized=True)
        plan = acceleration.plan(kept, "cpu")
        if not plan.eligibility.native:  # TINYLM_NATIVE=0: no fused decoding step
            assert not plan.eligibility.decode_variant
            continue
        assert plan.eligibility.decode_variant, plan.eligibility.reasons
        assert plan.decoder(1).path == "fused-variant"


def test_old_quantized_structure_is_unchanged() -> None:
    from tinylm.layers.quantized import structure_of

    layer = QuantizedLinear(64, 8, 8, 32)
    assert "minimum" not in layer.state_dict()
    model = torch.nn.Sequential(layer)
    assert structure_of(model) == {"0": {"bits": 8, "group_size": 32}}
    with pytest.raises(ConfigError, match="bits <= 7"):
        QuantizedLinear(64, 8, 8, 32, minimum=True)


# --- refusals: one line each ---------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and isinstance(exc.value, TinyLMError), text
    for w in words:
        assert w in text, text


def test_bad_files_are_one_line_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path / "none.gguf")
    _one_line(e, "none.gguf", "does not exist")
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path)
    _one_line(e, "not a file")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path / "x.gguf")
    _one_line(e, "x.gguf", "not a readable GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path / "empty.gguf")
    _one_line(e, "empty.gguf")
    whole = write_gguf(tmp_path / "m.gguf", "llama", hf_model("llama")).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path / "cut.gguf")
    _one_line(e, "cut.gguf")


REFUSED = [
    ("llama.rope.scaling.type", "linear", "rope scaling"),
    ("llama.rope.scaling.factor", (4.0, "f32"), "rope scaling"),
    ("llama.attention.sliding_window", 16, "sliding-window"),
    ("llama.final_logit_softcapping", (30.0, "f32"), "soft-capping"),
    ("llama.attn_logit_softcapping", (50.0, "f32"), "soft-capping"),
    ("llama.expert_count", 8, "mixture-of-experts"),
    ("llama.rope.dimension_count", 8, "rope.dimension_count = 8"),
    ("llama.some_new_feature", 3, "does not know"),
    ("split.count", 3, "split"),
    ("llama.block_count", 10**6, "block_count"),
    ("llama.attention.head_count", 5, "head_count"),
    ("general.architecture", "phi3", "phi3"),
]


@pytest.mark.parametrize("key,value,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_features_tinylm_cannot_honour_are_refused(tmp_path, key, value, words) -> None:
    hf = hf_model("llama")
    if key == "general.architecture":  # GGUFWriter writes it: a file of another arch
        path = write_gguf(tmp_path / "m.gguf", "phi3", None, tensors={
            "token_embd.weight": np.zeros((4, 32), np.float32)})
    else:
        path = write_gguf(tmp_path / "m.gguf", "llama", hf, meta={key: value})
    with pytest.raises(ConfigError) as e:
        read_gguf(path)
    _one_line(e, words, key.split(".", 1)[1] if key != "general.architecture" else "phi3")


def test_harmless_keys_are_accepted(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_model("llama"),
                      meta={"llama.rope.scaling.type": "none", "general.name": "tiny",
                            "quantize.imatrix.file": "x.dat"})
    assert read_gguf(path).fields["general.name"] == "tiny"


def test_unsupported_tensors_are_refused(tmp_path) -> None:
    hf = hf_model("llama", **WIDE)
    iq = write_gguf(tmp_path / "q2.gguf", "llama", hf, tensors={
        "blk.0.ffn_up.weight": (np.zeros((512, 84), np.uint8), Q.Q2_K)})
    with pytest.raises(ConfigError) as e:
        read_gguf(iq)
    _one_line(e, "blk.0.ffn_up.weight", "Q2_K")
    extra = write_gguf(tmp_path / "rf.gguf", "llama", hf, tensors={
        "rope_freqs.weight": np.ones(32, np.float32)})
    with pytest.raises(ConfigError) as e:
        read_gguf(extra)
    _one_line(e, "rope_freqs.weight", "rope scaling")
    missing = write_gguf(tmp_path / "ms.gguf", "llama", hf, skip=("blk.0.attn_v.weight",))
    with pytest.raises(CheckpointError) as e:
        read_gguf(missing)
    _one_line(e, "blk.0.attn_v.weight")
    rows = write_gguf(tmp_path / "rows.gguf", "llama", hf, tensors={
        "blk.0.attn_k.weight": np.ones((32, 256), np.float32)})
    with pytest.raises(CheckpointError) as e:
        gguf_to_tinylm(rows)
    _one_line(e, "blk.0.attn_k.weight", "(32, 256)", "(128, 256)")
    wrong = write_gguf(tmp_path / "sh.gguf", "llama", hf, tensors={
        "blk.0.ffn_norm.weight": np.ones(7, np.float32)})
    with pytest.raises(CheckpointError) as e:
        gguf_to_tinylm(wrong)
    _one_line(e, "blk.0.ffn_norm.weight", "(7,)")


# --- the real model: SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding --------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Path:
    return smollm2_gguf


def test_smollm2_equals_transformers(smollm2) -> None:
    gm = read_gguf(smollm2)
    c = gm.config
    assert (gm.arch, c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert (c.tie_embeddings, c.rope_theta, c.head_dim, c.ffn_hidden, c.norm_eps) == \
        (True, 100000.0, 64, 1536, 1e-5)
    assert gm.tensor_types["token_embd.weight"] == "Q8_0"
    assert gm.tensor_types["blk.0.attn_q.weight"] == "Q4_1"
    model = gguf_to_tinylm(gm)
    theirs = transformers_from(smollm2)
    expected = tinylm_state(theirs)
    ours = model.state_dict()
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name
    ids = torch.randint(0, 49152, (1, 300))
    assert (_logits(model, ids) - _logits(theirs, ids)).abs().max() < 1e-4
    kept = gguf_to_tinylm(gm, keep_quantized=True)
    layers = [m for m in kept.blocks.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 30 * 5 and all(m.block_type == "Q4_1" for m in layers)
    # the tied head is token_embd's Q8_0 blocks as stored (what llama.cpp reads)
    assert isinstance(kept.lm_head, BlockLinear) and kept.lm_head.block_type == "Q8_0"
    assert torch.equal(kept.lm_head.weight, kept.tok_emb.weight)
    assert type(kept.tok_emb) is torch.nn.Embedding
    assert torch.equal(_logits(kept, ids[:, :64]), _logits(model, ids[:, :64]))
