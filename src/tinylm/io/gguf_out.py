"""GGUF files out: a tinylm model and its tokenizer as a file llama.cpp runs
(``tinylm convert --to-gguf DIR --out FILE.gguf --type f32|f16|q8_0|q4_0``).

The inverse of :mod:`tinylm.io.gguf`, written with the format's own library (``gguf``:
``GGUFWriter``, and ``gguf.quants.quantize`` for the block types):

- the architecture (:func:`gguf_architecture`): GPT-2's layout (LayerNorm, learned
  positions, GELU) is ``gpt2`` (a bias the model does not have is written as zeros,
  which computes the same); Llama's (RMSNorm, RoPE, SwiGLU, grouped-query attention)
  is ``llama``, with Qwen2's QKV biases ``qwen2``, with QK-norm ``qwen3`` (RMSNorm over
  each head's query and key before RoPE, as tinylm's ``qk_norm``). What llama.cpp has no
  architecture for (squared ReLU, QK-norm with QKV biases, biases on every Linear of a
  Llama, mixed layouts) is refused naming the fields;
- the tensors under llama.cpp's names (:func:`tinylm.io.gguf._rows`, the importer's own
  table), the fused ``attn.qkv`` cut into ``attn_q``/``attn_k``/``attn_v`` (``gpt2`` keeps
  it fused), llama's query/key rows permuted into llama.cpp's interleaved rotary order
  (the inverse of :func:`~tinylm.io.gguf.unpermute_rows`); a tied head is written once,
  as ``token_embd`` (llama.cpp then uses it as the output);
- the types: 1-D tensors (norms, biases) and GPT-2's position table stay float32, as
  llama.cpp's converter keeps them; every other matrix is of ``--type``, except that at
  q4_0 the token embedding and the output stay Q8_0 (as llama-quantize keeps the output
  at a higher type); a matrix whose rows are not a multiple of 32 values cannot be cut
  into Q8_0/Q4_0 blocks and is written float16 (the report says so);
- the metadata of :mod:`tinylm.io.gguf` (sizes, norm epsilon, RoPE base, ...) and the
  tokenizer's (:mod:`tinylm.data.gguf_vocab_out`: vocabulary, special tokens, chat
  template).

Replaced layers are made dense first (int8 layers dequantized, LoRA adapters merged);
a low-rank model is refused, as for ``--to-hf``. The file is written under a temporary
name and renamed when complete.
"""

from __future__ import annotations

import copy
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinylm.core.config import ModelConfig
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.core.model import GPT
from tinylm.data.gguf_vocab_out import gguf_vocab_fields
from tinylm.data.tokenizers import Tokenizer
from tinylm.io.files import atomic_write_with
from tinylm.io.gguf import _rows, unpermute_rows
from tinylm.layers import registry

