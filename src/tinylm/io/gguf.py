"""GGUF files in (llama.cpp's format): the llama, qwen2, qwen3 and gpt2 architectures.

A GGUF file is a header of typed key-value metadata and a table of tensors, each of a
GGML type (float32, float16, bfloat16, or one of the block quantizations: Q8_0 is 32
int8 values with one fp16 scale, Q4_0 32 4-bit values w = d·(q − 8), Q4_1 w = d·q + m,
the K-quants super-blocks of 256). The container is read by the format's own library,
``gguf`` (``GGUFReader``, memory-mapped); the tensors are dequantized to float32 by its
``gguf.quants.dequantize``. What this module adds is the meaning:

- the metadata keys of each architecture mapped to a :class:`ModelConfig`
  (:func:`read_gguf`), and every key tinylm cannot honour (rope scaling, sliding windows,
  soft-capping, experts, a rope dimension count other than the head size, an
  architecture or tensor type it does not know) refused by name, never dropped;
- the tensor names mapped to tinylm's state dict (llama.cpp's ``blk.N.attn_q`` ... ->
  ``blocks.N.attn.qkv``, fused as [q | k | v]);
- the llama architecture's query/key row permutation undone: llama.cpp's converter
  reorders each head's rows from Hugging Face's half-split rotary layout (pair i is
  dims i and i + D/2, tinylm's layout too) into the interleaved one (pair i is dims 2i
  and 2i + 1); :func:`unpermute_rows` is the inverse. qwen2, qwen3 and gpt2 are not
  permuted (qwen3 is qwen2 without the QKV biases and with QK-norm: tinylm's ``qk_norm``);
- ``keep_quantized``: Q8_0, Q4_0 and Q4_1 block weights of the blocks' Linear layers
  and of the LM head (``output``, or a tied head's ``token_embd``) kept as
  :class:`~tinylm.layers.blocks.BlockLinear`, the file's bytes as they are (no round
  trip through float32), bit-exact with their dequantized floats.

``transformers`` is not needed here (tests compare against its GGUF loader).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tinylm.core.config import ModelConfig, check_model_fits
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.core.model import GPT
from tinylm.layers import registry
from tinylm.layers.blocks import TYPES as BLOCK_TYPES

#: The architectures (``general.architecture``) tinylm imports.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2")

#: The GGML tensor types tinylm dequantizes (by name, as ``GGMLQuantizationType``).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                "Q6_K")

#: Block types ``keep_quantized`` keeps: (bits, offset subtracted from the stored code,
#: per-group minimum). Each block is 32 weights of one row: an fp16 scale d (and for
#: Q4_1 an fp16 minimum m), then the codes; w = d·(code − offset) (+ m).
KEPT: dict[str, tuple[int, int, bool]] = {"Q8_0": (8, 0, False), "Q4_0": (4, 8, False),
                                           "Q4_1": (4, 0, True)}
GROUP = 32
#: bytes per block of each kept type (tinylm.layers.blocks' table)
GGML_BLOCK_BYTES = {name: size for name, (_, size) in BLOCK_TYPES.items()}

# {arch}.KEY entries each architecture reads (or checks); any other {arch}.* key is refused.
_ROPE_KEYS = {"rope.freq_base", "rope.dimension_count", "rope.scaling.type",
              "rope.scaling.factor"}
_KEYS = {
    "llama": {"context_length", "embedding_length", "block_count", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "attention.key_length",
              "attention.value_length", "attention.layer_norm_rms_epsilon", "vocab_size",
              "tensor_data_layout", "expert_count", "expert_used_count", *_ROPE_KEYS},
    "gpt2": {"context_length", "embedding_length", "block_count", "feed_forward_length",
             "attention.head_count", "attention.head_count_kv",
             "attention.layer_norm_epsilon", "vocab_size"},
}
_KEYS["qwen2"] = _KEYS["qwen3"] = _KEYS["llama"] - {"tensor_data_layout"}

# Keys that name a feature tinylm does not implement: which, for the refusal.
_ROPE_SCALING = "rope scaling (tinylm implements plain RoPE only)"
_FEATURES = {
    "attention.sliding_window": "sliding-window attention (tinylm attends over the whole "
                                "context)",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "rope.scaling.original_context_length": _ROPE_SCALING,
    "rope.scaling.attn_factor": _ROPE_SCALING,
    "rope.scaling.yarn_log_multiplier": _ROPE_SCALING,
}


# ModelConfig field -> the metadata key it comes from (for the messages).
_SOURCES = {"n_layer": "block_count", "n_embd": "embedding_length",
            "n_head": "attention.head_count", "n_kv_head": "attention.head_count_kv",
            "context_length": "context_length", "head_dim": "attention.key_length",
            "ffn_hidden": "feed_forward_length", "rope_theta": "rope.freq_base",
            "norm_eps": "attention.layer_norm_(rms_)epsilon"}


@dataclass(frozen=True, eq=False)
class GGUFModel:
    """A GGUF file, read: its metadata and the tinylm config it describes.

    ``fields``: every metadata key -> a plain value (str, int, float, bool, or a list of
    them; the tokenizer's keys and ``tokenizer.chat_template`` included); ``arch``:
    ``general.architecture``; ``config``: the :class:`ModelConfig` of the model;
    ``tensors``: name -> the reader's tensor (a memory-mapped view of the file);
    ``tensor_types``: name -> GGML type name ("Q4_1").
    """

    path: Path
    fields: dict[str, Any]
    arch: str
    config: ModelConfig
    tensors: dict[str, Any] = field(repr=False)
    tensor_types: dict[str, str] = field(repr=False)


# --- reading the file ----------------------------------------------------------------------


def _plain(f: Any) -> Any:
    """A reader field's value as plain Python (float32 scalars at their shortest repr:
    1e-05, not 9.999999747378752e-06)."""
    from gguf import GGUFValueType

    value = f.contents()
    if f.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def _open(path: Path) -> Any:
    """The ``GGUFReader`` of ``path``; a one-line CheckpointError for anything else."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ConfigError("reading GGUF files needs the 'gguf' package (llama.cpp's own "
                          "reader); install it with: pip install gguf") from exc
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; pass the path of a .gguf file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # bad magic, truncated, unsupported version, empty, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"{path} is not a readable GGUF file ({first}); pass a .gguf "
                              f"file written by llama.cpp (or gguf.GGUFWriter)") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path} is a GGUF file of the other byte order (big-endian); "
                              f"tinylm reads little-endian GGUF files only")
    return reader


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """The metadata, config and tensor table of a GGUF file (nothing dequantized yet).

    A missing, corrupt or non-GGUF file is a one-line :class:`CheckpointError` naming the
    file; an architecture, metadata key or tensor type tinylm cannot honour a one-line
    :class:`ConfigError` naming the key and its value.
    """
    path = Path(path)
    reader = _open(path)
    fields: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own header entries (version, counts)
            continue
        try:
            fields[key] = _plain(f)
        except Exception as exc:  # e.g. an array of arrays, or text that is not UTF-8
            raise CheckpointError(f"{path}: metadata key {key[:80]!r} cannot be read "
                                  f"({type(exc).__name__}); the file is corrupt") from None
    tensors = {t.name: t for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    arch = fields.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path} has no general.architecture key; it is not a model "
                              f"file llama.cpp writes")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path.name}: general.architecture = {arch!r}, which tinylm does "
                          f"not import (it imports {', '.join(ARCHITECTURES)})")
    split = fields.get("split.count", 1)
    if split != 1:
        raise ConfigError(f"{path.name} is one of {split} parts of a split GGUF (split.count "
                          f"= {split}); merge them first (llama-gguf-split --merge)")
    bad = next((n for n, t in types.items() if t not in TENSOR_TYPES), None)
    if bad is not None:
        raise ConfigError(f"{path.name}: tensor {bad} is of type {types[bad]}, which tinylm "
                          f"does not dequantize (it reads {', '.join(TENSOR_TYPES)})")
    config = _config(path, arch, fields, tensors)
    _check_names(path, arch, config, tensors)
    return GGUFModel(path, fields, arch, config, tensors, types)


