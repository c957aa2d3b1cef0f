"""Hugging Face interop, both ways: GPT-2, Llama, Qwen2 and Mistral.

Hugging Face's names live only here, in one name-map table per family. Each row is
(Hugging Face name, tinylm name, how): ``"T"`` transposes (GPT-2's ``Conv1D`` stores
weights as (in, out), the transpose of ``nn.Linear``'s (out, in)), and ``"q"``/``"k"``/
``"v"`` mark the three separate projections of the Llama family that tinylm keeps as
one fused ``attn.qkv`` ([q | k | v]: H query heads, then H_kv key and H_kv value heads,
each D wide). GPT-2's c_attn is already that fused layout. A row whose tinylm tensor the
config does not have (biases of a bias-free model, a tied head) is skipped; every other
row must be present, and a tensor in the file that no row reads is an error.

The family comes from config.json's ``model_type``; every field tinylm does not
implement (``rope_scaling``, sliding windows, another activation, ...) is refused by
name, never dropped. Import reads config.json and safetensors (or ``weights_only``
pickles) directly; ``transformers`` is needed (imported lazily) only to export.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tinylm.core.config import ModelConfig, check_model_fits
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.core.model import GPT
from tinylm.layers import registry

# (Hugging Face name, tinylm name, how). "{i}" is the block index.
GPT2_NAMES: list[tuple[str, str, str]] = [
    ("transformer.wte.weight", "tok_emb.weight", ""),
    ("transformer.wpe.weight", "pos_emb.weight", ""),
    ("transformer.h.{i}.ln_1.weight", "blocks.{i}.ln1.weight", ""),
    ("transformer.h.{i}.ln_1.bias", "blocks.{i}.ln1.bias", ""),
    ("transformer.h.{i}.attn.c_attn.weight", "blocks.{i}.attn.qkv.weight", "T"),
    ("transformer.h.{i}.attn.c_attn.bias", "blocks.{i}.attn.qkv.bias", ""),
    ("transformer.h.{i}.attn.c_proj.weight", "blocks.{i}.attn.out.weight", "T"),
    ("transformer.h.{i}.attn.c_proj.bias", "blocks.{i}.attn.out.bias", ""),
    ("transformer.h.{i}.ln_2.weight", "blocks.{i}.ln2.weight", ""),
    ("transformer.h.{i}.ln_2.bias", "blocks.{i}.ln2.bias", ""),
    ("transformer.h.{i}.mlp.c_fc.weight", "blocks.{i}.ffn.up.weight", "T"),
    ("transformer.h.{i}.mlp.c_fc.bias", "blocks.{i}.ffn.up.bias", ""),
    ("transformer.h.{i}.mlp.c_proj.weight", "blocks.{i}.ffn.down.weight", "T"),
    ("transformer.h.{i}.mlp.c_proj.bias", "blocks.{i}.ffn.down.bias", ""),
    ("transformer.ln_f.weight", "final_norm.weight", ""),
    ("transformer.ln_f.bias", "final_norm.bias", ""),
    ("lm_head.weight", "lm_head.weight", ""),
]


def _llama_rows(bias_rows: bool) -> list[tuple[str, str, str]]:
    at, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    rows = [("model.embed_tokens.weight", "tok_emb.weight", ""),
            ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.ln1.weight", "")]
    for part in "qkv":
        rows.append((f"{at}{part}_proj.weight", "blocks.{i}.attn.qkv.weight", part))
        rows.append((f"{at}{part}_proj.bias", "blocks.{i}.attn.qkv.bias", part))
    rows.append((f"{at}o_proj.weight", "blocks.{i}.attn.out.weight", ""))
    rows.append(("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.ln2.weight", ""))
    for hf_part, ours in (("gate", "gate"), ("up", "up"), ("down", "down")):
        rows.append((f"{mlp}{hf_part}_proj.weight", f"blocks.{{i}}.ffn.{ours}.weight", ""))
        if bias_rows:
            rows.append((f"{mlp}{hf_part}_proj.bias", f"blocks.{{i}}.ffn.{ours}.bias", ""))
    if bias_rows:
        rows.append((f"{at}o_proj.bias", "blocks.{i}.attn.out.bias", ""))
    rows += [("model.norm.weight", "final_norm.weight", ""),
             ("lm_head.weight", "lm_head.weight", "")]
    return rows


#: Llama (attention_bias / mlp_bias optional), Qwen2 (q/k/v biases, nothing else) and
#: Mistral (none) share their tensor names.
LLAMA_NAMES = _llama_rows(bias_rows=True)
QWEN2_NAMES = _llama_rows(bias_rows=False)
MISTRAL_NAMES = [r for r in _llama_rows(bias_rows=False) if not r[0].endswith(".bias")]

#: Tensors a file may hold that carry no weights (causal-mask and RoPE buffers).
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

#: config.json keys that do not change the function a model computes: where it came from
#: and which library wrote it (every key starting with "_" too: transformers' private
#: bookkeeping, "_name_or_path", "_model_name_or_path", "_commit_hash",
#: "_attn_implementation"), how it was stored, its token roles, training-only settings,
#: and transformers 4's generation defaults (how to sample, not what the model computes).
_HARMLESS = {
    "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "vocab_size", "attention_dropout", "pretraining_tp",
    "name_or_path", "model_name_or_path", "unk_token_id", "sep_token_id", "cls_token_id",
    "mask_token_id", "decoder_start_token_id", "tokenizer_class", "prefix",
    "finetuning_task", "torchscript", "use_bfloat16", "tf_legacy_loss", "is_decoder",
    "tie_encoder_decoder", "cross_attention_hidden_size", "num_labels", "use_return_dict",
    "gradient_checkpointing", "keys_to_ignore_at_inference",
    # generation defaults (transformers 4 kept them in config.json)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
}
#: quantization_config methods whose weights reach tinylm as plain floats: transformers'
#: GGUF loader dequantizes every tensor when it loads a .gguf file and only records the
#: file in the config ({"quant_method": "gguf", "gguf_file": ...}).
_DEQUANTIZED_METHODS = {"gguf"}
_GPT2_KEYS = {
    "activation_function", "n_embd", "n_head", "n_inner", "feed_forward_length", "n_layer",
    "n_positions", "n_ctx",
    "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn", "add_cross_attention", "attn_pdrop", "embd_pdrop",
    "resid_pdrop", "summary_activation", "summary_first_dropout", "summary_proj_to_labels",
    "summary_type", "summary_use_proj", "task_specific_params", "n_special",
    "predict_special_tokens",
}
_LLAMA_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
}


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its class, model_type, names, config reader."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # config.json's model_type, e.g. "llama"
    names: list[tuple[str, str, str]]
    read_config: Callable[[dict[str, Any]], ModelConfig]
    prefix: str  # of the base model's tensors ("transformer." / "model.")


def _refuse(family: str, unsupported: list[str]) -> None:
    if unsupported:
        raise ConfigError(f"this {family} config uses features tinylm does not implement: "
                          + "; ".join(unsupported) + " (nothing was written)")


def _is_default(value: Any) -> bool:
    """None, False or an empty container/string: a key that switches nothing on."""
    return value is None or value is False or (isinstance(value, (dict, list, str))
                                                and not value)


def _unknown_fields(d: dict[str, Any], known: set[str]) -> list[str]:
    """The config keys that would change the computation and tinylm does not read, each
    as ``key=value``: bookkeeping (:data:`_HARMLESS`, "_..." keys) and keys left at their
    off value are not among them; quantization_config only for stored-quantized weights."""
    unsupported = [f"{k}={d[k]!r:.80}" for k in sorted(d)
                   if k not in known and k not in _HARMLESS and k != "quantization_config"
                   and not k.startswith("_") and not _is_default(d[k])]
    return unsupported + _quantization_refusal(d.get("quantization_config"))


def _quantization_refusal(q: Any) -> list[str]:
    """[] when ``quantization_config`` is absent or describes weights transformers has
    already dequantized (a model loaded from a GGUF file); else the one reason."""
    if _is_default(q):
        return []
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method in _DEQUANTIZED_METHODS:
        return []
    return [f"quantization_config with quant_method={method!r} (weights stored quantized; "
            f"tinylm imports float weights: dequantize the model in transformers and "
            f"save_pretrained it, or convert a GGUF file with --from-gguf)"]


def _gpt2_config(d: dict[str, Any]) -> ModelConfig:
    unsupported = _unknown_fields(d, _GPT2_KEYS)
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(f"activation_function={act!r} (tinylm uses GELU tanh, 'gelu_new')")
    for key in ("n_inner", "feed_forward_length"):  # the second: transformers' GGUF loader
        if d.get(key) not in (None, 4 * d["n_embd"]):
            unsupported.append(f"{key}={d[key]} (tinylm's GPT-2 uses 4·n_embd)")
    if not d.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if d.get(flag):
            unsupported.append(f"{flag}=True")
    _refuse("GPT-2", unsupported)
    return ModelConfig(
        vocab_size=d["vocab_size"], context_length=d["n_positions"], n_layer=d["n_layer"],
        n_head=d["n_head"], n_embd=d["n_embd"], dropout=0.0, bias=True,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
    )


def _rope_theta(d: dict[str, Any], unsupported: list[str]) -> float:
    """RoPE's θ from either spelling (transformers 5's rope_parameters, or the older
    top-level rope_theta + rope_scaling); anything but plain RoPE is refused."""
    if d.get("rope_scaling"):
        unsupported.append(f"rope_scaling={d['rope_scaling']!r} (tinylm implements plain "
                           f"RoPE only)")
    params = dict(d.get("rope_parameters") or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    if kind != "default":
        unsupported.append(f"rope_parameters.rope_type={kind!r} (tinylm implements plain "
                           f"RoPE, 'default', only)")
    for key in sorted(params):
        if params[key] is not None and key not in ("rope_theta",):
            unsupported.append(f"rope_parameters.{key}={params[key]!r}")
    return float(theta)


def _llama_family_config(d: dict[str, Any], family: str) -> ModelConfig:
    unsupported = _unknown_fields(d, _LLAMA_KEYS)
    if d.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={d['hidden_act']!r} (tinylm's SwiGLU uses 'silu')")
    theta = _rope_theta(d, unsupported)
    max_pos = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    if family == "Qwen2":
        window = window if d.get("use_sliding_window") else None
    if window is not None and window < max_pos:
        unsupported.append(f"sliding_window={window} (tinylm attends over the whole context; "
                           f"max_position_embeddings is {max_pos})")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        unsupported.append(f"layer_types={sorted(set(layer_types))!r} (tinylm has full "
                           f"attention in every layer)")
    if family == "Qwen2":
        bias, qkv_bias = False, True
    elif family == "Mistral":
        bias = qkv_bias = False
    else:
        qkv_bias = bool(d.get("attention_bias", False))
        bias = bool(d.get("mlp_bias", False))
        if bias != qkv_bias:
            unsupported.append(f"attention_bias={qkv_bias} with mlp_bias={bias} (tinylm has one "
                               f"bias setting for the output projection and the MLP)")
    _refuse(family, unsupported)
    heads = d["num_attention_heads"]
    return ModelConfig(
        vocab_size=d["vocab_size"], context_length=max_pos, n_layer=d["num_hidden_layers"],
        n_head=heads, n_embd=d["hidden_size"],
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        n_kv_head=d.get("num_key_value_heads") or heads, dropout=0.0, bias=bias,
        qkv_bias=qkv_bias, tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        norm="rmsnorm", norm_eps=float(d.get("rms_norm_eps", 1e-6)), position="rope",
        rope_theta=theta, mlp="swiglu", ffn_hidden=d["intermediate_size"],
    )


FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT2LMHeadModel", "gpt2", GPT2_NAMES, _gpt2_config, "transformer."),
    "llama": Family("LlamaForCausalLM", "llama", LLAMA_NAMES,
                    lambda d: _llama_family_config(d, "Llama"), "model."),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", QWEN2_NAMES,
                    lambda d: _llama_family_config(d, "Qwen2"), "model."),
    "mistral": Family("MistralForCausalLM", "mistral", MISTRAL_NAMES,
                      lambda d: _llama_family_config(d, "Mistral"), "model."),
}


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("Hugging Face interop needs the 'transformers' package; install it "
                          "with: pip install 'tinylm[hf]'") from exc
    return transformers


def _expand(names: list[tuple[str, str, str]], n_layer: int) -> list[tuple[str, str, str]]:
    rows = []
    for hf_name, our_name, how in names:
        if "{i}" in hf_name:
            rows += [(hf_name.format(i=i), our_name.format(i=i), how) for i in range(n_layer)]
        else:
            rows.append((hf_name, our_name, how))
    return rows


def family_of(d: dict[str, Any]) -> Family:
    """The family of a config.json's contents, by ``model_type`` (and ``architectures``)."""
    kind = d.get("model_type")
    archs = d.get("architectures") or []
    if kind not in FAMILIES:
        supported = ", ".join(f.architecture for f in FAMILIES.values())
        raise ConfigError(f"config.json has model_type={kind!r} (architectures {archs}); tinylm "
                          f"imports {supported} only")
    family = FAMILIES[kind]
    other = [a for a in archs if a != family.architecture]
    if other:
        raise ConfigError(f"config.json names architecture {other[0]!r}; tinylm imports "
                          f"{family.architecture} for model_type {kind!r} (a causal LM head "
                          f"on the base model)")
    return family


