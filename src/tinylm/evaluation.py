"""Evaluation: mean loss, perplexity and bits per byte over a token sequence.

The model's row t predicts token t+1 (SEED-MATH.md section 5), so a sequence of N
tokens has N - 1 targets. :func:`evaluate` scores every one of them exactly once and
returns their mean cross-entropy:

    windows   C + 1 tokens each (inputs (C,), targets shifted by one), starting at
              0, S, 2S, ...; the last one is moved back to end at the last token
    scored    only the targets no earlier window scored (a suffix of each window),
              so every target counts once

The windows come from :func:`tinylm.data.iter_windows` (the one windowing routine).
With the default stride S = C they do not overlap (each target sees the tokens since
its window's start). A smaller stride gives each scored target at least C - S tokens
of left context (sliding-window evaluation, the scheme of the Hugging Face perplexity
guide) at the cost of about C / S times more compute.

    perplexity     = exp(loss)
    bits per byte  = loss · tokens / (ln 2 · bytes)   (comparable across tokenizers)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinylm import acceleration
from tinylm.data import iter_windows
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


def _as_numpy(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"evaluation needs a 1-D token sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr


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
    if stride is not None and not 1 <= stride <= C:
        raise ConfigError(f"stride must be between 1 and the context length {C}, got "
                          f"{stride}; use --stride {C} (non-overlapping) or smaller for "
                          f"sliding windows")
    if stride is not None:
        stride = min(stride, arr.size - 1)  # a split shorter than C is one window anyway

    if device is not None:
        from tinylm.config import resolve_device

        model.to(resolve_device(str(device)))
    device = next(base.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast(device.type, enabled=False)

    V = config.vocab_size
    total = 0.0  # sum of per-target nats, accumulated in float64
    scored = 0
    windows = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast, acceleration.plan(base, device).apply():
            for x, y, mask in iter_windows(arr, C, batch_size, stride, device=device):
                if max_windows is not None:  # x, y, mask: (b, C) inputs, targets, scored
                    x, y, mask = x[:max_windows - windows], y[:max_windows - windows], \
                        mask[:max_windows - windows]
                ids = torch.cat([x[:, :1], y], dim=1)  # (b, C + 1): every token of the window
                outside = (ids < 0) | (ids >= V)
                if outside.any():
                    bad = int(ids[outside][0])
                    raise DataError(
                        f"token id {bad} is outside the model's vocabulary of {V}; the "
                        f"tokens were made with a different tokenizer than the model's — "
                        f"prepare the data with the model's tokenizer")
                # Scored targets are a suffix of each window: project only the columns
                # from the first scored one onto the vocabulary.
                first = int(mask.any(0).nonzero()[0])
                h = base.hidden_states(x)[:, first:]  # (b, C, E) -> (b, n, E)
                logits = base.lm_head(h).float()  # (b, n, V)
                nll = F.cross_entropy(logits.reshape(-1, V), y[:, first:].reshape(-1),
                                      reduction="none")  # (b·n, V) -> (b·n,)
                keep = mask[:, first:].reshape(-1)  # (b, n) -> (b·n,)
                total += float(nll[keep].double().sum())
                scored += int(keep.sum())
                windows += x.shape[0]
                if max_windows is not None and windows >= max_windows:
                    break
    finally:
        model.train(was_training)

    total_targets = arr.size - 1
    loss = total / scored
    bpb = None
    if num_bytes is not None:
        covered = num_bytes * scored / total_targets
        bpb = bits_per_byte(loss, scored, covered) if covered > 0 else None
    log.debug("evaluated %d targets in %d windows", scored, windows)
    return EvalResult(loss=loss, perplexity=perplexity(loss), bits_per_byte=bpb, tokens=scored)


# --- texts and prepared splits ----------------------------------------------------------


def decoded_bytes(tokenizer: Any, tokens: Any, chunk: int = 1 << 20) -> int:
    """UTF-8 size of the text that ``tokens`` (N,) decode to, decoding ~chunk at a time.

    A cut inside a multi-byte character would decode as U+FFFD on both sides, so a chunk
    whose text ends in U+FFFD is extended by a few tokens until it ends cleanly.
    """
    arr = _as_numpy(tokens)
    n, start, total = arr.size, 0, 0
    while start < n:
        end = min(start + chunk, n)
        text = tokenizer.decode(arr[start:end])
        for _ in range(8):
            if end >= n or not text.endswith("\ufffd"):
                break
            end += 1
            text = tokenizer.decode(arr[start:end])
        total += len(text.encode("utf-8", errors="surrogatepass"))
        start = end
    return total


def _identity(tokenizer: Any) -> str:
    import json

    doc = tokenizer.to_hf_json()
    return json.dumps({"model": doc.get("model"), "added": doc.get("added_tokens"),
                       "pre": doc.get("pre_tokenizer"), "norm": doc.get("normalizer")},
                      sort_keys=True)


def check_same_tokenizer(model_tokenizer: Any, data_tokenizer: Any, where: str) -> None:
    """Raise a DataError unless both tokenizers map text to the same ids (same kind,
    vocabulary, merges, special tokens and pre-tokenization)."""
    if model_tokenizer is None or data_tokenizer is None:
        return
    if _identity(model_tokenizer) != _identity(data_tokenizer):
        raise DataError(
            f"{where} was prepared with a different tokenizer ({data_tokenizer.kind}, "
            f"{data_tokenizer.vocab_size} tokens) than the model's ({model_tokenizer.kind}, "
            f"{model_tokenizer.vocab_size} tokens); prepare the data with the model's "
            f"tokenizer (tinylm prepare --tokenizer MODEL_DIR/tokenizer.json) or use --text")


def evaluate_text(model: nn.Module, tokenizer: Any, text: str, **kwargs: Any) -> EvalResult:
    """:func:`evaluate` on ``text`` encoded with ``tokenizer``; bits per byte use the
    text's UTF-8 size. ``kwargs`` go to :func:`evaluate`."""
    tokens = tokenizer.encode_array([text]) if hasattr(tokenizer, "encode_array") \
        else tokenizer.encode(text)
    return evaluate(model, tokens, num_bytes=len(text.encode("utf-8")), **kwargs)


def evaluate_split(model: nn.Module, tokenizer: Any, data_dir: Any, split: str = "val",
                   **kwargs: Any) -> EvalResult:
    """:func:`evaluate` on one split of a ``tinylm prepare`` folder.

    The split must have been made with the model's tokenizer (``tokenizer``, or None to
    skip the check). Bits per byte use the UTF-8 size of the decoded split.
    """
    from tinylm.data import load_prepared

    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
    data = load_prepared(data_dir)
    check_same_tokenizer(tokenizer, data.tokenizer, str(data.dir))
    tokens = data.val if split == "val" else data.train
    if len(tokens) < 2:
        raise DataError(f"the {split} split of {data.dir} has {len(tokens)} token(s); "
                        f"evaluation needs at least 2, prepare more text or use --split train")
    num_bytes = decoded_bytes(data.tokenizer, tokens)
    return evaluate(model, tokens, num_bytes=num_bytes, **kwargs)


__all__ = ["EvalResult", "bits_per_byte", "check_same_tokenizer", "decoded_bytes", "evaluate",
           "evaluate_split", "evaluate_text", "perplexity"]
