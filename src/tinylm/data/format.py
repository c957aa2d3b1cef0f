"""The prepared folder: what :func:`tinylm.data.pipeline.prepare` writes, and reading it.

    tokenizer.json     the tokenizer (one Hugging Face tokenizers JSON, any kind)
    train-00000.bin    the training split in shards of at most ``shard_tokens`` ids
    ...                (raw little-endian uint16 when V <= 65536, else uint32)
    val-00000.bin      the validation split, likewise
    meta.json          counts (tokens, documents, skipped, duplicates), dtype, the shard
                       index, the largest id, the source and sha256 of the inputs

A folder with meta.json is complete (prepare moves it in last). :func:`load_prepared`
opens one with every check (meta.json, shard sizes, the tokenizer, the largest id);
the splits are read memory-mapped as one stream each
(:class:`tinylm.data.shards.TokenShards`). Folders written by older versions (format
1: one ``train.bin`` and ``val.bin``) load too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.core.errors import DataError
from tinylm.data.readers import display_path
from tinylm.data.shards import DTYPES, SHARD_RE, open_split
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import Tokenizer

FORMAT = "tinylm-prepared"
FORMAT_VERSION = 2  # 1: one train.bin + val.bin; 2: shards listed in meta.json
OUTPUT_NAMES = ("tokenizer.json", "meta.json")  # besides the shards
LEGACY_NAMES = ("train.bin", "val.bin")
MAX_META_BYTES = 16 << 20


def is_output(name: str) -> bool:
    """Whether a file of this name is one prepare writes (or an older version wrote)."""
    return name in OUTPUT_NAMES or name in LEGACY_NAMES or bool(SHARD_RE.match(name))


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared folder: each split one 1-D token sequence (a memmap for one shard, a
    :class:`tinylm.data.shards.TokenShards` over several), meta.json and the tokenizer."""

    dir: Path
    train: Any
    val: Any
    meta: dict[str, Any] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])


def _incomplete(path: Path, what: str) -> DataError:
    return DataError(f"prepared data folder {display_path(path)} is incomplete or corrupt "
                     f"({what}); run tinylm prepare --out {display_path(path)} again")


def _count(meta: dict[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _incomplete(path, f"meta.json {key} is {value!r}, not a count")
    return value


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of a prepared folder, checked: a typed one-line error for anything
    unreadable, too large, too deeply nested, foreign, newer, or of another dtype."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise _incomplete(path, "no meta.json")
    try:
        if meta_path.stat().st_size > MAX_META_BYTES:
            raise _incomplete(path, f"meta.json is over {MAX_META_BYTES >> 20} MB")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except RecursionError:
        raise _incomplete(path, "unreadable meta.json: nested too deeply") from None
    except (OSError, ValueError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _incomplete(path, f"unreadable meta.json: {line}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{display_path(meta_path)} is not a tinylm prepared-data meta.json; "
                        f"run tinylm prepare --out {display_path(path)}")
    version = meta.get("version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DataError(f"{display_path(path)} was prepared by a newer tinylm (format "
                        f"version {version!r}); upgrade tinylm or prepare it again")
    if meta.get("dtype") not in DTYPES:
        raise _incomplete(path, f"meta.json says dtype {meta.get('dtype')!r}; prepare writes "
                                f"only {' or '.join(DTYPES)}")
    for key in ("train_tokens", "val_tokens", "vocab_size"):
        _count(meta, key, path)
    return meta


def _shard_index(path: Path, meta: dict[str, Any], split: str) -> list[dict[str, Any]]:
    if meta.get("version", 1) < 2:
        return [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]
    entries = (meta.get("shards") or {}).get(split) if isinstance(meta.get("shards"), dict) \
        else None
    if not isinstance(entries, list):
        raise _incomplete(path, f"meta.json has no shard index for {split}")
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("file"), str)
                and SHARD_RE.match(e["file"]) and e["file"].startswith(split + "-")):
            raise _incomplete(path, f"meta.json lists a bad {split} shard {e!r}")
        _count(e, "tokens", path)
    if sum(e["tokens"] for e in entries) != meta[f"{split}_tokens"]:
        raise _incomplete(path, f"the {split} shards do not add up to {split}_tokens")
    return entries


def load_prepared(path: str | Path) -> PreparedData:
    """Open a folder written by :func:`tinylm.data.pipeline.prepare` (shards memory-mapped
    read-only).

    Checks meta.json, every shard's size, the tokenizer's size, and that no token id
    (the largest is recorded at prepare time) reaches past the tokenizer's vocabulary.
    """
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"prepared data folder {display_path(path)} does not exist; create it "
                        f"with tinylm prepare --out {display_path(path)}")
    meta = read_meta(path)
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for split in ("train", "val"):
        entries = _shard_index(path, meta, split)
        for e in entries:
            shard = path / e["file"]
            if not shard.is_file():
                raise _incomplete(path, f"no {e['file']}")
            size = shard.stat().st_size
            if size != e["tokens"] * dtype.itemsize:
                raise _incomplete(path, f"{e['file']} has {size} bytes, meta.json says "
                                        f"{e['tokens']} {dtype.name} tokens = "
                                        f"{e['tokens'] * dtype.itemsize}")
        splits[split] = open_split(path, entries, dtype)
    if not (path / "tokenizer.json").is_file():
        raise _incomplete(path, "no tokenizer.json")
    tokenizer = load_tokenizer(path / "tokenizer.json")
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise _incomplete(path, f"tokenizer.json has {tokenizer.vocab_size} tokens, "
                                f"meta.json says {meta['vocab_size']}")
    top = meta.get("max_token_id")
    if top is None:  # format 1 did not record it: look
        top = max((int(a.max()) for a in splits.values() if len(a)), default=0)
    if isinstance(top, bool) or not isinstance(top, int) or top >= tokenizer.vocab_size:
        raise DataError(f"{display_path(path)} holds token ids up to {top!r}, outside its "
                        f"tokenizer's vocabulary of {tokenizer.vocab_size}; the shards were "
                        f"made with another tokenizer — run tinylm prepare again")
    return PreparedData(path, splits["train"], splits["val"], meta, tokenizer)



__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PreparedData",
    "dtype_for_vocab",
    "is_output",
    "load_prepared",
    "read_meta",
]