def config_from_hf(hf_config: Any) -> ModelConfig:
    """A ModelConfig equal to a Hugging Face config (an object or config.json's dict);
    refuses, by name, every field tinylm does not implement."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return family_of(d).read_config(d)


#: The first torch whose weights_only unpickler has no published bypass (before 2.6) or
#: memory-corruption issue (before 2.10).
SAFE_PICKLE_TORCH = (2, 10)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _load_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` state dict read with ``weights_only=True`` (tensors only,
    never code from the file); every refusal is one line and none suggests lifting the
    protection."""
    fix = ("tinylm reads only plain tensors from a pickle; save the weights as "
           "model.safetensors (safetensors.torch.save_file) and convert that")
    if _torch_version() < SAFE_PICKLE_TORCH:
        raise CheckpointError(f"{path} is a pickle, and torch {torch.__version__} cannot read "
                              f"pickles safely (needs >= {'.'.join(map(str, SAFE_PICKLE_TORCH))}"
                              f"); upgrade torch, or {fix.split('; ', 1)[1]}")
    try:
        with warnings.catch_warnings():  # torch warns, in several lines, about protocols
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" (it refers to {found.group(1)})" if found else ""
        raise CheckpointError(f"{path} holds pickled objects other than tensors{what}, "
                              f"which were not loaded; {fix}") from None
    except Exception as exc:  # a truncated zip, not a pickle at all, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "weights_only" in first.lower() or "weights only" in first.lower():
            first = type(exc).__name__
        raise CheckpointError(f"{path} is not a readable PyTorch weights file ({first[:200]});"
                              f" {fix}") from None
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a dict of weight "
                              f"names to tensors; {fix}")
    bad = next((k for k, v in state.items()
                if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise CheckpointError(f"{path} maps {bad!r} to a {type(state[bad]).__name__}, not a "
                              f"tensor; a weights file holds only tensors; {fix}")
    return state


def _hf_state_to_tinylm(state: dict[str, torch.Tensor], family: Family, model: GPT
                        ) -> dict[str, torch.Tensor]:
    """tinylm's state dict from a family's tensors: every tensor the model needs, of the
    shape it needs, and no tensor left unread."""
    config = model.config
    if not any(k.startswith(family.prefix) for k in state):  # a base model's names
        state = {(k if k == "lm_head.weight" else family.prefix + k): v for k, v in state.items()}
    own = model.state_dict()
    sizes = {"q": (0, config.inner_dim), "k": (config.inner_dim, config.kv_dim),
             "v": (config.inner_dim + config.kv_dim, config.kv_dim)}
    out: dict[str, torch.Tensor] = {}
    used = set()
    for hf_name, our_name, how in _expand(family.names, config.n_layer):
        if our_name not in own or (our_name == "lm_head.weight" and config.tie_embeddings):
            continue
        if hf_name not in state:
            raise CheckpointError(f"{family.architecture} weights lack {hf_name}; the file is "
                                  f"incomplete or config.json describes another model")
        used.add(hf_name)
        w = state[hf_name].t() if how == "T" else state[hf_name]
        want = own[our_name].shape
        if how in sizes:
            offset, rows = sizes[how]
            want = (rows,) + tuple(want[1:])
            out.setdefault(our_name, torch.empty(own[our_name].shape, dtype=w.dtype))
        if tuple(w.shape) != tuple(want):
            raise CheckpointError(f"{family.architecture} weight {hf_name} has shape "
                                  f"{tuple(w.shape)} but config.json implies {tuple(want)}; the "
                                  f"folder mixes files from different models")
        if how in sizes:
            out[our_name][offset:offset + rows] = w
        else:
            out[our_name] = w.contiguous()
    extra = sorted(k for k in state if k not in used and not k.endswith(_BUFFERS)
                   and not (k == "lm_head.weight" and config.tie_embeddings))
    if extra:
        raise CheckpointError(f"{family.architecture} weights hold {extra[0]} (and "
                              f"{len(extra) - 1} more) that config.json does not describe; "
                              f"tinylm would drop them, so it refuses the folder")
    return out


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a save_pretrained folder, without running pickled code."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = [folder / "model.safetensors"]
    if index.is_file():
        try:
            files = [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"]
                                                   .values()))]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index: {exc}") from exc
    if all(f.is_file() for f in files):
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as exc:
                raise CheckpointError(f"{f} is corrupt: {exc}") from exc
        return state
    if (folder / "pytorch_model.bin").is_file():
        return _load_pickled_weights(folder / "pytorch_model.bin")
    raise CheckpointError(f"{folder} has neither model.safetensors nor pytorch_model.bin")


