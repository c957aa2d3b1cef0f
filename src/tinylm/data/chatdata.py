"""Fine-tuning data: conversation records -> packed token shards plus a loss mask.

``tinylm prepare --chat FILE.jsonl|DIR|python-qa --tokenizer MODEL --out DIR`` (``python-qa``:
the built-in instruction set of :mod:`tinylm.data.instructions`) writes a folder
that is also an ordinary prepared folder (tokenizer.json, train.bin, val.bin,
meta.json, so ``train``/``eval`` read it) plus ``train.mask`` and ``val.mask``: one
uint8 per token, 1 where the token is a target the loss counts (an assistant's
content and its ``<|end|>``, or its end-of-turn token in the model's own chat template),
0 elsewhere (:func:`tinylm.data.chat.render_with_mask`). A tokenizer with its own chat
template keeps it: the folder also holds its ``tokenizer_config.json``.

Conversations are packed into rows of C + 1 tokens (C the context length) in order, a
conversation never split across rows; the rest of a row is end-of-text padding with
mask 0. The validation split is whole conversations (a seeded shuffle picks them).
A bad record (invalid JSON, a wrong role or type, empty content, no assistant turn,
characters a char tokenizer lacks, longer than C + 1 tokens) is refused naming its
file and line, or skipped and counted with ``skip_bad``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.core.checks import check_int
from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data import instructions
from tinylm.data.chat import BadRecord, read_records, render_with_mask
from tinylm.data.format import FORMAT, PreparedData, dtype_for_vocab, load_prepared
from tinylm.data.options import MAX_RECORD_BYTES
from tinylm.data.templates import TOKENIZER_CONFIG_FILE, write_settings
from tinylm.data.tokenizer_files import checkpoint_tokenizer_file, load_tokenizer
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer, CharTokenizer, Tokenizer

log = logging.getLogger(__name__)

#: a conversation of more characters is refused before it is tokenized when it cannot fit
#: its row (:func:`_too_long`); shorter ones are tokenized and their tokens counted
PRECHECK_CHARS = 1 << 16
CHAT_FILES = ("tokenizer.json", "train.bin", "val.bin", "train.mask", "val.mask", "meta.json",
              TOKENIZER_CONFIG_FILE)


@dataclass(frozen=True, eq=False)
class ChatData:
    """A prepared chat folder: what :func:`tinylm.training.loop.train` reads, with masks."""

    dir: Path
    train: np.ndarray
    val: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    meta: dict[str, Any] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)

    @property
    def row_length(self) -> int:
        """C + 1: every conversation lies inside one aligned row of this many tokens."""
        return int(self.meta["chat"]["row_length"])


def chat_tokenizer(spec: str | Path | Tokenizer, texts: Sequence[str]) -> Tokenizer:
    """The tokenizer for chat data: ``spec`` is a Tokenizer, "char"/"bpe" (built from
    ``texts``), a tokenizer file/folder, or a checkpoint/run folder (its tokenizer).
    Chat tokens it lacks are appended as new ids (the model grows to match), unless it
    has its own chat template (a Hugging Face or GGUF model's), which is used as it is."""
    if isinstance(spec, Tokenizer):
        tok = spec
    elif str(spec) == "char":
        tok = CharTokenizer("".join(texts), special_tokens=STANDARD_SPECIALS)
    elif str(spec) == "bpe":
        tok = BPETokenizer.train(texts, vocab_size=4096, special_tokens=STANDARD_SPECIALS)
    else:
        path = Path(spec)
        found = None
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            file = checkpoint_tokenizer_file(path)  # a checkpoint or run folder's
            try:
                found = load_tokenizer(file) if file is not None else None
            except Exception:  # unreadable: refused below, as a tokenizer folder
                found = None
        tok = found if found is not None else load_tokenizer(path)
    if tok.own_template is not None:
        return tok
    return tok.with_special_tokens(STANDARD_SPECIALS)


def _collect(inputs: Sequence[str | Path], skip_bad: bool, max_record_bytes: int
             ) -> tuple[list[tuple[str, int, list[dict[str, str]]]], list[BadRecord]]:
    good, bad = [], []
    files = [p for p in inputs if not _is_builtin(p)]
    for p in inputs:
        if _is_builtin(p):
            good += [(f"<built-in {instructions.NAME}>", i + 1, messages)
                     for i, messages in enumerate(instructions.conversations())]
    for file, line, item in read_records(files, max_record_bytes):
        if isinstance(item, BadRecord):
            if not skip_bad:
                raise DataError(f"{item}; fix the record or pass --skip-bad to skip bad ones")
            bad.append(item)
        else:
            good.append((file, line, item))
    return good, bad


def _is_builtin(path: str | Path) -> bool:
    return str(path) == instructions.NAME and not Path(path).exists()


def longest_token(tok: Tokenizer) -> int:
    """The most characters one token of ``tok`` stands for (at least 1): a text of n
    characters is at least n / this many tokens. A char tokenizer's tokens are one
    character each (a message's special-token spellings are encoded as text); for a
    vocabulary of strings, the longest string (a byte-level token's characters are its
    bytes, at least as many as the characters of the text it spells)."""
    if isinstance(tok, CharTokenizer):
        return 1
    hf = getattr(tok, "hf", None)
    vocab = hf.get_vocab() if hf is not None else {}
    return max(map(len, vocab), default=1) or 1


def _too_long(messages: list[dict[str, str]], row: int, per_token: int) -> str | None:
    """Why a conversation cannot fit ``row`` tokens, told by its characters alone (before
    it is tokenized: tokenizing takes memory and time in proportion to the text), or None
    when only its tokens can tell (then the error gives the tokens). The bound leaves
    room for a tokenizer's normalizer, 4 times the characters its longest token stands
    for, and is at least PRECHECK_CHARS, which tokenize in no time."""
    chars = sum(len(m["content"]) for m in messages)
    if chars <= max(4 * per_token * row, PRECHECK_CHARS):
        return None
    return (f"conversation has {chars:,} characters, far more than context length + 1 = "
            f"{row:,} tokens can hold (use a larger --context-length)")


def _render_all(tok: Tokenizer, records: list, row: int, skip_bad: bool,
                bad: list[BadRecord]) -> list[tuple[list[int], list[int]]]:
    rendered = []
    per_token = longest_token(tok)
    for file, line, messages in records:
        try:
            reason = _too_long(messages, row, per_token)
            if reason is not None:
                raise DataError(reason)
            ids, mask = render_with_mask(tok, messages)
            if len(ids) > row:
                raise DataError(f"conversation has {len(ids):,} tokens, more than context "
                                f"length + 1 = {row:,} (use a larger --context-length)")
        except DataError as exc:
            item = BadRecord(file, line, str(exc))
            if not skip_bad:
                raise DataError(f"{item}; fix the record or pass --skip-bad to skip bad "
                                f"ones") from exc
            bad.append(item)
            continue
        rendered.append((ids, mask))
    return rendered


def pack_rows(conversations: Sequence[tuple[list[int], list[int]]], row: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack (ids, mask) conversations in order into rows of ``row`` tokens, none split;
    each row's rest is ``pad_id`` with mask 0. -> (tokens, mask), both (rows·row,)."""
    tokens: list[int] = []
    mask: list[int] = []
    used = 0
    for ids, m in conversations:
        if used + len(ids) > row:  # close the row
            tokens += [pad_id] * (row - used)
            mask += [0] * (row - used)
            used = 0
        tokens += ids
        mask += m
        used += len(ids)
    if used:
        tokens += [pad_id] * (row - used)
        mask += [0] * (row - used)
    return np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"output {display_name(out)} is a file, not a folder; pass a folder "
                        f"path to --out")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in CHAT_FILES)
        if others:
            raise DataError(f"output folder {display_name(out)} holds other files "
                            f"({', '.join(map(display_name, others[:3]))}); choose an empty or "
                            f"new --out")
        if any(out.iterdir()) and not force:
            raise DataError(f"output folder {display_name(out)} already holds prepared data; "
                            f"pass --force to replace it, or choose another --out")


