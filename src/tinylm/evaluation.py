"""Evaluation: mean loss, perplexity and bits per byte over a token sequence.

The model's row t predicts token t+1 (SEED-MATH.md section 5), so a sequence of N
tokens has N - 1 targets. :func:`evaluate` scores every one of them exactly once and
returns their mean cross-entropy:

    windows   inputs tokens[b : e], targets tokens[b+1 : e+1], e = min(b + C, N - 1),
              for b = 0, S, 2S, ... until e reaches N - 1
    scored    only the rows whose target was not scored by an earlier window
              (the last e - e_prev rows), so every target counts once

With the default stride S = C the windows do not overlap and every row is scored
(each target sees the tokens since its window's start). A smaller stride gives each
target up to C - 1 tokens of left context (sliding-window evaluation), at the cost of
about C / S times more compute. This is the scheme of the Hugging Face perplexity guide.

    perplexity     = exp(loss)
    bits per byte  = loss · tokens / (ln 2 · bytes)   (comparable across tokenizers)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinylm.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """Mean next-token cross-entropy (nats) over ``tokens`` scored targets.

    ``bits_per_byte`` is None when the byte count of the evaluated text is unknown.
    """

    loss: float
    perplexity: float
    bits_per_byte: float | None
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``tinylm eval --json`` prints."""
        return {"loss": self.loss, "perplexity": self.perplexity,
                "bits_per_byte": self.bits_per_byte, "tokens": self.tokens}


