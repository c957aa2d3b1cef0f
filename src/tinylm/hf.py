"""Hugging Face GPT-2 interop: one name-map table, import and export.

GPT-2's names live only here. Its ``Conv1D`` layers store weights as (in, out), the
transpose of ``nn.Linear``'s (out, in); the table marks which ones to transpose. The
fused QKV layouts agree: GPT-2's c_attn output is [q | k | v], each split into H heads
of D, exactly as ``MultiHeadAttention.qkv``. ``transformers`` is imported lazily.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from tinylm.config import ModelConfig, check_model_fits
from tinylm.errors import CheckpointError, ConfigError
from tinylm.lora import LoRALinear, merge_lora
from tinylm.model import GPT
from tinylm.quantize import dequantized
from tinylm.quantize import structure_of as structure_of_quantized

# (GPT-2 name, tinylm name, transpose). "{i}" is the block index.
NAME_MAP: list[tuple[str, str, bool]] = [
    ("transformer.wte.weight", "tok_emb.weight", False),
    ("transformer.wpe.weight", "pos_emb.weight", False),
    ("transformer.h.{i}.ln_1.weight", "blocks.{i}.ln1.weight", False),
    ("transformer.h.{i}.ln_1.bias", "blocks.{i}.ln1.bias", False),
    ("transformer.h.{i}.attn.c_attn.weight", "blocks.{i}.attn.qkv.weight", True),
    ("transformer.h.{i}.attn.c_attn.bias", "blocks.{i}.attn.qkv.bias", False),
    ("transformer.h.{i}.attn.c_proj.weight", "blocks.{i}.attn.out.weight", True),
    ("transformer.h.{i}.attn.c_proj.bias", "blocks.{i}.attn.out.bias", False),
    ("transformer.h.{i}.ln_2.weight", "blocks.{i}.ln2.weight", False),
    ("transformer.h.{i}.ln_2.bias", "blocks.{i}.ln2.bias", False),
    ("transformer.h.{i}.mlp.c_fc.weight", "blocks.{i}.ffn.up.weight", True),
    ("transformer.h.{i}.mlp.c_fc.bias", "blocks.{i}.ffn.up.bias", False),
    ("transformer.h.{i}.mlp.c_proj.weight", "blocks.{i}.ffn.down.weight", True),
    ("transformer.h.{i}.mlp.c_proj.bias", "blocks.{i}.ffn.down.bias", False),
    ("transformer.ln_f.weight", "final_norm.weight", False),
    ("transformer.ln_f.bias", "final_norm.bias", False),
    ("lm_head.weight", "lm_head.weight", False),
]


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("Hugging Face interop needs the 'transformers' package; install it "
                          "with: pip install 'tinylm[hf]'") from exc
    return transformers


def _expand(n_layer: int) -> list[tuple[str, str, bool]]:
    rows = []
    for hf_name, our_name, transpose in NAME_MAP:
        if "{i}" in hf_name:
            rows += [(hf_name.format(i=i), our_name.format(i=i), transpose) for i in range(n_layer)]
        else:
            rows.append((hf_name, our_name, transpose))
    return rows


def config_from_hf(hf_config: Any) -> ModelConfig:
    """A ModelConfig equal to a transformers GPT2Config; refuses variants tinylm lacks."""
    act = getattr(hf_config, "activation_function", "gelu_new")
    unsupported = []
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(f"activation_function={act!r} (tinylm uses GELU tanh, 'gelu_new')")
    n_inner = getattr(hf_config, "n_inner", None)
    if n_inner not in (None, 4 * hf_config.n_embd):
        unsupported.append(f"n_inner={n_inner} (tinylm uses 4·n_embd)")
    if not getattr(hf_config, "scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=True")
    if unsupported:
        raise ConfigError("this GPT-2 config uses features tinylm does not implement: "
                          + "; ".join(unsupported))
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        context_length=hf_config.n_positions,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        dropout=0.0,
        bias=True,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        layer_norm_eps=float(hf_config.layer_norm_epsilon),
    )


def _load_hf_folder(folder: Path):
    """A GPT2LMHeadModel from a save_pretrained folder, without running pickled code."""
    transformers = _require_transformers()
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a folder written by "
                              f"save_pretrained (config.json + model.safetensors)")
    try:
        hf_config = transformers.GPT2Config.from_pretrained(str(folder))
    except Exception as exc:
        raise CheckpointError(f"{folder}/config.json is not a GPT-2 config: {exc}") from exc
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        try:
            state = load_file(str(folder / "model.safetensors"))
        except Exception as exc:
            raise CheckpointError(f"{folder}/model.safetensors is corrupt: {exc}") from exc
    elif (folder / "pytorch_model.bin").is_file():
        state = _load_pickled_weights(folder / "pytorch_model.bin")
    else:
        raise CheckpointError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    return hf_config, state


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


def _hf_state_to_tinylm(state: dict[str, torch.Tensor], config: ModelConfig
                        ) -> dict[str, torch.Tensor]:
    # save_pretrained may drop the "transformer." prefix for the base model.
    if not any(k.startswith("transformer.") for k in state):
        state = {("lm_head.weight" if k == "lm_head.weight" else f"transformer.{k}"): v
                 for k, v in state.items()}
    out = {}
    for hf_name, our_name, transpose in _expand(config.n_layer):
        if hf_name == "lm_head.weight" and (config.tie_embeddings or hf_name not in state):
            continue
        if hf_name not in state:
            raise CheckpointError(f"GPT-2 weights lack {hf_name}; the file is incomplete")
        w = state[hf_name]
        out[our_name] = w.t().contiguous() if transpose else w
    return out


def from_hf(model_or_folder: Any) -> GPT:
    """A tinylm GPT equal to a Hugging Face GPT2LMHeadModel (or a save_pretrained folder)."""
    if isinstance(model_or_folder, (str, os.PathLike)):
        hf_config, state = _load_hf_folder(Path(model_or_folder))
    else:
        hf_config, state = model_or_folder.config, model_or_folder.state_dict()
    config = config_from_hf(hf_config)
    try:  # estimated before allocating, as for a tinylm config.json
        check_model_fits(config, "cpu")
    except ConfigError as exc:
        raise CheckpointError(f"the GPT-2 config.json describes a model too large to load: "
                              f"{exc}") from None
    model = GPT(config)
    ours = _hf_state_to_tinylm(state, config)
    missing = set(model.state_dict()) - set(ours) - (
        {"lm_head.weight"} if config.tie_embeddings else set())
    if missing:
        raise CheckpointError(f"GPT-2 weights lack {sorted(missing)[:3]}")
    own = model.state_dict()
    for name, value in ours.items():
        if own[name].shape != value.shape:
            raise CheckpointError(f"GPT-2 weight for {name} has shape {tuple(value.shape)} but "
                                  f"config.json implies {tuple(own[name].shape)}; the folder "
                                  f"mixes files from different models")
    model.load_state_dict(ours, strict=False)
    return model.eval()


def to_hf(model: GPT):
    """A transformers GPT2LMHeadModel with the same weights as ``model``."""
    transformers = _require_transformers()
    from tinylm.checkpoint import unwrap_model

    model = unwrap_model(model)
    c = model.config
    if c.inner_dim != c.n_embd:
        raise ConfigError(f"GPT-2 requires n_head·head_dim == n_embd, but this model has "
                          f"{c.n_head}·{c.head_dim} != {c.n_embd}; it cannot be exported")
    if any(type(m).__name__ == "LowRankLinear" for m in model.modules()):
        raise ConfigError("a compressed (low-rank) model has no GPT-2 equivalent; export the "
                          "model before 'tinylm compress'")
    if structure_of_quantized(model):  # int8 layers: GPT-2 gets their dequantized weights
        model = dequantized(copy.deepcopy(model))
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        model = merge_lora(copy.deepcopy(model))  # LoRA adapters: export the merged weights
    hf_config = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.context_length, n_embd=c.n_embd,
        n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.layer_norm_eps,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=c.tie_embeddings,
        # GPT-2's default <|endoftext|> id 50256 does not exist in smaller vocabularies.
        bos_token_id=50256 if c.vocab_size > 50256 else None,
        eos_token_id=50256 if c.vocab_size > 50256 else None,
    )
    hf = transformers.GPT2LMHeadModel(hf_config)
    ours = model.state_dict()
    hf_state = {}
    for hf_name, our_name, transpose in _expand(c.n_layer):
        if our_name not in ours or ours[our_name] is None:
            # bias=False models: GPT-2 always has biases, zeros are the same function.
            continue
        w = ours[our_name].detach().to("cpu", torch.float32)
        hf_state[hf_name] = w.t().contiguous() if transpose else w.clone()
    hf_sd = hf.state_dict()
    for name, value in hf_sd.items():
        if name in hf_state:
            continue
        if name.endswith(".bias") and not c.bias:
            hf_state[name] = torch.zeros_like(value)
    hf.load_state_dict(hf_state, strict=False)
    if c.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


# --- Hugging Face folders on disk (tinylm convert) ----------------------------------------


def _has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())


def read_hf_folder(folder: str | os.PathLike) -> tuple[GPT, Any]:
    """(model, tokenizer or None) from a Hugging Face GPT-2 folder on disk.

    The weights come from model.safetensors, or pytorch_model.bin loaded with
    ``weights_only=True``; the tokenizer from tokenizer.json or vocab.json + merges.txt
    when the folder has them. Nothing is downloaded.
    """
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"Hugging Face folder {path} does not exist; pass a folder "
                              f"written by save_pretrained (config.json + model.safetensors)")
    model = from_hf(path)
    if not _has_tokenizer_files(path):
        return model, None
    from tinylm.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                              f"model only {model.config.vocab_size} embedding rows; the folder "
                              f"mixes files from different models")
    return model, tokenizer


def write_hf_folder(model: GPT, tokenizer: Any, folder: str | os.PathLike, *,
                    weights_only: bool = False) -> Path:
    """Write ``model`` (and its tokenizer) as a folder that
    ``transformers.GPT2LMHeadModel.from_pretrained`` and ``AutoTokenizer.from_pretrained``
    load: config.json, model.safetensors, and tokenizer.json + tokenizer_config.json
    (plus GPT-2's vocab.json + merges.txt for byte-level BPE).

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
    eos = tokenizer.eos_id if tokenizer is not None else None
    for cfg in (hf_model.config, getattr(hf_model, "generation_config", None)):
        if cfg is not None:  # GPT2Config defaults to id 50256, absent from small vocabularies
            cfg.bos_token_id = cfg.eos_token_id = eos
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
    if tokenizer.chat_template is not None:  # the same ids as tinylm.chat.render_chat
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                  encoding="utf-8")