def _read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a folder written by "
                              f"save_pretrained (config.json + model.safetensors)")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not a JSON object of config fields")
    return d


def from_hf(model_or_folder: Any) -> GPT:
    """A tinylm GPT equal to a Hugging Face GPT-2, Llama, Qwen2 or Mistral causal LM (a
    model object, or a save_pretrained folder on disk)."""
    if isinstance(model_or_folder, (str, os.PathLike)):
        folder = Path(model_or_folder)
        d = _read_config_json(folder)
        family = family_of(d)  # before the weights: refuse early, read nothing more
        config = family.read_config(d)
        state = _load_weights(folder)
    else:
        d = model_or_folder.config.to_dict()
        family = family_of(d)
        config = family.read_config(d)
        state = model_or_folder.state_dict()
    try:  # estimated before allocating, as for a tinylm config.json
        check_model_fits(config, "cpu")
    except ConfigError as exc:
        raise CheckpointError(f"the {family.architecture} config.json describes a model too "
                              f"large to load: {exc}") from None
    model = GPT(config)
    ours = _hf_state_to_tinylm(state, family, model)
    missing = sorted(set(model.state_dict()) - set(ours)
                     - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if missing:
        raise CheckpointError(f"{family.architecture} weights lack {missing[:3]}")
    model.load_state_dict(ours, strict=False)
    return model.eval()


# --- export --------------------------------------------------------------------------------


def export_family(config: ModelConfig, family: str | None = None) -> Family:
    """The Hugging Face family that computes exactly ``config``'s model (``family`` may
    ask for "mistral" instead of the equivalent "llama"); refuses, by field, what none has."""
    if config.gpt2_layout and family in (None, "gpt2"):
        if config.inner_dim != config.n_embd:
            raise ConfigError(f"GPT-2 requires n_head·head_dim == n_embd, but this model has "
                              f"{config.n_head}·{config.head_dim} != {config.n_embd}; it cannot "
                              f"be exported")
        return FAMILIES["gpt2"]
    llama = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "qk_norm": False}
    wrong = [f"{k}={getattr(config, k)!r}" for k, v in llama.items() if getattr(config, k) != v]
    if wrong:
        raise ConfigError(f"no Hugging Face family tinylm exports has {', '.join(wrong)}: GPT-2 "
                          f"is layernorm/learned/gelu, Llama, Qwen2 and Mistral are "
                          f"rmsnorm/rope/swiglu without qk_norm")
    if family is None:
        family = "qwen2" if config.qkv_bias and not config.bias else "llama"
    if family not in FAMILIES or family == "gpt2":
        raise ConfigError(f"cannot export this model as {family!r}; choose llama, qwen2 or "
                          f"mistral")
    biases = {"llama": (config.bias,), "qwen2": (False, True), "mistral": (False, False)}
    need = biases[family]
    if (family == "llama" and config.qkv_bias != config.bias) or (
            family != "llama" and (config.bias, config.qkv_bias) != need):
        raise ConfigError(f"{FAMILIES[family].architecture} cannot hold bias={config.bias} with "
                          f"qkv_bias={config.qkv_bias}")
    return FAMILIES[family]