# --- the config -----------------------------------------------------------------------------


def _refuse_keys(path: Path, arch: str, fields: dict[str, Any]) -> None:
    """Every ``{arch}.*`` key tinylm cannot honour, refused by name with its value."""
    known = _KEYS[arch]
    for key, value in fields.items():
        if not key.startswith(arch + "."):
            continue
        short = key[len(arch) + 1:]
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        why = _FEATURES.get(short)
        if short == "rope.scaling.type" and value != "none":
            why = _ROPE_SCALING
        elif short == "rope.scaling.factor" and value != 1.0 \
                and fields.get(f"{arch}.rope.scaling.type", "linear") != "none":
            why = _ROPE_SCALING
        elif short in ("expert_count", "expert_used_count") and value:
            why = "mixture-of-experts layers"
        if why is not None:
            raise ConfigError(f"{path.name}: {key} = {shown} asks for {why}, which tinylm "
                              f"does not implement; the file is refused (nothing was loaded)")
        if short not in known:
            raise ConfigError(f"{path.name}: {key} = {shown} is a key tinylm does not know (it "
                              f"may change what the model computes); the file is refused "
                              f"(nothing was loaded)")


def _int(path: Path, fields: dict[str, Any], key: str, default: Any = None) -> int:
    value = fields.get(key, default)
    if value is None:
        raise CheckpointError(f"{path.name} lacks the metadata key {key}; the file is "
                              f"incomplete or not a {key.split('.')[0]} model")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path.name}: {key} = {value!r} is not one integer (per-layer "
                          f"values are not supported)")
    return value


