"""Llama, Qwen2 and Mistral, both ways, against Hugging Face's own models as the oracle.

Tiny random models built from configs (nothing is downloaded), at odd shapes:
grouped-query attention with 2 and 1 key/value heads, head_dim != E/H, vocabularies
that are not powers of two, tied and untied heads, biased and bias-free layers.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tinylm.cli import main
from tinylm.core.decoding import KVCache
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.hf import from_hf, read_hf_folder, to_hf, write_hf_folder
from tinylm.use.sampling import generate

CONFIGS = {
    "Llama": transformers.LlamaConfig,
    "Qwen2": transformers.Qwen2Config,
    "Mistral": transformers.MistralConfig,
}
# (family, vocab, E, layers, H, H_kv, head_dim, ffn, tied, extra config fields)
SHAPES = [
    ("Llama", 97, 32, 2, 4, 2, 8, 40, False, {}),
    ("Llama", 61, 24, 1, 4, 1, 10, 36, True, {"rope_theta": 500000.0}),
    ("Llama", 50, 16, 2, 2, 2, 8, 24, False, {"attention_bias": True, "mlp_bias": True}),
    ("Qwen2", 53, 32, 2, 4, 2, 8, 44, False, {}),
    ("Qwen2", 67, 24, 2, 4, 1, 6, 30, True, {}),
    ("Mistral", 71, 16, 2, 2, 1, 12, 28, False, {"sliding_window": None}),
]


@pytest.fixture(autouse=True)
def _no_progress_bars():
    """save_pretrained's progress bars would mix into the CLI's one-line errors."""
    logging = transformers.utils.logging
    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


IDS = [f"{s[0]}-H{s[4]}kv{s[5]}-D{s[6]}-{'tied' if s[8] else 'untied'}" for s in SHAPES]


def hf_model(family, vocab, E, layers, H, Hkv, D, ffn, tied, extra, positions=32):
    kw = dict(vocab_size=vocab, hidden_size=E, intermediate_size=ffn, num_hidden_layers=layers,
              num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
              max_position_embeddings=positions, tie_word_embeddings=tied, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    theta = extra.pop("rope_theta", 10000.0) if "rope_theta" in extra else 10000.0
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    kw.update(extra)
    cfg = CONFIGS[family](**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases (defaults are 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(params=SHAPES, ids=IDS)
def pair(request):
    family, vocab, *rest = request.param
    hf = hf_model(family, vocab, *rest[:-1], dict(rest[-1]))
    return hf, from_hf(hf), vocab


def test_imported_logits_equal_hf(pair) -> None:
    hf, model, vocab = pair
    ids = torch.randint(0, vocab, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_incremental_decoding_with_the_cache_equals_hf(pair) -> None:
    hf, model, vocab = pair
    cfg = model.config
    ids = torch.randint(0, vocab, (2, 20))
    cache = KVCache.for_model(model, 2)
    assert cache.k.shape[2] == cfg.n_kv_head  # the cache holds only the key/value heads
    with torch.no_grad():
        ours = torch.cat([model(ids[:, :5], cache)] + [model(ids[:, t:t + 1], cache)
                                                       for t in range(5, 20)], 1)
        torch.testing.assert_close(ours, hf(ids).logits, atol=1e-5, rtol=0)
        # HF's own incremental decoding (its cache): the same greedy continuation.
        prompt = ids[:1, :6]
        theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                             pad_token_id=0)
    assert torch.equal(generate(model, prompt, 10, temperature=0.0), theirs)


def test_export_reloads_with_auto_model_with_equal_logits(pair, tmp_path) -> None:
    hf, model, vocab = pair
    exported = to_hf(model)
    assert type(exported).__name__ == type(hf).__name__ or (
        type(hf).__name__ == "MistralForCausalLM" and type(exported).__name__ == "LlamaForCausalLM")
    exported.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, vocab, (3, 17))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(from_hf(tmp_path)(ids), expected, atol=1e-5, rtol=0)


def test_mistral_export_on_request() -> None:
    hf = hf_model("Mistral", 71, 16, 1, 2, 1, 12, 28, False, {"sliding_window": None})
    exported = to_hf(from_hf(hf), family="mistral")
    assert type(exported).__name__ == "MistralForCausalLM"
    ids = torch.randint(0, 71, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


# --- tokenizers carried over ----------------------------------------------------------------

TEXT = ("The quick brown fox jumps over the lazy dog. Grüße aus Köln! 日本語のテキスト。\n"
        "def main():\n    return 42  # tabs\tand  spaces\n") * 20


def _trained_tokenizer(kind: str):
    import tokenizers as tk

    if kind == "byte-level":
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style BPE as in Llama 2 / Mistral's tokenizer.json
        tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("▁"),
                                                  tk.normalizers.Replace(" ", "▁")])
        tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "),
                                            tk.decoders.ByteFallback(), tk.decoders.Fuse()])
        alphabet = []
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                     initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    return tok


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece-bpe"])
def test_folder_tokenizer_is_carried_over_and_exported(kind, tmp_path) -> None:
    tok = _trained_tokenizer(kind)
    vocab = tok.get_vocab_size()
    hf = hf_model("Llama", vocab, 16, 1, 2, 1, 8, 24, False, {})
    src = tmp_path / "src"
    hf.save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    model, tokenizer = read_hf_folder(src)
    probe = "Grüße, quick fox!  日本 def x():\n\treturn"
    assert tokenizer.encode(probe) == tok.encode(probe, add_special_tokens=False).ids
    ids = torch.randint(0, vocab, (1, 12))
    dest = write_hf_folder(model, tokenizer, tmp_path / "out")
    auto_tok = transformers.AutoTokenizer.from_pretrained(dest)
    assert auto_tok(probe, add_special_tokens=False)["input_ids"] == tokenizer.encode(probe)
    auto = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_sentencepiece_only_folder_is_refused_and_nothing_is_written(tmp_path, capsys) -> None:
    src = tmp_path / "src"
    hf_model("Llama", 40, 16, 1, 2, 1, 8, 24, False, {}).save_pretrained(src)
    (src / "tokenizer.model").write_bytes(b"\x0a\x0b sentencepiece model proto")
    with pytest.raises(CheckpointError, match="SentencePiece.*tokenizer.json"):
        read_hf_folder(src)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ck").exists()


# --- refusals by name --------------------------------------------------------------------------


def _folder(tmp_path, edit=None, family="Llama"):
    src = tmp_path / "src"
    hf_model(family, 40, 16, 1, 2, 1, 8, 24, False,
             {"sliding_window": None} if family == "Mistral" else {}).save_pretrained(src)
    if edit is not None:
        path = src / "config.json"
        d = json.loads(path.read_text())
        edit(d)
        path.write_text(json.dumps(d))
    return src


@pytest.mark.parametrize("edit, family, field", [
    (lambda d: d.update(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 1e4}), "Llama", "rope_type"),
    (lambda d: d.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "Llama",
     "rope_scaling"),
    (lambda d: d.update(sliding_window=8), "Mistral", "sliding_window"),
    (lambda d: d.update(use_sliding_window=True, sliding_window=8), "Qwen2", "sliding_window"),
    (lambda d: d.update(hidden_act="gelu"), "Llama", "hidden_act"),
    (lambda d: d.update(attention_bias=True, mlp_bias=False), "Llama", "attention_bias"),
    (lambda d: d.update(logit_softcapping=30.0), "Llama", "logit_softcapping"),
    (lambda d: d.update(model_type="phi3", architectures=["Phi3ForCausalLM"]), "Llama",
     "phi3"),
    (lambda d: d.update(architectures=["LlamaForSequenceClassification"]), "Llama",
     "LlamaForSequenceClassification"),
    (lambda d: d.update(num_key_value_heads=3, num_attention_heads=4, head_dim=4), "Llama",
     "n_kv_head"),
    (lambda d: d.update(head_dim=7), "Llama", "head_dim"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, capsys, edit, family, field) -> None:
    src = _folder(tmp_path, edit, family)
    with pytest.raises(ConfigError, match=field):
        from_hf(src)
    out = tmp_path / "ck"
    assert main(["convert", "--from-hf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_weights_that_do_not_match_config_json_are_refused(tmp_path, capsys) -> None:
    src = _folder(tmp_path, lambda d: d.update(intermediate_size=20))
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape"):
        from_hf(src)
    src2 = _folder(tmp_path / "b", lambda d: d.update(num_key_value_heads=2))
    assert main(["convert", "--from-hf", str(src2), "--out", str(tmp_path / "ck")]) == 2
    assert "k_proj.weight has shape" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_convert_cli_round_trip_detects_the_family(tmp_path, capsys) -> None:
    hf = hf_model("Qwen2", 300, 16, 1, 2, 1, 8, 24, False, {})
    src = tmp_path / "src"
    hf.save_pretrained(src)
    _trained_tokenizer("byte-level").save(str(src / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--model", str(tmp_path / "ck"), "--to-hf",
                 str(tmp_path / "back")]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_export_refuses_variants_no_family_has_by_name() -> None:
    from tinylm.core.config import ModelConfig, resolve_arch
    from tinylm.core.model import GPT

    modern = GPT(ModelConfig(**resolve_arch("modern", dict(vocab_size=40, context_length=8,
                                                            n_layer=1, n_head=2, n_embd=16))))
    with pytest.raises(ConfigError, match=r"mlp='relu2'.*qk_norm=True"):
        to_hf(modern)
    odd = GPT(ModelConfig(vocab_size=40, context_length=8, n_layer=1, n_head=2, n_embd=16,
                          norm="rmsnorm", position="rope", mlp="swiglu", bias=True,
                          qkv_bias=False))
    with pytest.raises(ConfigError, match="qkv_bias=False"):
        to_hf(odd)