def _hf_config(config: ModelConfig, family: Family, transformers: Any) -> Any:
    c = config
    if family.model_type == "gpt2":
        return transformers.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.context_length, n_embd=c.n_embd,
            n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.norm_eps,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=c.tie_embeddings,
            # GPT-2's default <|endoftext|> id 50256 does not exist in smaller vocabularies.
            bos_token_id=50256 if c.vocab_size > 50256 else None,
            eos_token_id=50256 if c.vocab_size > 50256 else None,
        )
    kw: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, hidden_act="silu",
        max_position_embeddings=c.context_length, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if family.model_type == "llama":
        kw.update(attention_bias=c.bias, mlp_bias=c.bias)
    if family.model_type == "mistral":
        kw.update(sliding_window=None)
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
    return getattr(transformers, cls[family.model_type])(**kw)


def _exportable(model: GPT, family: Family) -> GPT:
    """``model``, or a copy with its replaced layers made dense (int8 layers dequantized,
    LoRA adapters merged); a kind that has no dense export (low-rank) is refused."""
    present = [kind for kind in registry.KINDS if kind.present_in(model)]
    for kind in present:
        if kind.export_refusal is not None:
            raise ConfigError(kind.export_refusal.format(architecture=family.architecture))
    return registry.densified(copy.deepcopy(model), present) if present else model


