"""Evaluation: mean loss, perplexity and bits per byte over a token sequence.

The model's row t predicts token t+1 (docs/attention.md), so a sequence of N
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

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinylm import acceleration
from tinylm.core.checks import check_int, is_int
from tinylm.core.errors import ConfigError, DataError
from tinylm.data import iter_windows
from tinylm.data.shards import TokenShards
from tinylm.io.checkpoint import nonfinite_allowed, nonfinite_error
from tinylm.io.checkpoint_files import unwrap_model

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


def _as_numpy(tokens: Any) -> np.ndarray | TokenShards:
    """A 1-D integer array of ``tokens``; memory-mapped shards stay as they are (windows
    are read from them batch by batch, never the whole split into memory)."""
    if isinstance(tokens, TokenShards):
        return tokens
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
    restored), in fp32 on CPU and with bf16 autocast on CUDA. A NaN or infinite loss is
    a CheckpointError naming the checkpoint, unless the model was loaded with
    ``allow_nonfinite`` (then it is the result)."""
    base = unwrap_model(model)
    config = base.config
    C = config.context_length if context_length is None else context_length
    _check_options(config.context_length, C, batch_size, max_windows, stride)
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

    device = _place(model, base, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast(device.type, enabled=False)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast, acceleration.plan(base, device).apply():
            total, scored, windows = _score_windows(base, arr, C, batch_size, stride,
                                                    max_windows, device)
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


def _place(model: nn.Module, base: nn.Module, device: torch.device | str | None
           ) -> torch.device:
    """The device ``base``'s weights are on, after moving ``model`` to ``device`` (if given)."""
    if device is not None:
        from tinylm.core.config import resolve_device

        model.to(resolve_device(str(device)))
    return next(base.parameters()).device


def _check_options(model_context: int, C: Any, batch_size: Any, max_windows: Any,
                   stride: Any) -> None:
    if not is_int(C) or not 1 <= C <= model_context:
        raise ConfigError(f"context length must be between 1 and the model's "
                          f"{model_context}, got {C!r}")
    check_int("batch size", batch_size)
    if max_windows is not None and (not is_int(max_windows) or max_windows < 1):
        raise ConfigError(f"max_windows must be an integer >= 1 or None, got {max_windows!r}")
    if stride is not None:
        check_int("stride", stride, None)


def _score_windows(base: nn.Module, arr: np.ndarray, C: int, batch_size: int,
                   stride: int | None, max_windows: int | None,
                   device: torch.device) -> tuple[float, int, int]:
    """(sum of nats, targets scored, windows) over the windows of :func:`iter_windows`."""
    V = base.config.vocab_size
    total = 0.0  # sum of per-target nats, accumulated in float64
    scored = 0
    windows = 0
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
        batch = float(nll[keep].double().sum())  # NaN/inf in any scored logit shows here
        if not math.isfinite(batch) and not nonfinite_allowed(base):
            raise nonfinite_error(base, "the loss of the evaluated windows")
        total += batch
        scored += int(keep.sum())
        windows += x.shape[0]
        if max_windows is not None and windows >= max_windows:
            break
    return total, scored, windows


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


def _identity(tokenizer: Any) -> dict[str, Any]:
    doc = tokenizer.to_hf_json()
    return {"model": doc.get("model"), "added": doc.get("added_tokens"),
            "pre": doc.get("pre_tokenizer"), "norm": doc.get("normalizer")}


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids (kind, vocabulary, merges, special tokens,
    pre-tokenization): equal hashes, equal ids for every text."""
    text = json.dumps(_identity(tokenizer), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _vocab_of(identity: dict[str, Any]) -> dict[str, int]:
    vocab = (identity.get("model") or {}).get("vocab") or {}
    return vocab if isinstance(vocab, dict) else {}


def describe_difference(model_tokenizer: Any, data_tokenizer: Any) -> str:
    """What differs between two tokenizers, in a few words (for error messages)."""
    a, b = _identity(model_tokenizer), _identity(data_tokenizer)
    if model_tokenizer.kind != data_tokenizer.kind:
        return f"kind {data_tokenizer.kind} vs {model_tokenizer.kind}"
    va, vb = _vocab_of(a), _vocab_of(b)
    if va != vb:
        by_id_a = {i: t for t, i in va.items()}
        by_id_b = {i: t for t, i in vb.items()}
        ids = sorted(set(by_id_a) | set(by_id_b), key=lambda i: (not isinstance(i, int), i))
        diff = [i for i in ids if by_id_a.get(i) != by_id_b.get(i)]
        if diff:
            i = diff[0]
            return (f"{len(diff)} of {max(len(va), len(vb))} token ids map to different "
                    f"strings, e.g. id {i} is {by_id_b.get(i)!r} in the data but "
                    f"{by_id_a.get(i)!r} in the model")
    for key, what in (("model", "merges or model settings"), ("added", "special tokens"),
                      ("pre", "pre-tokenization"), ("norm", "normalization")):
        if a.get(key) != b.get(key):
            return f"the {what} differ"
    return "their content hashes differ"


def check_same_tokenizer(model_tokenizer: Any, data_tokenizer: Any, where: str, *,
                         fix: str = "prepare the data with the model's tokenizer (tinylm "
                                    "prepare --tokenizer MODEL_DIR/tokenizer.json) or use "
                                    "--text") -> None:
    """Raise a DataError unless both tokenizers map text to the same ids (equal
    :func:`tokenizer_hash`); the message says what differs, then ``fix``."""
    if model_tokenizer is None or data_tokenizer is None:
        return
    if tokenizer_hash(model_tokenizer) != tokenizer_hash(data_tokenizer):
        raise DataError(
            f"{where} was prepared with a different tokenizer than the model's "
            f"({describe_difference(model_tokenizer, data_tokenizer)}); {fix}")


# --- the periodic estimate during training -------------------------------------------------


def sample_windows(num_tokens: int, context_length: int, count: int | None,
                   seed: int) -> np.ndarray:
    """Starts of a fixed random sample of ``count`` non-overlapping windows (sorted).

    The candidates are the windows at 0, C, 2C, ... (each C + 1 tokens) that cover the
    whole split; ``count`` of them are drawn without replacement by a generator of its
    own (``seed``), so the same split, C, count and seed give the same sample, and the
    mean loss over it is an unbiased estimate of the mean over all those windows.
    ``count`` None (or >= the number of windows) takes them all.
    """
    C = context_length
    total = max(1, (num_tokens - 1) // C)
    starts = np.arange(total, dtype=np.int64) * C
    if count is None or count >= total:
        return starts
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(starts, size=count, replace=False))


def estimate_loss(model: nn.Module, tokens: Any, starts: np.ndarray, *,
                  context_length: int, batch_size: int = 16,
                  loss_mask: Any | None = None) -> EvalResult:
    """Mean next-token loss over the windows beginning at ``starts`` (every target of each
    window counts; with ``loss_mask``, a 0/1 array as long as ``tokens``, only targets
    whose mask is 1). Runs in eval mode under inference_mode; the mode is restored."""
    base = unwrap_model(model)
    device = next(base.parameters()).device
    arr = _as_numpy(tokens)
    C = min(context_length, arr.size - 1)
    offsets = np.arange(C + 1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast(device.type, enabled=False)
    total, scored = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast, acceleration.plan(base, device).apply():
            for b in range(0, len(starts), batch_size):
                idx = starts[b:b + batch_size, None] + offsets  # (b, C + 1)
                xy = torch.from_numpy(np.asarray(arr[idx]).astype(np.int64)).to(device)
                logits = base(xy[:, :-1]).float()  # (b, C, V)
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      xy[:, 1:].reshape(-1), reduction="none")
                if loss_mask is not None:
                    keep = torch.from_numpy(np.asarray(loss_mask[idx[:, 1:]]) != 0)
                    keep = keep.reshape(-1).to(device)
                    total += float(nll[keep].double().sum())
                    scored += int(keep.sum())
                else:
                    total += float(nll.double().sum())
                    scored += nll.numel()
    finally:
        model.train(was_training)
    if scored == 0:
        raise DataError("the validation windows have no target with loss mask 1; nothing "
                        "to evaluate — check the data's loss mask")
    loss = total / scored
    return EvalResult(loss=loss, perplexity=perplexity(loss), bits_per_byte=None,
                      tokens=scored)


def evaluate_text(model: nn.Module, tokenizer: Any, text: str, **kwargs: Any) -> EvalResult:
    """:func:`evaluate` on ``text`` encoded with ``tokenizer`` (after bos when the model
    asks for it, ``add_bos_token``); bits per byte use the text's UTF-8 size. ``kwargs``
    go to :func:`evaluate`."""
    tokens = tokenizer.encode_array([text]) if hasattr(tokenizer, "encode_array") \
        else tokenizer.encode(text)
    prefix = tokenizer.prompt_prefix() if hasattr(tokenizer, "prompt_prefix") else []
    if prefix:
        tokens = np.concatenate([np.asarray(prefix, dtype=np.uint32),
                                 np.asarray(tokens, dtype=np.uint32)])
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


__all__ = ["EvalResult", "bits_per_byte", "check_same_tokenizer", "decoded_bytes",
           "describe_difference", "estimate_loss", "evaluate", "evaluate_split", "evaluate_text",
           "perplexity", "sample_windows", "tokenizer_hash"]