def prepare_chat(out_dir: str | Path, inputs: Sequence[str | Path], *,
                 tokenizer: str | Path | Tokenizer, context_length: int = 256,
                 val_fraction: float = 0.1, skip_bad: bool = False, seed: int = 0,
                 force: bool = False, max_record_bytes: int = MAX_RECORD_BYTES) -> ChatData:
    """Render the conversations of ``inputs`` (.jsonl files or folders) into ``out_dir``.

    Nothing in ``out_dir`` changes unless the whole run succeeds."""
    check_int("context length", context_length, error=DataError)
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction!r}")
    check_int("--max-record-bytes", max_record_bytes, error=DataError)
    out = Path(out_dir)
    _check_out(out, force)
    records, bad = _collect(inputs, skip_bad, max_record_bytes)
    texts = [m["content"] for _, _, ms in records for m in ms]
    tok = chat_tokenizer(tokenizer, texts or [""])
    row = context_length + 1
    rendered = _render_all(tok, records, row, skip_bad, bad)
    if len(rendered) < 2:
        raise DataError(f"only {len(rendered)} usable conversation(s) in "
                        f"{', '.join(map(display_name, inputs))}; fine-tuning needs at least 2 "
                        f"(one for validation)")
    order = list(range(len(rendered)))
    random.Random(seed).shuffle(order)
    n_val = min(len(order) - 1, max(1, round(len(order) * val_fraction)))
    val_set = set(order[:n_val])
    pad = tok.eos_id if tok.eos_id is not None else tok.special_id(STANDARD_SPECIALS[-1])
    splits = {
        "train": pack_rows([r for i, r in enumerate(rendered) if i not in val_set], row, pad),
        "val": pack_rows([r for i, r in enumerate(rendered) if i in val_set], row, pad),
    }
    _write(out, tok, splits, {
        "inputs": [str(p) if _is_builtin(p) else str(Path(p).resolve()) for p in inputs],
        "row_length": row,
        "conversations": {"train": len(rendered) - n_val, "val": n_val},
        "skipped": len(bad), "skipped_examples": [str(b) for b in bad[:5]],
        "val_fraction": val_fraction, "seed": seed,
    })
    if bad:
        log.warning("skipped %d bad record(s), e.g. %s", len(bad), bad[0])
    return load_chat_data(out)