def to_hf(model: GPT, family: str | None = None):
    """A transformers model (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM or
    MistralForCausalLM; see :func:`export_family`) with the same weights as ``model``."""
    transformers = _require_transformers()
    from tinylm.io.checkpoint_files import unwrap_model

    model = unwrap_model(model)
    c = model.config
    fam = export_family(c, family)
    model = _exportable(model, fam)
    hf = getattr(transformers, fam.architecture)(_hf_config(c, fam, transformers))
    ours = model.state_dict()
    sizes = {"q": (0, c.inner_dim), "k": (c.inner_dim, c.kv_dim),
             "v": (c.inner_dim + c.kv_dim, c.kv_dim)}
    hf_sd = hf.state_dict()
    hf_state = {}
    for hf_name, our_name, how in _expand(fam.names, c.n_layer):
        if our_name not in ours or hf_name not in hf_sd:
            continue  # e.g. biases of a bias-free model
        w = ours[our_name].detach().to("cpu", torch.float32)
        if how in sizes:
            w = w[sizes[how][0]:sum(sizes[how])]
        hf_state[hf_name] = w.t().contiguous() if how == "T" else w.clone()
    for name, value in hf_sd.items():
        if name not in hf_state and name.endswith(".bias") and fam.model_type == "gpt2":
            hf_state[name] = torch.zeros_like(value)  # GPT-2 always has biases: zeros
    missing = [n for n in hf_sd if n not in hf_state and not n.endswith(_BUFFERS)
               and not (n == "lm_head.weight" and c.tie_embeddings)]
    if missing:
        raise ConfigError(f"{fam.architecture} has {missing[0]}, which this model lacks")
    hf.load_state_dict(hf_state, strict=False)
    if c.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


