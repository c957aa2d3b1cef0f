"""A GGUF file as a tinylm checkpoint: its model, its tokenizer with its chat template and
special tokens, written as a checkpoint folder (``tinylm convert --from-gguf``) or kept in
a private cache so that every command taking ``--model`` takes a ``.gguf`` file as well.

The weights come from :mod:`tinylm.io.gguf`, the tokenizer from
:mod:`tinylm.data.gguf_vocab`, and the chat settings (``tokenizer.chat_template``, bos,
eos, end of turn, ``add_bos_token``) become the tokenizer's
:class:`~tinylm.data.templates.TokenizerSettings`, saved as the checkpoint's
``tokenizer_config.json`` as Hugging Face writes it.

The cache: the first command given ``x.gguf`` converts it once into
``$TINYLM_GGUF_CACHE`` (default ``~/.cache/tinylm/gguf``), in a folder named after the
file and keyed by its resolved path, size and modification time; later commands load that
folder (safetensors, memory-mapped) in a fraction of the time. A changed file gets a new
folder; deleting the cache is always safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from tinylm.core.errors import CheckpointError
from tinylm.core.model import GPT
from tinylm.data.gguf_vocab import special_tokens_of_gguf, tokenizer_from_gguf
from tinylm.data.templates import TokenizerSettings
from tinylm.data.tokenizers import Tokenizer
from tinylm.io.checkpoint_files import CONFIG_FILE, check_target, is_complete, save_checkpoint
from tinylm.io.gguf import GGUFModel, gguf_to_tinylm, read_gguf

log = logging.getLogger(__name__)

#: The suffix that makes a ``--model`` path a GGUF file.
SUFFIX = ".gguf"


def is_gguf(path: str | os.PathLike) -> bool:
    """True when ``path`` names a GGUF file (by its suffix; the file is read later)."""
    return str(path).lower().endswith(SUFFIX)


def gguf_settings(gm: GGUFModel) -> TokenizerSettings:
    """The chat template and special-token roles a GGUF file declares."""
    special = special_tokens_of_gguf(gm.fields)
    eot = special.pop("eot_token", None)
    hf = {k: v for k, v in special.items() if v is not None}
    hf["model_max_length"] = gm.config.context_length
    if eot is not None:
        hf["end_of_turn_tokens"] = [eot]
    return TokenizerSettings.from_hf(hf)


def gguf_tokenizer(gm: GGUFModel) -> Tokenizer:
    """The file's tokenizer, carrying its chat template and special-token roles."""
    return tokenizer_from_gguf(gm.fields).with_settings(gguf_settings(gm))


def load_gguf(path: str | os.PathLike, *, keep_quantized: bool = False
              ) -> tuple[GPT, Tokenizer, GGUFModel]:
    """(model, tokenizer, the file as read) of a GGUF file, read once."""
    gm = read_gguf(path)
    tokenizer = gguf_tokenizer(gm)
    model = gguf_to_tinylm(gm, keep_quantized=keep_quantized)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{gm.path}: the tokenizer has {tokenizer.vocab_size} tokens but "
                              f"the model only {model.config.vocab_size} embedding rows")
    return model, tokenizer, gm


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike, *,
                 keep_quantized: bool = False, force: bool = False) -> dict[str, Any]:
    """Write the GGUF file ``path`` as a tinylm checkpoint folder ``out``; returns what
    was written (for the command's report): parameters, architecture, tokenizer, types."""
    check_target(out, force=force)
    model, tokenizer, gm = load_gguf(path, keep_quantized=keep_quantized)
    save_checkpoint(out, model, tokenizer, extra_config={"source": _source(gm)})
    return {"out": str(out), "arch": gm.arch, "parameters": model.num_parameters(),
            "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
            "chat_template": tokenizer.settings.chat_template is not None,
            "types": sorted(set(gm.tensor_types.values())),
            "kept_quantized": keep_quantized}


def _source(gm: GGUFModel) -> dict[str, Any]:
    """config.json's record of where the checkpoint came from."""
    stat = gm.path.stat()
    return {"gguf": gm.path.name, "bytes": stat.st_size,
            "name": gm.fields.get("general.name"), "architecture": gm.arch}


def cache_root() -> Path:
    """Where GGUF files given as ``--model`` are converted (``$TINYLM_GGUF_CACHE``)."""
    root = os.environ.get("TINYLM_GGUF_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tinylm" / "gguf"


def cached_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder of GGUF file ``path``, converted into the cache on first use
    (written as every checkpoint is, complete or not at all: two processes converting at
    once each write a whole folder and the last one stays)."""
    src = Path(path)
    if not src.is_file():
        raise CheckpointError(f"{src} does not exist; pass a GGUF file (llama.cpp's format) "
                              f"or a tinylm checkpoint folder")
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = cache_root() / f"{src.stem[:80]}-{key.hexdigest()[:16]}"
    if is_complete(folder) and (folder / CONFIG_FILE).is_file():
        return folder
    _convert_into_cache(src, folder)
    return folder


def _convert_into_cache(src: Path, folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise CheckpointError(f"cannot create the GGUF cache {folder.parent}: {exc.strerror}; "
                              f"set TINYLM_GGUF_CACHE to a writable folder, or convert once "
                              f"with 'tinylm convert --from-gguf {src} --out DIR'") from exc
    start = time.perf_counter()
    log.warning("note: converting %s once into %s (a tinylm checkpoint; later runs load it "
                "directly)", src.name, folder)
    convert_gguf(src, folder, force=True)
    log.info("converted in %.1f s", time.perf_counter() - start)
