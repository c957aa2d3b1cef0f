"""Batches for training and evaluation from a prepared split (a 1-D token sequence: a
memmap or a :class:`tinylm.data.shards.TokenShards`).

:func:`get_batch` draws random windows of C+1 tokens (inputs (B, C), targets shifted by
one) from a ``torch.Generator``, and :func:`iter_windows` walks a split sequentially so
every target is scored once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from tinylm.core.errors import DataError

if TYPE_CHECKING:
    import torch


def _as_tensor(block: np.ndarray, device: Any) -> torch.Tensor:
    import torch

    t = torch.from_numpy(block.astype(np.int64))
    if device is not None and torch.device(device).type != "cpu":
        if torch.device(device).type == "cuda":
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
    return t


def get_batch(tokens: np.ndarray, batch_size: int, context_length: int,
              generator: torch.Generator, device: Any = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """B random windows of C + 1 tokens -> inputs x (B, C) and targets y (B, C), int64.

    ``y[:, t] == x[:, t + 1]`` for t < C - 1: y is the window shifted by one. Window
    starts come from ``torch.randint(..., generator=generator)`` only, so restoring
    ``generator.get_state()`` replays the same batches (exact resume).
    """
    import torch

    n = len(tokens)
    if n < context_length + 1:
        raise DataError(f"split has {n:,} tokens, fewer than context length + 1 = "
                        f"{context_length + 1:,}; use a shorter context length or more text")
    starts = torch.randint(n - context_length, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(context_length + 1)  # (B, C + 1)
    block = np.asarray(tokens[idx])
    xy = _as_tensor(block, device)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def iter_windows(tokens: np.ndarray, context_length: int, batch_size: int,
                 stride: int | None = None, device: Any = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Walk a split in order for exact evaluation; yields ``(x, y, mask)`` batches.

    x, y are int64 (b, C) with b <= batch_size and y the window shifted by one;
    ``mask`` is bool (b, C) and marks the targets to score. Over the whole walk every
    target ``tokens[1:]`` is marked exactly once, so summing the masked losses and
    dividing by ``len(tokens) - 1`` gives the split's exact mean loss.

    Windows start at 0, stride, 2*stride, ... (stride defaults to C: non-overlapping);
    the last window is moved back to end at the last token, so every window is full.
    Each window marks only targets no earlier window scored: with stride < C, only its
    last ``stride`` targets after the first window (sliding-window perplexity, where each
    scored token sees at least C - stride tokens of context). A split shorter than C + 1
    gives one window of len(tokens) - 1.
    """
    n = len(tokens)
    if n < 2:
        raise DataError(f"split has {n} token(s); evaluation needs at least 2")
    c = min(context_length, n - 1)
    stride = c if stride is None else stride
    if not 1 <= stride <= c:
        raise DataError(f"stride must be between 1 and the context length {c}, got {stride}")
    starts = list(range(0, n - 1 - c + 1, stride))
    if starts[-1] + c < n - 1:
        starts.append(n - 1 - c)
    offsets = np.arange(c + 1)
    scored_until = 0  # targets tokens[1 .. scored_until] are already marked
    for b in range(0, len(starts), batch_size):
        s = np.asarray(starts[b:b + batch_size])
        block = np.asarray(tokens[s[:, None] + offsets])  # (b, C + 1)
        target_pos = s[:, None] + 1 + offsets[:-1]  # (b, C) position of each target
        prev_end = np.concatenate([[scored_until], s[:-1] + c])  # last target of the window before
        mask = target_pos > prev_end[:, None]
        scored_until = int(s[-1] + c)
        import torch

        xy = _as_tensor(block, device)
        m = torch.from_numpy(mask)
        if device is not None:
            m = m.to(device)
        yield xy[:, :-1].contiguous(), xy[:, 1:].contiguous(), m


__all__ = ["get_batch", "iter_windows"]