# --- Hugging Face folders on disk (tinylm convert) ----------------------------------------


#: What ``hub_folder`` fetches of a repository: weights as safetensors only (never a
#: pickle), the configs, the tokenizer files and a chat template.
HUB_FILES = ("*.json", "*.safetensors", "merges.txt", "vocab.json", "*.jinja")


def is_hub_name(source: str) -> bool:
    """True for ``ORG/NAME`` that is not a path on disk (a Hugging Face Hub repository)."""
    parts = source.split("/")
    return (len(parts) == 2 and all(parts) and not Path(source).exists()
            and not source.startswith((".", "~")))


def hub_folder(repo_id: str, *, revision: str | None = None) -> Path:
    """The local folder of Hub repository ``repo_id`` (``ORG/NAME``): downloaded through
    ``huggingface_hub`` into its cache, or taken from the cache alone when the machine is
    offline (``HF_HUB_OFFLINE=1``). Only :data:`HUB_FILES` are fetched."""
    try:
        import huggingface_hub
    except ImportError as exc:
        raise CheckpointError("--from-hf ORG/NAME needs huggingface_hub (pip install "
                              "'tinylm[hf]'), or pass a folder on disk") from exc
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except (OSError, ValueError) as exc:  # its errors are OSError/ValueError kinds
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = ("it is not in the Hugging Face cache and HF_HUB_OFFLINE is set" if offline
                else "check the name and the network, or pass a folder on disk")
        raise CheckpointError(f"cannot get {repo_id} from the Hugging Face Hub: "
                              f"{_first_line(exc)}; {hint}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())


def read_hf_folder(folder: str | os.PathLike) -> tuple[GPT, Any]:
    """(model, tokenizer or None) from a Hugging Face GPT-2, Llama, Qwen2 or Mistral
    folder on disk.

    The weights come from model.safetensors (or its shards), or pytorch_model.bin
    loaded with ``weights_only=True``; the tokenizer from tokenizer.json (any kind:
    byte-level BPE, SentencePiece-style BPE or Unigram converted by Hugging Face) or
    vocab.json + merges.txt when the folder has them, with its chat template and
    special-token roles (tokenizer_config.json, chat_template.jinja,
    special_tokens_map.json; :func:`_with_hf_roles` adds what generation_config.json and
    tokenizer.json's post-processor say). A folder whose only tokenizer is
    a SentencePiece ``tokenizer.model`` is refused: tinylm does not run SentencePiece.
    Nothing is downloaded.
    """
    path = Path(folder)
    if path.is_file():
        raise CheckpointError(f"{path} is a file, not a Hugging Face folder; pass the folder "
                              f"that holds its config.json and model.safetensors (a .gguf "
                              f"file: --from-gguf FILE)")
    if not path.is_dir():
        raise CheckpointError(f"Hugging Face folder {path} does not exist; pass a folder "
                              f"written by save_pretrained (config.json + model.safetensors)")
    if not _has_tokenizer_files(path) and (path / "tokenizer.model").is_file():
        raise CheckpointError(f"{path} has only a SentencePiece tokenizer.model, which tinylm "
                              f"cannot read; add its tokenizer.json (transformers writes one: "
                              f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), or "
                              f"remove tokenizer.model to import the weights alone")
    model = from_hf(path)
    if not _has_tokenizer_files(path):
        return model, None
    from tinylm.data.tokenizer_files import load_tokenizer

    tokenizer = _with_hf_roles(load_tokenizer(path), path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                              f"model only {model.config.vocab_size} embedding rows; the folder "
                              f"mixes files from different models")
    return model, tokenizer