def _write(out: Path, tok: Tokenizer, splits: dict[str, tuple[np.ndarray, np.ndarray]],
           chat: dict[str, Any]) -> None:
    from tinylm import __version__

    dtype = dtype_for_vocab(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for split, (tokens, mask) in splits.items():
            (tmp / f"{split}.bin").write_bytes(tokens.astype(dtype).tobytes())
            (tmp / f"{split}.mask").write_bytes(mask.tobytes())
        tok.save(tmp / "tokenizer.json")
        write_settings(tok.settings, tmp)  # the model's own chat template, when it has one
        digest = hashlib.sha256(b"".join((tmp / f).read_bytes() for f in CHAT_FILES[:5]))
        meta = {
            "format": FORMAT, "version": 1, "tinylm_version": __version__,  # one .bin per split
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": "chat:" + ", ".join(chat["inputs"]), "sha256": digest.hexdigest(),
            "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                          "special_tokens": list(tok.special_tokens), "eos_id": tok.eos_id},
            "vocab_size": tok.vocab_size, "dtype": dtype.name,
            "train_tokens": int(splits["train"][0].size), "val_tokens": int(splits["val"][0].size),
            "context_length": chat["row_length"] - 1, "chat": chat,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)  # checked above: only this kind of folder, with --force
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_chat_data(path: str | Path) -> ChatData:
    """Open a folder written by :func:`prepare_chat` (memory-mapped, read-only)."""
    data: PreparedData = load_prepared(path)
    if "chat" not in data.meta:
        raise DataError(f"{display_name(path)} holds prepared text without a loss mask, not "
                        f"chat data; prepare it with tinylm prepare --chat FILE.jsonl "
                        f"--tokenizer MODEL")
    masks = {}
    for split in ("train", "val"):
        mask_path = Path(path) / f"{split}.mask"
        n = len(getattr(data, split))
        if not mask_path.is_file() or mask_path.stat().st_size != n:
            raise DataError(f"chat data folder {display_name(path)} is incomplete ({split}.mask "
                            f"missing or not {n:,} bytes); run tinylm prepare --chat again")
        masks[split] = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(n,))
    return ChatData(data.dir, data.train, data.val, masks["train"], masks["val"], data.meta,
                    data.tokenizer)


__all__ = ["ChatData", "chat_tokenizer", "load_chat_data", "pack_rows", "prepare_chat"]
