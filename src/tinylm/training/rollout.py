"""Sampling for ``tinylm rl``: prompts rendered with the model's own chat template
(a user message, with the generation prompt), completions drawn with
:func:`tinylm.generate` (the batched decoding path: every prompt of one token length
and its G samples are one batch), cut at the first end-of-turn/eos token or the task's
stop strings, scored, and packed into padded rows with a mask over the completion
tokens only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tinylm.core.errors import ConfigError
from tinylm.data.chat import render_chat, stop_ids
from tinylm.use.sampling import generate


@dataclass(frozen=True)
class Sample:
    """One completion: its prompt ids, its kept tokens (up to and including the stop
    token when it stopped), its text (without stop token or stop string)."""

    prompt: list[int]
    tokens: list[int]
    text: str


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as a user message in the model's chat format, ending with the
    assistant's header."""
    if tokenizer.chat_template is None:
        raise ConfigError(f"this model's {tokenizer.kind} tokenizer has no chat template; "
                          f"tinylm rl needs a chat model (tinylm finetune one first)")
    return render_chat(tokenizer, [{"role": "user", "content": text}],
                       add_generation_prompt=True)


def _cut(tokens: list[int], tokenizer: Any, stops: set[int],
         stop_strings: Sequence[str]) -> tuple[list[int], str]:
    """The tokens up to the first stop id (kept) or the token that completes a stop
    string (kept); the text before it."""
    for i, t in enumerate(tokens):
        if t in stops:
            tokens = tokens[:i + 1]
            break
    body = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    text = tokenizer.decode(body)
    hits = [text.find(s) for s in stop_strings if s and s in text]
    if not hits:
        return tokens, text
    cut = min(hits)
    for k in range(1, len(body) + 1):  # the first token whose text reaches the string
        if len(tokenizer.decode(body[:k])) > cut:
            return body[:k], text[:cut]
    return tokens, text[:cut]


def sample(model: Any, tokenizer: Any, prompts: Sequence[list[int]], n: int, *,
           max_new_tokens: int, temperature: float, seed: int,
           stop_strings: Sequence[str] = ()) -> list[list[Sample]]:
    """``n`` completions of each prompt (ids); prompts of one length share a batch.
    Returns, per prompt, its ``n`` samples in order. ``seed`` fixes every draw."""
    stops = stop_ids(tokenizer)
    C = model.config.context_length
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        if len(p) >= C:
            raise ConfigError(f"a prompt of {len(p)} tokens does not fit the model's context "
                              f"of {C} tokens with room for an answer")
        by_len[len(p)].append(i)
    out: list[list[Sample]] = [[] for _ in prompts]
    for j, (length, idx) in enumerate(sorted(by_len.items())):
        rows = [prompts[i] for i in idx for _ in range(n)]
        budget = max(1, min(max_new_tokens, C - length))
        seq = generate(model, rows, budget, temperature=temperature, seed=seed * 1009 + j,
                       stop_ids=stops, vocab_size=tokenizer.vocab_size)
        new = seq[:, length:].tolist()
        for r, toks in enumerate(new):
            kept, text = _cut(toks, tokenizer, set(stops), stop_strings)
            out[idx[r // n]].append(Sample(prompts[idx[r // n]], kept, text))
    return out


@dataclass(frozen=True)
class Packed:
    """Rows of prompt + completion, right-padded: ``seq`` (N, T); ``mask`` (N, T - 1)
    is 1 where position t + 1 of ``seq`` is a completion token (the targets the loss
    counts), 0 on the prompt and the padding."""

    seq: Tensor
    mask: Tensor


def pack(samples: Sequence[Sample], device: torch.device | str = "cpu") -> Packed:
    """The rows of ``samples`` (a completion with no token gets an empty mask)."""
    T = max(len(s.prompt) + len(s.tokens) for s in samples)
    seq = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T - 1)
    for i, s in enumerate(samples):
        row = s.prompt + s.tokens
        seq[i, :len(row)] = torch.tensor(row)
        mask[i, len(s.prompt) - 1:len(row) - 1] = 1.0
    return Packed(seq.to(device), mask.to(device))


__all__ = ["Packed", "Sample", "pack", "prompt_ids", "sample"]
