"""The data a run trains on: the :class:`TrainData` protocol, its checks, and the
batches (random windows drawn from one ``torch.Generator``, the same global batch on
every rank, each rank keeping its slice: N ranks of batch B train like one process of
batch N·B; see :mod:`tinylm.training.distributed`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from tinylm.core.errors import DataError
from tinylm.data import get_batch, load_prepared
from tinylm.io.checkpoint_files import CONFIG_FILE, RUN_LATEST
from tinylm.training import distributed
from tinylm.training.runlog import METRICS_FILE


class TrainData(Protocol):
    """What :func:`tinylm.training.train` reads from its data
    (``tinylm.data.PreparedData`` is one).

    ``train``/``val`` are 1-D integer token arrays (numpy arrays or memmaps);
    ``tokenizer`` made them. Optional ``train_mask``/``val_mask`` (same length as the
    split, 0/1): a target token whose mask is 0 does not count in the loss (e.g. the
    prompt part of a chat fine-tuning example); a training batch with no counted target
    is an error. ``dir`` (optional) names the data in messages.
    """

    tokenizer: Any
    train: Any
    val: Any


def load_data(source: str | os.PathLike | TrainData) -> TrainData:
    """``source`` itself when it is TrainData, else the prepared folder it names."""
    if all(hasattr(source, a) for a in ("train", "val", "tokenizer")):
        return source  # type: ignore[return-value]
    path = Path(source)  # type: ignore[arg-type]
    if path.is_dir() and ((path / CONFIG_FILE).is_file() or (path / RUN_LATEST).exists()
                          or (path / METRICS_FILE).is_file()):
        raise DataError(f"--data {path} is a training run or checkpoint folder, not prepared "
                        f"data; pass the folder written by 'tinylm prepare --out' (the one "
                        f"this run was trained on)")
    return load_prepared(path)


def data_name(data: TrainData) -> str:
    """How messages name the data: its folder, when it has one."""
    return str(getattr(data, "dir", "the training data"))


def mask_of(data: TrainData, split: str) -> Any | None:
    """The loss mask of ``split`` (None: every target counts), checked for length."""
    mask = getattr(data, f"{split}_mask", None)
    if mask is not None and len(mask) != len(getattr(data, split)):
        raise DataError(f"the {split} loss mask has {len(mask):,} entries but the {split} "
                        f"split {len(getattr(data, split)):,} tokens; they must match")
    return mask


def window_length(data: TrainData, context_length: int) -> int:
    """Tokens per training window: the model's context length, or a chat set's shorter
    rows. Every conversation of ``tinylm prepare --chat`` lies inside one row of C + 1
    tokens, so a window longer than C only joins conversations: fine-tuning a model of
    8192 positions on rows of 257 trains windows of 256 (the model keeps its length)."""
    row = getattr(data, "row_length", None)
    return context_length if row is None else min(context_length, int(row) - 1)


def check_lengths(data: TrainData, C: int) -> None:
    """Each split must hold one window of ``C`` tokens and its next token."""
    for split in ("train", "val"):
        n = len(getattr(data, split))
        if n < C + 1:
            raise DataError(f"the {split} split of {data_name(data)} has {n:,} tokens, fewer "
                            f"than context_length + 1 = {C + 1:,}; use a smaller "
                            f"--context-length or prepare more text")


def check_token_ids(data: TrainData, vocab_size: int) -> None:
    """Refuse ids outside the vocabulary (as eval does), scanning in chunks."""
    for split in ("train", "val"):
        arr = getattr(data, split)
        lo, hi = 0, -1
        for i in range(0, len(arr), 1 << 24):
            block = np.asarray(arr[i:i + (1 << 24)])
            lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(f"the {split} split of {data_name(data)} holds token id {bad}, "
                            f"outside the vocabulary of {vocab_size}; the tokens were made "
                            f"with another tokenizer — prepare the data again with "
                            f"'tinylm prepare'")


def draw_batch(tokens: Any, mask: Any | None, rows: int, C: int, gen: torch.Generator,
               ctx: distributed.DistContext, device: torch.device) -> tuple[Tensor, Tensor]:
    """This rank's (x, y) of one global batch; masked targets become -100 (ignored)."""
    if mask is None:
        x, y = get_batch(tokens, rows, C, gen, device)
        return ctx.shard(x), ctx.shard(y)  # (N·B, C) -> (B, C)
    starts = torch.randint(len(tokens) - C, (rows,), generator=gen).numpy()  # as get_batch
    idx = starts[:, None] + np.arange(C + 1)
    xy = ctx.shard(torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64)))
    keep = ctx.shard(torch.from_numpy(np.asarray(mask[idx[:, 1:]]) != 0))
    if not bool(keep.any()):
        raise DataError("a training batch has no target with loss mask 1 (every position "
                        "is masked out); check the data's loss mask")
    y = xy[:, 1:].masked_fill(~keep, -100)
    return xy[:, :-1].contiguous().to(device), y.contiguous().to(device)