def _vocab_size(path: Path, arch: str, fields: dict[str, Any], tensors: dict[str, Any]) -> int:
    """The embedding's rows, checked against ``{arch}.vocab_size`` and the token list."""
    emb = tensors.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise CheckpointError(f"{path.name} has no 2-D token_embd.weight tensor; the file is "
                              f"incomplete")
    rows = int(emb.shape[1])  # GGUF lists dimensions innermost first: (E, V)
    for key, n in ((f"{arch}.vocab_size", fields.get(f"{arch}.vocab_size")),
                   ("tokenizer.ggml.tokens", len(fields.get("tokenizer.ggml.tokens") or [])
                    or None)):
        if n is not None and n > rows:
            raise CheckpointError(f"{path.name}: {key} says {n} tokens but token_embd.weight "
                                  f"has {rows} rows; the file is inconsistent")
    return rows


def _config(path: Path, arch: str, fields: dict[str, Any], tensors: dict[str, Any]
            ) -> ModelConfig:
    """The ModelConfig of the file's metadata (and of which tensors it has)."""
    _refuse_keys(path, arch, fields)
    p = arch + "."
    E = _int(path, fields, p + "embedding_length")
    H = _int(path, fields, p + "attention.head_count")
    H_kv = _int(path, fields, p + "attention.head_count_kv", H)
    common = dict(vocab_size=_vocab_size(path, arch, fields, tensors),
                  context_length=_int(path, fields, p + "context_length"),
                  n_layer=_int(path, fields, p + "block_count"), n_head=H, n_embd=E,
                  n_kv_head=H_kv, dropout=0.0, tie_embeddings="output.weight" not in tensors)
    ffn = _int(path, fields, p + "feed_forward_length")
    try:  # from_dict: sizes past what any real model has are refused before any loop
        if arch == "gpt2":
            eps = fields.get(p + "attention.layer_norm_epsilon", 1e-5)
            return ModelConfig.from_dict(dict(**common, bias=True, norm_eps=float(eps),
                                              ffn_hidden=None if ffn == 4 * E else ffn))
        if E % H and p + "attention.key_length" not in fields:
            raise ConfigError(f"{path.name}: {p}attention.head_count = {H} does not divide "
                              f"{p}embedding_length = {E}, and no {p}attention.key_length "
                              f"gives the head size; the metadata is inconsistent")
        D = _int(path, fields, p + "attention.key_length", E // H)
        D_v = _int(path, fields, p + "attention.value_length", D)
        rope = _int(path, fields, p + "rope.dimension_count", D)
        if D_v != D or rope != D:
            what = (f"{p}attention.value_length = {D_v}" if D_v != D
                    else f"{p}rope.dimension_count = {rope}")
            raise ConfigError(f"{path.name}: {what} differs from the head size {D}; tinylm "
                              f"rotates (and attends with) whole heads only")
        return ModelConfig.from_dict(dict(
            **common, head_dim=D, bias=False, qkv_bias=arch == "qwen2", norm="rmsnorm",
            qk_norm=arch == "qwen3",
            norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            position="rope", rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
            mlp="swiglu", ffn_hidden=ffn))
    except ConfigError as exc:
        if str(exc).startswith(path.name):
            raise
        what = str(exc).split(";")[0]
        keys = [f"{f} is {arch}.{k}" for f, k in _SOURCES.items() if f in what.split()[0]]
        raise ConfigError(f"{path.name}: its metadata describes a model tinylm cannot build: "
                          f"{what}" + (f" ({keys[0]})" if keys else "")) from None


# --- tensor names ---------------------------------------------------------------------------


def _rows(arch: str, config: ModelConfig) -> list[tuple[str, str, str]]:
    """(GGUF name, tinylm name, part) for every tensor the model has: part "q"/"k"/"v" is
    the slice of the fused ``attn.qkv``, "" the whole tensor."""
    rows = [("token_embd.weight", "tok_emb.weight", ""),
            ("output_norm.weight", "final_norm.weight", "")]
    if not config.tie_embeddings:
        rows.append(("output.weight", "lm_head.weight", ""))
    gpt2 = arch == "gpt2"
    if gpt2:
        rows += [("position_embd.weight", "pos_emb.weight", ""),
                 ("output_norm.bias", "final_norm.bias", "")]
    for i in range(config.n_layer):
        b, o = f"blk.{i}.", f"blocks.{i}."
        pairs = [("attn_norm", "ln1"), ("attn_output", "attn.out"), ("ffn_norm", "ln2"),
                 ("ffn_up", "ffn.up"), ("ffn_down", "ffn.down")]
        if gpt2:
            pairs.append(("attn_qkv", "attn.qkv"))
            rows += [(f"{b}{g}.{w}", f"{o}{t}.{w}", "") for g, t in pairs
                     for w in ("weight", "bias")]
            continue
        pairs.append(("ffn_gate", "ffn.gate"))
        rows += [(f"{b}{g}.weight", f"{o}{t}.weight", "") for g, t in pairs]
        if config.qk_norm:  # qwen3: RMSNorm over each head's query and key
            rows += [(f"{b}attn_{p}_norm.weight", f"{o}attn.{p}_norm.weight", "") for p in "qk"]
        kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
        rows += [(f"{b}attn_{part}.{w}", f"{o}attn.qkv.{w}", part) for part in "qkv"
                 for w in kinds]
    return rows


def _check_names(path: Path, arch: str, config: ModelConfig, tensors: dict[str, Any]) -> None:
    """Every tensor the model needs is there, and no tensor is left unread."""
    wanted = {g for g, _, _ in _rows(arch, config)}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise CheckpointError(f"{path.name} lacks tensor {missing[0]} (and {len(missing) - 1} "
                              f"more) that its {arch} metadata implies; the file is incomplete")
    extra = sorted(set(tensors) - wanted)
    if extra:
        hint = {"rope_freqs.weight": " (rope scaling factors: tinylm implements plain RoPE "
                                     "only)"}.get(extra[0], "")
        if arch == "llama" and extra[0].endswith(".bias"):
            hint = " (a llama with biases, which tinylm does not import from GGUF)"
        raise ConfigError(f"{path.name} holds tensor {extra[0]}{hint} (and {len(extra) - 1} "
                          f"more) that tinylm's {arch} has no place for; tinylm would drop "
                          f"them, so it refuses the file")


def unpermute_rows(n_rows: int, n_head: int) -> Tensor:
    """Row indices that undo llama.cpp's query/key permutation of a (n_head·D, ...) weight:
    ``W_hf = W_gguf[unpermute_rows(n_head·D, n_head)]``.

    llama.cpp's converter reshapes each head's D rows as (2, D/2), swaps to (D/2, 2) and
    flattens, so Hugging Face row h·D + s·D/2 + j (half s, pair j) becomes GGUF row
    h·D + 2j + s. The inverse reads, for each Hugging Face row, that GGUF row."""
    D = n_rows // n_head
    return torch.arange(n_rows).view(n_head, D // 2, 2).transpose(1, 2).reshape(-1)


# --- tensors --------------------------------------------------------------------------------


def _dequantized(t: Any) -> Tensor:
    """A reader tensor as float32, in numpy's (outer, ..., inner) order: (O, I) for a
    Linear weight, as ``nn.Linear`` stores it."""
    from gguf.quants import dequantize

    arr = dequantize(t.data, t.tensor_type)
    if not arr.flags.writeable:  # a float32 tensor: a read-only view of the mapped file
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def block_codes(t: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """(codes int8 (O, I), scales float32 (O, I/32), minimums float32 or None) of a 2-D
    Q8_0, Q4_0 or Q4_1 tensor, with w = code·scale (+ minimum) exactly the float32 weight
    ``gguf.quants.dequantize`` computes (tests/test_gguf.py proves it bit for bit).

    A block is an fp16 scale d (Q4_1: then an fp16 minimum m) and 32 codes: Q8_0 int8;
    Q4_0/Q4_1 sixteen bytes whose low nibbles are codes 0..15 and high nibbles 16..31;
    Q4_0 stores code + 8."""
    from gguf.constants import GGML_QUANT_SIZES

    bits, offset, has_min = KEPT[t.tensor_type.name]
    _, type_size = GGML_QUANT_SIZES[t.tensor_type]
    blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, type_size)  # (O, n, bytes)
    O, n, _ = blocks.shape

    def half(at: int) -> Tensor:  # the fp16 at byte ``at`` of every block, as float32
        return torch.from_numpy(blocks[:, :, at:at + 2].copy().view(np.float16)
                                .astype(np.float32).reshape(O, n))

    raw = blocks[:, :, 4 if has_min else 2:]
    if bits == 8:
        codes = raw.copy().view(np.int8)
    else:
        codes = np.concatenate([raw & 0x0F, raw >> 4], axis=2).astype(np.int8) - np.int8(offset)
    q = torch.from_numpy(np.ascontiguousarray(codes.reshape(O, n * GROUP)))
    return q, half(0), half(2) if has_min else None


def block_bytes(t: Any) -> tuple[Tensor]:
    """The bytes of a 2-D Q8_0, Q4_0 or Q4_1 tensor as stored, (O, blocks per row · block
    bytes) uint8: a :class:`~tinylm.layers.blocks.BlockLinear`'s buffer as it is."""
    return (torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(t.data.shape[0], -1)),)


def _kept_scheme(parts: list[Any]) -> str | None:
    """The GGUF type when every GGUF tensor of one tinylm Linear is of one kept type
    (the fused qkv reads three), else None: the layer is dequantized."""
    kinds = {p.tensor_type.name for p in parts}
    if len(kinds) != 1 or next(iter(kinds)) not in KEPT or len(parts[0].shape) != 2:
        return None
    return kinds.pop()


def _permutation(arch: str, config: ModelConfig, part: str) -> Tensor | None:
    """The row order that undoes llama.cpp's q/k permutation (llama only)."""
    if arch != "llama" or part not in ("q", "k"):
        return None
    heads = config.n_head if part == "q" else config.n_kv_head
    return unpermute_rows(heads * config.head_dim, heads)


def _check_shape(model: GGUFModel, name: str, got: tuple[int, ...], want: tuple[int, ...]
                 ) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{model.path.name}: tensor {name} has shape {tuple(got)} but its "
                              f"metadata implies {tuple(want)}; the file is inconsistent")