def _with_hf_roles(tokenizer: Any, folder: Path) -> Any:
    """``tokenizer`` with what the folder says beyond tokenizer_config.json: the
    end-of-turn tokens of generation_config.json's ``eos_token_id`` (an id or a list),
    and ``add_bos_token`` from the post-processor of tokenizer.json when the config
    does not say (Llama 3's adds bos there)."""
    settings = tokenizer.settings
    path = folder / "generation_config.json"
    ids: Any = None
    if path.is_file():
        try:
            ids = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, OSError, AttributeError) as exc:
            raise CheckpointError(f"{path} is not a JSON object: {exc}") from exc
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    found = [tokenizer.id_to_token(i) for i in ids if isinstance(i, int)
             and not isinstance(i, bool) and 0 <= i < tokenizer.vocab_size]
    eot = tuple(dict.fromkeys([*settings.end_of_turn, *(t for t in found
                                                       if t != settings.eos_token)]))
    add_bos = settings.add_bos_token
    hf = getattr(tokenizer, "hf", None)
    if add_bos is None and tokenizer.bos_id is not None and hf is not None:
        with_specials = hf.encode("a", add_special_tokens=True).ids
        add_bos = bool(with_specials) and with_specials[0] == tokenizer.bos_id \
            and len(with_specials) > len(hf.encode("a", add_special_tokens=False).ids)
    new = replace(settings, end_of_turn=eot, add_bos_token=add_bos or None)
    return tokenizer if new == settings else tokenizer.with_settings(new)