#: ``--type`` values: the GGML type of the matrices.
TYPES = ("f32", "f16", "q8_0", "q4_0")
#: Architectures written (``general.architecture``).
ARCHITECTURES = ("gpt2", "llama", "qwen2", "qwen3")
_BLOCK = 32  # values per Q8_0/Q4_0 block
#: The token embedding and the output (one matrix when tied): Q8_0 at q4_0, as llama.cpp's
#: own llama-quantize keeps the output at a higher type than the blocks' matrices (its
#: Q6_K, which the gguf package cannot write): 4 bits there cost most of the accuracy.
_OUTPUT_NAMES = ("token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Written:
    """What :func:`write_gguf` wrote, for the command's report."""

    path: Path
    arch: str
    type: str
    types: dict[str, int]  # GGML type name -> tensors of it
    fallback: tuple[str, ...]  # matrices written F16 (rows not a multiple of 32)
    tokenizer: str  # "bpe tokenizer (gpt-2 pre-tokenizer) and its chat template"
    bytes: int

    def line(self, source: str) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
        extra = (f"; {len(self.fallback)} matrices F16 (rows not a multiple of 32, e.g. "
                 f"{self.fallback[0]})" if self.fallback else "")
        return (f"converted {source} -> {self.path} (GGUF {self.arch}, --type {self.type}: "
                f"{kinds} tensors{extra}; {self.tokenizer}; {self.bytes / 1e6:.1f} MB)")


# --- the architecture ----------------------------------------------------------------------


def gguf_architecture(config: ModelConfig) -> str:
    """The llama.cpp architecture that computes ``config``'s model, or a one-line
    ConfigError naming the fields none computes."""
    c = config
    if (c.norm, c.position, c.mlp) == ("layernorm", "learned", "gelu") and not c.qk_norm:
        if c.n_kv_head != c.n_head or c.inner_dim != c.n_embd:
            raise ConfigError(f"llama.cpp's gpt2 needs n_kv_head == n_head and n_head·head_dim "
                              f"== n_embd, but this model has n_kv_head={c.n_kv_head}, "
                              f"{c.n_head}·{c.head_dim} vs n_embd={c.n_embd}; it has no GGUF "
                              f"form (nothing was written)")
        return "gpt2"
    if c.mlp == "relu2":
        raise ConfigError("mlp='relu2' (squared ReLU) is computed by no llama.cpp "
                          "architecture tinylm writes (gpt2: GELU, llama/qwen2/qwen3: "
                          "SwiGLU); this model has no GGUF form (nothing was written)")
    if (c.norm, c.position, c.mlp) != ("rmsnorm", "rope", "swiglu"):
        raise ConfigError(f"no llama.cpp architecture has norm={c.norm!r}, position="
                          f"{c.position!r}, mlp={c.mlp!r}: gpt2 is "
                          f"layernorm/learned/gelu, llama/qwen2/qwen3 are rmsnorm/rope/swiglu; "
                          f"this model has no GGUF form (nothing was written)")
    if c.bias:
        raise ConfigError("bias=True (biases on every Linear layer) with rmsnorm/rope/swiglu "
                          "has no llama.cpp architecture tinylm writes (qwen2 has QKV biases "
                          "only: qkv_bias=True, bias=False); nothing was written")
    if c.qk_norm:
        if c.qkv_bias:
            raise ConfigError("qk_norm=True with qkv_bias=True has no llama.cpp architecture "
                              "(qwen3 has QK-norm without QKV biases, qwen2 the biases "
                              "without QK-norm); nothing was written")
        return "qwen3"
    if c.qkv_bias and c.inner_dim != c.n_embd:
        raise ConfigError(f"llama.cpp's qwen2 needs n_head·head_dim == n_embd, but this model "
                          f"has {c.n_head}·{c.head_dim} != {c.n_embd}; it has no GGUF form "
                          f"(nothing was written)")
    return "qwen2" if c.qkv_bias else "llama"


def _hparams(arch: str, c: ModelConfig) -> dict[str, Any]:
    """``{arch}.*`` metadata (without the prefix), as :func:`tinylm.io.gguf.read_gguf`
    reads it back."""
    common = {"context_length": c.context_length, "embedding_length": c.n_embd,
              "block_count": c.n_layer, "feed_forward_length": c.ffn_dim,
              "attention.head_count": c.n_head, "attention.head_count_kv": c.n_kv_head}
    if arch == "gpt2":
        return {**common, "attention.layer_norm_epsilon": float(c.norm_eps)}
    return {**common, "vocab_size": c.vocab_size,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "attention.layer_norm_rms_epsilon": float(c.norm_eps),
            "rope.freq_base": float(c.rope_theta), "rope.dimension_count": c.head_dim}


# --- the tensors ---------------------------------------------------------------------------


def _dense(model: GPT) -> GPT:
    """``model`` with its replaced layers made plain (a copy), or a ConfigError for a
    kind that has no dense form (low-rank)."""
    present = [kind for kind in registry.KINDS if kind.present_in(model)]
    for kind in present:
        if kind.export_refusal is not None:
            raise ConfigError(kind.export_refusal.format(architecture="GGUF"))
    return registry.densified(copy.deepcopy(model), present) if present else model


def _permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row indices that apply llama.cpp's query/key permutation: ``W_gguf = W[perm]``
    (the inverse of :func:`~tinylm.io.gguf.unpermute_rows`)."""
    return torch.argsort(unpermute_rows(n_rows, n_head))


def _part(arch: str, c: ModelConfig, qkv: torch.Tensor, part: str) -> torch.Tensor:
    """Rows ``part`` ("q", "k", "v") of a fused qkv weight or bias, llama's q/k permuted."""
    start = {"q": 0, "k": c.inner_dim, "v": c.inner_dim + c.kv_dim}[part]
    rows = qkv[start:start + (c.inner_dim if part == "q" else c.kv_dim)]
    if arch == "llama" and part in ("q", "k"):
        heads = c.n_head if part == "q" else c.n_kv_head
        rows = rows[_permute_rows(rows.shape[0], heads)]
    return rows


def gguf_arrays(model: GPT, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in torch's (out, in) order) of every tensor of the file,
    in llama.cpp's order; a bias the model lacks (gpt2) is zeros."""
    c = model.config
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    out = []
    for name, ours, part in _rows(arch, c):
        tensor = state.get(ours)
        if tensor is None and ours.endswith(".bias"):  # gpt2 without that bias
            weight = state[ours[:-len(".bias")] + ".weight"]
            tensor = torch.zeros(weight.shape[0])
        if tensor is None:
            raise CheckpointError(f"the model has no {ours}, which GGUF's {arch} needs as "
                                  f"{name}; the checkpoint is inconsistent")
        if part:
            tensor = _part(arch, c, tensor, part)
        out.append((name, np.ascontiguousarray(tensor.numpy())))
    return out


def _ggml_type(name: str, array: np.ndarray, type_: str) -> Any:
    from gguf import GGMLQuantizationType as Q

    if array.ndim == 1 or type_ == "f32" or name == "position_embd.weight":
        return Q.F32
    if type_ == "f16" or array.shape[-1] % _BLOCK:
        return Q.F16
    if name in _OUTPUT_NAMES:  # the vocabulary's rows: 8 bits even at q4_0
        return Q.Q8_0
    return {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[type_]


# --- the file ------------------------------------------------------------------------------


def _add_field(writer: Any, key: str, value: Any) -> None:
    """One metadata key of a plain value (see :mod:`tinylm.data.gguf_vocab_out`)."""
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # a list of strings, ints (int32) or floats (float32), as the lists it names
        kinds = {str: V.STRING, int: V.INT32, float: V.FLOAT32}
        writer.add_key_value(key, list(value), V.ARRAY,
                             kinds[type(value[0])] if value else V.INT32)


def _file_type(type_: str) -> int:
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "q8_0": F.MOSTLY_Q8_0,
            "q4_0": F.MOSTLY_Q4_0}[type_]


def _writer_contents(model: GPT, tokenizer: Tokenizer, arch: str, type_: str, name: str
                     ) -> tuple[dict[str, Any], list[tuple[str, np.ndarray, Any]]]:
    """(metadata, [(tensor name, data, GGML type)]) of the file."""
    from gguf import GGML_QUANT_VERSION
    from gguf.quants import quantize

    fields: dict[str, Any] = {"general.name": name, "general.file_type": _file_type(type_)}
    if type_ in ("q8_0", "q4_0"):
        fields["general.quantization_version"] = GGML_QUANT_VERSION
    fields.update({f"{arch}.{k}": v for k, v in _hparams(arch, model.config).items()})
    fields.update(gguf_vocab_fields(tokenizer, model.config.vocab_size))
    tensors = []
    for tname, array in gguf_arrays(model, arch):
        qtype = _ggml_type(tname, array, type_)
        tensors.append((tname, quantize(array, qtype), qtype))
    return fields, tensors


def _tokenizer_text(tokenizer: Tokenizer, fields: dict[str, Any]) -> str:
    pre = fields.get("tokenizer.ggml.pre")
    how = f"{pre} pre-tokenizer" if pre else "as SentencePiece pieces, never merged"
    template = " and its chat template" if "tokenizer.chat_template" in fields else ""
    return f"{tokenizer.kind} tokenizer ({how}){template}"


def check_gguf_type(type_: str) -> str:
    """``type_`` if it is one of :data:`TYPES`, else a one-line ConfigError."""
    if type_ not in TYPES:
        raise ConfigError(f"--type {type_!r} is not a GGUF type tinylm writes; choose one of "
                          f"{', '.join(TYPES)}")
    return type_


def check_gguf_target(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Refuse an ``--out`` that is not a new ``.gguf`` file name (or, with ``force``, an
    existing GGUF file): nothing of the user's is overwritten."""
    out = Path(path)
    if out.suffix.lower() != ".gguf":
        raise ConfigError(f"--out {out}: a GGUF file's name ends in .gguf; e.g. --out "
                          f"{out.with_suffix('.gguf').name}")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; pass a new file name ending in .gguf")
    if out.exists():
        if not force:
            raise ConfigError(f"--out {out} already exists; pass --force to replace it, or "
                              f"choose a new name (nothing was written)")
        with open(out, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError(f"--out {out} exists and is not a GGUF file; tinylm "
                                  f"replaces only GGUF files, even with --force")
    return out


def write_gguf(model: GPT, tokenizer: Tokenizer, path: str | os.PathLike, *,
               type: str = "f32", force: bool = False, name: str = "tinylm") -> Written:
    """Write ``model`` and ``tokenizer`` as the GGUF file ``path`` (see the module
    docstring); ``type`` is one of :data:`TYPES`. Everything is checked before a byte is
    written, and the file appears only when complete."""
    check_gguf_type(type)
    try:
        from gguf import GGUFWriter
    except ImportError as exc:
        raise ConfigError("writing GGUF files needs the 'gguf' package (llama.cpp's own "
                          "writer); install it with: pip install gguf") from exc
    out = check_gguf_target(path, force=force)
    arch = gguf_architecture(model.config)
    model = _dense(model)
    fields, tensors = _writer_contents(model, tokenizer, arch, type, name)

    def write(tmp: str) -> None:
        writer = GGUFWriter(tmp, arch)
        for key, value in fields.items():
            _add_field(writer, key, value)
        for tname, data, qtype in tensors:
            writer.add_tensor(tname, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    gguf_log = logging.getLogger("gguf")  # its writer logs each file at INFO
    level = gguf_log.level
    gguf_log.setLevel(logging.WARNING)
    try:
        atomic_write_with(out, write)
    finally:
        gguf_log.setLevel(level)
    counts = Counter(q.name for _, _, q in tensors)
    fallback = tuple(n for n, a, q in tensors
                     if type in ("q8_0", "q4_0") and q.name == "F16")
    return Written(out, arch, type, dict(counts), fallback,
                   _tokenizer_text(tokenizer, fields), out.stat().st_size)


__all__ = ["ARCHITECTURES", "TYPES", "Written", "check_gguf_target", "check_gguf_type",
           "gguf_architecture",
           "gguf_arrays", "write_gguf"]
