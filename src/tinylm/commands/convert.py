"""``tinylm convert``: a model from elsewhere into a tinylm checkpoint, and back out.

Sources: a GGUF file (llama.cpp's format: :mod:`tinylm.io.gguf_checkpoint`), a Hugging
Face folder on disk, or a Hugging Face Hub name ``ORG/NAME`` (downloaded through
``huggingface_hub``, or taken from its cache offline: :func:`tinylm.io.hf.hub_folder`).
The checkpoint keeps the source's tokenizer and chat settings (its chat template, bos,
eos and end-of-turn tokens). Export: a tinylm checkpoint -> a Hugging Face folder, or
a GGUF file that llama.cpp runs (:mod:`tinylm.io.gguf_out`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.checkpoint import (
    load_checkpoint,
    load_model,
    require_tokenizer_of,
    resolve_checkpoint_dir,
)
from tinylm.io.checkpoint_files import check_target, save_checkpoint
from tinylm.io.describe import all_parameters
from tinylm.io.gguf_checkpoint import convert_gguf, is_gguf
from tinylm.io.gguf_out import check_gguf_target, check_gguf_type, write_gguf
from tinylm.io.hf import export_family, hub_folder, is_hub_name, read_hf_folder, write_hf_folder


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote, for the command's one-line report."""

    source: str
    out: str
    parameters: int
    tokenizer: str  # "file tokenizer with its chat template", "no tokenizer files", ...
    detail: str = ""  # e.g. "llama, F32/Q4_1/Q8_0 dequantized"

    def line(self) -> str:
        extra = f"; {self.detail}" if self.detail else ""
        return (f"converted {self.source} -> {self.out} ({self.parameters:,} parameters, "
                f"{self.tokenizer}{extra})")


def _tokenizer_text(tokenizer) -> str:
    if tokenizer is None:
        return "no tokenizer files"
    template = " and its chat template" if tokenizer.settings.chat_template else ""
    return f"{tokenizer.kind} tokenizer{template}"


def _has_gguf_magic(path: str) -> bool:
    """True for an existing file that begins with GGUF's magic bytes, whatever its name
    (``--from-hf model.bin`` of a GGUF file is converted as ``--from-gguf`` would)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a folder, a Hub name, a missing path: not a GGUF file
        return False


def import_model(source: str | os.PathLike, out: str | os.PathLike, *,
                 keep_quantized: bool = False, force: bool = False) -> Converted:
    """Write ``source`` (a GGUF file, by its .gguf name or its magic bytes; a Hugging Face
    folder; or a Hub ``ORG/NAME``) as the tinylm checkpoint ``out``. ``keep_quantized``
    applies to GGUF files only."""
    text = str(source)
    if is_gguf(text) or _has_gguf_magic(text):
        info = convert_gguf(text, out, keep_quantized=keep_quantized, force=force)
        how = "kept as GGUF blocks where exact" if keep_quantized else "dequantized"
        template = " and its chat template" if info["chat_template"] else ""
        # kept blocks hold their weights as integer buffers: count them too
        count = all_parameters(load_model(out)) if keep_quantized else info["parameters"]
        return Converted(text, str(out), count,
                         f"{info['tokenizer']} tokenizer{template}",
                         f"{info['arch']}, {'/'.join(info['types'])} {how}")
    if keep_quantized:
        raise ConfigError("--keep-quantized applies to GGUF files (--from-gguf) only")
    check_target(out, force=force)
    folder = hub_folder(text) if is_hub_name(text) else Path(text)
    model, tokenizer = read_hf_folder(folder)
    where = text if is_hub_name(text) else str(Path(text).resolve())
    save_checkpoint(out, model, tokenizer, extra_config={"source": {"hf": where}})
    return Converted(text, str(out), model.num_parameters(), _tokenizer_text(tokenizer))


def export_model(model_dir: str | os.PathLike, to_hf: str | os.PathLike, *,
                 weights_only: bool = False) -> str:
    """Write the tinylm checkpoint ``model_dir`` as a Hugging Face folder; the report line."""
    model, tokenizer = load_checkpoint(model_dir)
    write_hf_folder(model, tokenizer, to_hf, weights_only=weights_only)
    what = "weights only" if weights_only else _tokenizer_text(tokenizer)
    family = export_family(model.config).architecture
    return f"exported {model_dir} -> {to_hf} (Hugging Face {family}, {what})"


def export_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, *, type: str = "f32",
                force: bool = False) -> str:
    """Write the tinylm checkpoint ``model_dir`` (with its tokenizer: llama.cpp needs the
    vocabulary) as the GGUF file ``out``; the report line."""
    check_gguf_type(type)  # before loading anything
    check_gguf_target(out, force=force)
    if not Path(model_dir).exists():
        raise CheckpointError(f"--to-gguf {model_dir} does not exist; pass a tinylm checkpoint "
                              f"folder (or a training run folder)")
    folder = resolve_checkpoint_dir(model_dir)
    tokenizer = require_tokenizer_of(folder, "a GGUF file carries the model's vocabulary, so "
                                     "--to-gguf needs a checkpoint with its tokenizer")
    model = load_model(folder)
    name = Path(model_dir).stem if is_gguf(model_dir) else \
        f"{folder.parent.name}-{folder.name}" if folder.name in ("latest", "best") \
        else folder.name
    return write_gguf(model, tokenizer, out, type=type, force=force, name=name).line(
        str(model_dir))