def write_hf_folder(model: GPT, tokenizer: Any, folder: str | os.PathLike, *,
                    weights_only: bool = False) -> Path:
    """Write ``model`` (and its tokenizer) as a folder that
    ``transformers.AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load: config.json, model.safetensors, and
    tokenizer.json + tokenizer_config.json (plus GPT-2's vocab.json + merges.txt for
    byte-level BPE). The family follows the architecture (:func:`export_family`):
    GPT-2 for GPT-2's layout, Llama or Qwen2 (QKV biases only) for RMSNorm + RoPE +
    SwiGLU.

    GPT-2 tokenizers are byte-level BPE, so a char tokenizer (one token per Unicode
    character, e.g. one token for "日" instead of its three bytes) has no GPT-2
    equivalent: that is an error unless ``weights_only``, which writes the model alone.
    The folder is written under a temporary name and renamed when complete; an existing
    non-empty folder is never overwritten.
    """
    import shutil
    import tempfile

    dest = Path(folder)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest} already exists and is not an empty folder; choose a new "
                          f"--to-hf folder (nothing was written)")
    if tokenizer is None and not weights_only:
        raise ConfigError("this checkpoint has no tokenizer.json, so no tokenizer can be "
                          "exported; pass --weights-only to export the weights alone")
    if not weights_only and tokenizer.kind == "char":
        raise ConfigError("a char tokenizer cannot be exported as a GPT-2 tokenizer: GPT-2 "
                          "tokenizers are byte-level BPE (vocab.json + merges.txt over UTF-8 "
                          "bytes) and a char vocabulary has one token per Unicode character; "
                          "pass --weights-only to export the weights alone, or train with "
                          "'tinylm prepare --tokenizer bpe'")
    hf_model = to_hf(model)
    _set_token_ids(hf_model, tokenizer)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as exc:
        raise ConfigError(f"cannot write in {dest.parent}: {exc.strerror}; choose a writable "
                          f"folder") from exc
    progress = _require_transformers().utils.logging
    bars = progress.is_progress_bar_enabled()
    progress.disable_progress_bar()  # the CLI reports the result in one line
    try:
        hf_model.save_pretrained(str(tmp))
        if not weights_only:
            _write_hf_tokenizer(tokenizer, tmp, model.config.context_length)
        if dest.exists():
            dest.rmdir()  # checked empty above
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            progress.enable_progress_bar()
    return dest


def _set_token_ids(hf_model: Any, tokenizer: Any) -> None:
    """bos/eos/pad ids of the exported config and generation config: the tokenizer's
    (GPT2Config's default id 50256 is absent from small vocabularies); the generation
    config's ``eos_token_id`` lists every stop token of a chat model (<|end|>, or its
    eos and end-of-turn tokens), so ``generate`` stops where ``tinylm chat`` does."""
    from tinylm.data.chat import stop_ids

    eos = tokenizer.eos_id if tokenizer is not None else None
    bos = tokenizer.bos_id if tokenizer is not None else None
    bos = eos if bos is None else bos
    stops = [] if tokenizer is None or tokenizer.chat_template is None else stop_ids(tokenizer)
    stops = list(dict.fromkeys([*([] if eos is None else [eos]), *stops]))
    hf_model.config.bos_token_id, hf_model.config.eos_token_id = bos, eos
    gen = getattr(hf_model, "generation_config", None)
    if gen is not None:
        gen.bos_token_id = bos
        gen.eos_token_id = stops if len(stops) > 1 else eos
        if len(stops) > 1:
            gen.pad_token_id = eos


def _write_hf_tokenizer(tokenizer: Any, folder: Path, context_length: int) -> None:
    import json

    tokenizer.save(folder / "tokenizer.json")
    byte_level = getattr(tokenizer, "byte_level", False)
    if byte_level:  # GPT-2's own files too, for the slow GPT2Tokenizer of transformers 4
        tokenizer.hf.model.save(str(folder))
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer" if byte_level else "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    # Explicit nulls: GPT2Tokenizer would otherwise add "<|endoftext|>" to a vocabulary
    # that lacks it, changing both the size and the encoding of that text.
    eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
    config.update(bos_token=eos, eos_token=eos, unk_token=eos)
    own = tokenizer.settings.to_hf()  # the model's own roles and template, when it has them
    own.pop("end_of_turn_tokens", None)  # generation_config.json's eos_token_id says them
    own.pop("model_max_length", None)
    config.update(own)
    if tokenizer.chat_template is not None:  # the same ids as tinylm.data.chat.render_chat
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                  encoding="utf-8")