def _groups(rows: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    """tinylm name -> [(GGUF name, part)]: the three parts of a fused qkv together."""
    out: dict[str, list[tuple[str, str]]] = {}
    for gguf_name, ours, part in rows:
        out.setdefault(ours, []).append((gguf_name, part))
    return out


def _fused(model: GGUFModel, parts: list[tuple[str, str]], read: Any) -> list[Tensor]:
    """``read(tensor)`` of each GGUF part (a tuple of row-aligned tensors, or None), rows
    unpermuted, concatenated along the rows in order q | k | v."""
    c = model.config
    rows = {"q": c.inner_dim, "k": c.kv_dim, "v": c.kv_dim}
    pieces = []
    for g, part in parts:
        values = read(model.tensors[g])
        if part and values[0].shape[0] != rows[part]:
            _check_shape(model, g, tuple(values[0].shape),
                         (rows[part], *values[0].shape[1:]))
        order = _permutation(model.arch, c, part)
        pieces.append([v if v is None or order is None else v[order] for v in values])
    return [None if col[0] is None else torch.cat(col, 0) if len(col) > 1 else col[0]
            for col in zip(*pieces, strict=True)]


def _empty(config: ModelConfig) -> GPT:
    """``GPT(config)`` with no storage (meta tensors): every tensor comes from the file."""
    with torch.device("meta"):
        return GPT(config)


def _convert(model: GGUFModel, keep_quantized: bool, empty: GPT
             ) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
    """(tinylm state dict, config.json's "quantize" section for the kept layers), shaped
    as the tensors of ``empty``."""
    shapes = {k: tuple(v.shape) for k, v in empty.state_dict().items()}
    state: dict[str, Tensor] = {}
    kept: dict[str, dict[str, Any]] = {}
    for ours, parts in _groups(_rows(model.arch, model.config)).items():
        scheme = None
        if keep_quantized and (ours.startswith("blocks.") or ours == "lm_head.weight") \
                and ours.endswith(".weight"):
            scheme = _kept_scheme([model.tensors[g] for g, _ in parts])
        if scheme is None:
            (w,) = _fused(model, parts, lambda t: (_dequantized(t),))
            _check_shape(model, parts[0][0], tuple(w.shape), shapes[ours])
            state[ours] = w
            continue
        (raw,) = _fused(model, parts, block_bytes)
        O, I = shapes[ours]
        _check_shape(model, parts[0][0], tuple(raw.shape),
                     (O, -(-I // GROUP) * GGML_BLOCK_BYTES[scheme]))
        layer = ours[:-len(".weight")]
        state[f"{layer}.blocks"] = raw
        kept[layer] = {"type": scheme}
    if keep_quantized and model.config.tie_embeddings:
        _tied_head_blocks(model, state, kept)
    return state, kept


def _tied_head_blocks(model: GGUFModel, state: dict[str, Tensor],
                      kept: dict[str, dict[str, Any]]) -> None:
    """A tied LM head read as the file stores it: when ``token_embd`` is of a kept type
    (SmolLM2's is Q8_0), the head becomes a BlockLinear of those bytes (the decoding step
    reads 1.06 bytes per weight instead of float32's 4, as llama.cpp does); the token
    embedding stays the dequantized float table (a lookup reads one row). Both are the
    same numbers: the head's dequantized weight equals the embedding bit for bit."""
    t = model.tensors["token_embd.weight"]
    scheme = _kept_scheme([t])
    if scheme is None:
        return
    (raw,) = block_bytes(t)
    c = model.config
    _check_shape(model, "token_embd.weight", tuple(raw.shape),
                 (c.vocab_size, -(-c.n_embd // GROUP) * GGML_BLOCK_BYTES[scheme]))
    state["lm_head.blocks"] = raw
    kept["lm_head"] = {"type": scheme}


def gguf_state_dict(model: GGUFModel, *, keep_quantized: bool = False) -> dict[str, Tensor]:
    """tinylm's state dict of a read GGUF file: every tensor dequantized to float32 (the
    llama q/k rows unpermuted, q | k | v fused), or with ``keep_quantized`` the blocks'
    Q8_0/Q4_0/Q4_1 Linear weights as ``<layer>.blocks``, their bytes as stored."""
    return _convert(model, keep_quantized, _empty(model.config))[0]


def gguf_to_tinylm(source: str | os.PathLike | GGUFModel, *,
                   keep_quantized: bool = False) -> GPT:
    """A tinylm :class:`GPT` (in eval mode) computing the GGUF file's model.

    ``source`` is a path or what :func:`read_gguf` returned (read it first to keep its
    ``fields``: tokenizer, chat template). With ``keep_quantized`` the blocks' Linear
    layers and the LM head (a tied one too: :func:`_tied_head_blocks`) stored as Q8_0,
    Q4_0 or Q4_1 become :class:`~tinylm.layers.blocks.BlockLinear` holding the file's
    bytes (config.json's "gguf_blocks" section describes them when saved); everything
    else is dequantized to float32.
    """
    gm = source if isinstance(source, GGUFModel) else read_gguf(source)
    try:  # estimated before allocating, as for a tinylm config.json
        check_model_fits(gm.config, "cpu")
    except ConfigError as exc:
        raise CheckpointError(f"{gm.path.name} describes a model too large to load: {exc}") \
            from None
    model = _empty(gm.config)
    state, kept = _convert(gm, keep_quantized, model)
    registry.apply_structure(model, {"gguf_blocks": kept} if kept else {})
    result = model.load_state_dict(state, strict=False, assign=True)
    if gm.config.tie_embeddings and "lm_head" not in kept:
        model.lm_head.weight = model.tok_emb.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left and not result.unexpected_keys, (left, result.unexpected_keys)
    return model.eval()