def perplexity(loss: float) -> float:
    """exp(loss), or inf when that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def bits_per_byte(loss: float, tokens: int, num_bytes: int) -> float:
    """Total nats over the text (loss · tokens) in bits, per byte of its UTF-8 text.

    loss is the mean cross-entropy in nats per token; dividing the total by ln 2 turns
    nats into bits. Unlike per-token loss this does not depend on the tokenizer.
    """
    if num_bytes <= 0:
        raise DataError(f"cannot compute bits per byte of {num_bytes} bytes; the evaluated "
                        f"text must be non-empty")
    return loss * tokens / (math.log(2) * num_bytes)


@dataclass(frozen=True)
class Window:
    """One evaluation window: inputs tokens[start : end], targets tokens[start+1 : end+1];
    only the last ``scored`` rows count (earlier targets belong to earlier windows)."""

    start: int
    end: int
    scored: int


def eval_windows(n_tokens: int, context_length: int, stride: int | None = None
                 ) -> Iterator[Window]:
    """The windows that score each of the n_tokens - 1 targets exactly once.

    With stride None (= context_length) they are non-overlapping chunks of C inputs
    (the last one shorter); with stride S < C each window after the first scores S new
    targets with C - S tokens of extra left context.
    """
    C = context_length
    S = C if stride is None else stride
    if not 1 <= S <= C:
        raise ConfigError(f"stride must be between 1 and the context length {C}, got {S}; "
                          f"use --stride {C} (non-overlapping) or smaller for sliding windows")
    last = n_tokens - 1  # the number of targets; inputs end at most here
    prev_end = 0
    begin = 0
    while prev_end < last:
        end = min(begin + C, last)
        yield Window(begin, end, end - prev_end)
        prev_end = end
        begin += S


def _as_numpy(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"evaluation needs a 1-D token sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr


def _batches(windows: Sequence[Window], batch_size: int) -> Iterator[list[Window]]:
    """Runs of up to batch_size windows of equal length (only the last may differ)."""
    batch: list[Window] = []
    for w in windows:
        if batch and (len(batch) == batch_size
                      or w.end - w.start != batch[0].end - batch[0].start):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


def evaluate(
    model: nn.Module,
    tokens: Any,
    *,
    context_length: int | None = None,
    batch_size: int = 16,
    stride: int | None = None,
    max_windows: int | None = None,
    device: torch.device | str | None = None,
    num_bytes: int | None = None,
) -> EvalResult:
    """Mean next-token loss of ``model`` over a 1-D token sequence (N,).

    ``tokens`` is a list, numpy array/memmap or tensor of ids. ``context_length``
    (default: the model's) is the window length C; ``stride`` the sliding step (default
    C: non-overlapping windows; see the module docstring). ``max_windows`` stops after
    that many windows for a quick estimate. ``device`` defaults to the model's; if it
    is another one the model is moved there. ``num_bytes`` is the UTF-8 size of the
    text the tokens encode; with it the result carries bits per byte (scaled to the
    scored fraction when ``max_windows`` cuts the evaluation short).

    Runs under ``torch.inference_mode``, in eval mode (the previous train/eval mode is
    restored), in fp32 on CPU and with bf16 autocast on CUDA.
    """
    from tinylm.checkpoint import unwrap_model

    base = unwrap_model(model)
    config = base.config
    C = config.context_length if context_length is None else context_length
    if isinstance(C, bool) or not isinstance(C, int) or not 1 <= C <= config.context_length:
        raise ConfigError(f"context length must be between 1 and the model's "
                          f"{config.context_length}, got {C!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an integer >= 1, got {batch_size!r}")
    if max_windows is not None and (isinstance(max_windows, bool)
                                    or not isinstance(max_windows, int) or max_windows < 1):
        raise ConfigError(f"max_windows must be an integer >= 1 or None, got {max_windows!r}")
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int)):
        raise ConfigError(f"stride must be an integer, got {stride!r}")
    arr = _as_numpy(tokens)
    if arr.size < 2:
        raise DataError(f"evaluation needs at least 2 tokens (one input and its next-token "
                        f"target), got {arr.size}; pass a longer text or split")
    windows = list(eval_windows(arr.size, C, stride))
    total_targets = arr.size - 1
    if max_windows is not None:
        windows = windows[:max_windows]

    if device is not None:
        from tinylm.config import resolve_device

        device = resolve_device(str(device))
        model.to(device)
    param = next(base.parameters())
    device = param.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast(device.type, enabled=False)

    V = config.vocab_size
    total = 0.0  # sum of per-token nats, accumulated in float64
    scored = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for batch in _batches(windows, batch_size):
                length = batch[0].end - batch[0].start
                starts = np.array([w.start for w in batch], dtype=np.int64)
                index = starts[:, None] + np.arange(length + 1)  # (B, L+1) positions
                chunk = arr[index].astype(np.int64)  # (B, L+1) ids, gathered from a memmap
                bad = (chunk < 0) | (chunk >= V)
                if bad.any():
                    raise DataError(
                        f"token id {int(chunk[bad][0])} is outside the model's vocabulary "
                        f"of {V}; the tokens were made with a different tokenizer than the "
                        f"model's — prepare the data with the model's tokenizer")
                ids = torch.from_numpy(chunk).to(device)
                x, y = ids[:, :-1], ids[:, 1:]  # (B, L) inputs, (B, L) next-token targets
                n = max(w.scored for w in batch)
                # Only the last n rows can be scored: project just those onto the vocab.
                h = base.hidden_states(x)[:, -n:]  # (B, L, E) -> (B, n, E)
                logits = base.lm_head(h).float()  # (B, n, V)
                nll = F.cross_entropy(logits.reshape(-1, V), y[:, -n:].reshape(-1),
                                      reduction="none").view(len(batch), n)  # (B·n,) -> (B, n)
                keep = torch.arange(n, device=device)[None, :] >= torch.tensor(
                    [n - w.scored for w in batch], device=device)[:, None]  # (B, n)
                total += float(nll[keep].double().sum())
                scored += int(keep.sum())
    finally:
        model.train(was_training)

    loss = total / scored
    bpb = None
    if num_bytes is not None:
        covered = num_bytes * scored / total_targets
        bpb = bits_per_byte(loss, scored, covered) if covered > 0 else None
    log.debug("evaluated %d targets in %d windows", scored, len(windows))
    return EvalResult(loss=loss, perplexity=perplexity(loss), bits_per_byte=bpb, tokens=scored)


__all__ = ["EvalResult", "Window", "bits_per_byte", "eval_windows", "evaluate", "perplexity"]
