"""Task accuracy, scored the way EleutherAI's lm-evaluation-harness scores it.

Three kinds of task (docs/evaluate.md):

    multiple_choice   each choice's continuation scored by the log-likelihood of its
                      tokens, summed; acc = argmax of the sums, acc_norm = argmax of the
                      sums / the choice's length in characters, acc_bytes = / its UTF-8
                      length (ties go to the first, as numpy's argmax)
    cloze             LAMBADA style: right when the greedy continuation equals the target
                      (every target token is the argmax at its position: the harness's
                      ``is_greedy``)
    generate          greedy decoding until a stop string; the answer is extracted by a
                      regex and compared with the target (exact match)

A context and a continuation are tokenized as the harness does it (``_encode_pair``):
trailing spaces of the context move to the continuation, the pair is encoded whole, and
the continuation's tokens are those after the context's own encoding. "Encoded" is
:meth:`~tinylm.data.tokenizers.Tokenizer.encode_prompt` (bos first when the model asks
for it, as the harness's ``add_bos_token``). An empty context is the prefix token (bos,
else eos), unless the continuation already starts with it. A sequence longer than the
context length C loses tokens on the left, as the harness's (ctx + cont)[-(C+1):][:-1].

Few-shot: K examples drawn by ``random.Random(seed).sample`` (seed 1234 as the harness's
default), a new draw for each scored item, from the task's own train/dev split (never
from the items scored); each example is written as its context, the delimiter and its
gold continuation, and the examples are joined with "\\n\\n" before the item's context.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tinylm import acceleration
from tinylm.core.checks import check_int
from tinylm.core.errors import ConfigError, DataError
from tinylm.io.checkpoint_files import unwrap_model
from tinylm.use.sampling import TextStream, generate_stream

KINDS = ("multiple_choice", "cloze", "generate")
#: The few-shot seed of the harness (``fewshot_seed``).
FEWSHOT_SEED = 1234
#: Joins the few-shot examples and the item (the harness's ``fewshot_delimiter``).
FEWSHOT_DELIMITER = "\n\n"
#: Progress callback: (items done, items in all).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Extractor:
    """How a generative answer is read from the model's text: ``pattern``'s findall,
    the match ``group`` picks (-1: the last), its first non-empty group, stripped; no
    match gives "[invalid]" (the harness's RegexFilter). No pattern: the text, stripped."""

    name: str
    pattern: str | None = None
    group: int = 0

    def __call__(self, text: str) -> str:
        if self.pattern is None:
            return text.strip()
        found = re.findall(self.pattern, text)
        if not found:
            return "[invalid]"
        match = found[self.group]
        if isinstance(match, tuple):
            match = next((m for m in match if m), "[invalid]")
        return match.strip()


@dataclass(frozen=True)
class Item:
    """One scored item.

    ``contexts``: one context shared by every choice, or one per choice (Winogrande);
    ``continuations``: one per choice (multiple choice) or the target (cloze); empty for
    generate. ``answer``: the gold choice's index (multiple choice, cloze 0) or the target
    text (generate). ``choice_texts``: the texts whose lengths acc_norm / acc_bytes divide
    by (the harness's ``doc_to_choice``). ``shot``: the item written as a few-shot
    example. ``stop``: generate's stop strings for this item (None: the task's).
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    answer: int | str
    choice_texts: tuple[str, ...] = ()
    shot: str = ""
    stop: tuple[str, ...] | None = None
    id: str | None = None

    def pairs(self, prefix: str) -> list[tuple[str, str]]:
        """(context, continuation) of every choice, after the few-shot ``prefix``."""
        contexts = self.contexts * len(self.continuations) if len(self.contexts) == 1 \
            else self.contexts
        return [(prefix + c, k) for c, k in zip(contexts, self.continuations, strict=True)]


@dataclass
class Task:
    """A named list of items of one kind, and the split few-shot examples come from.

    ``fewshot`` None: the examples come from the task's items that are not scored
    (those after ``--limit``). Generate's settings: ``stop`` strings, ``extractors``
    (the first gives ``acc``; the harness's GSM8K has two), ``ignore`` (regexes deleted
    from the answer and the target before comparing) and ``ignore_case``.
    """

    name: str
    kind: str
    items: list[Item]
    fewshot: list[Item] | None = None
    stop: tuple[str, ...] = ("\n\n",)
    extractors: tuple[Extractor, ...] = (Extractor("exact_match"),)
    ignore: tuple[str, ...] = ()
    ignore_case: bool = False
    max_new_tokens: int = 32
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"task kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.items:
            raise DataError(f"task {self.name} has no items")

    def baseline(self, items: Sequence[Item]) -> float:
        """The accuracy of random guessing: the mean of 1/choices (multiple choice), 0."""
        if self.kind != "multiple_choice":
            return 0.0
        return float(np.mean([1.0 / len(it.continuations) for it in items]))


# --- tokenizing as the harness does -------------------------------------------------------


def prefix_token(tokenizer: Any) -> int:
    """The token an empty context stands for: bos, else eos (the harness's
    ``prefix_token_id``)."""
    found = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if found is None:
        raise DataError(f"an item has an empty context and this {tokenizer.kind} tokenizer "
                        f"has neither a bos nor an end-of-text token to stand for it; give "
                        f"the item a context")
    return found


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one request, as the harness's loglikelihood."""
    if context == "":
        cont = list(tokenizer.encode(continuation))
        first = prefix_token(tokenizer)
        return ([first], cont) if not cont or cont[0] != first else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = list(tokenizer.encode_prompt(context + continuation))
    ctx = list(tokenizer.encode_prompt(context))
    if not ctx:  # the context was only spaces: it stands for the prefix token
        return [prefix_token(tokenizer)], whole
    return ctx, whole[len(ctx):]


# --- log-likelihoods ----------------------------------------------------------------------


def loglikelihoods(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]], *,
                   batch_size: int = 16, progress: Callable[[int], None] | None = None
                   ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether every continuation token is
    the argmax at its position) of each (context ids, continuation ids) request.

    Requests run longest first in batches of ``batch_size`` (right-padded: a causal model's
    earlier positions do not see the padding); ``progress(n)`` after each batch of n.
    """
    base = unwrap_model(model)
    C = base.config.context_length
    device = next(base.parameters()).device
    for _, cont in requests:
        if not cont:
            raise DataError("a continuation encodes to no tokens; every choice and target "
                            "needs some text")
        if len(cont) > C:
            raise DataError(f"a continuation of {len(cont)} tokens is longer than the model's "
                            f"context length {C}; shorten the choices or the targets")
    order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i])))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast(device.type, enabled=False)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast, acceleration.plan(base, device).apply():
            for b in range(0, len(order), batch_size):
                chunk = order[b:b + batch_size]
                scores = _score_batch(base, [requests[i] for i in chunk], C, device)
                for i, score in zip(chunk, scores, strict=True):
                    out[i] = score
                if progress is not None:
                    progress(len(chunk))
    finally:
        model.train(was_training)
    return out


def _score_batch(base: nn.Module, batch: Sequence[tuple[list[int], list[int]]], C: int,
                 device: torch.device) -> list[tuple[float, bool]]:
    """One forward pass over a batch of requests (see :func:`loglikelihoods`)."""
    inputs = [(ctx + cont)[-(C + 1):][:-1] for ctx, cont in batch]
    T = max(len(x) for x in inputs)
    x = torch.zeros(len(batch), T, dtype=torch.long)  # (b, T), right-padded
    rows, cols, targets = [], [], []
    for r, (inp, (_, cont)) in enumerate(zip(inputs, batch, strict=True)):
        x[r, :len(inp)] = torch.tensor(inp)
        start = len(inp) - len(cont)  # position t predicts token t + 1
        rows += [r] * len(cont)
        cols += range(start, len(inp))
        targets += cont
    V = base.config.vocab_size
    if max(max(inp) for inp in inputs) >= V or max(targets) >= V:
        raise DataError(f"a token id is outside the model's vocabulary of {V}; the tokenizer "
                        f"and the model do not match")
    h = base.hidden_states(x.to(device))  # (b, T, E)
    h = h[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]  # (N, E)
    logits = base.lm_head(h).float()  # (N, V): only the continuation positions
    tgt = torch.tensor(targets, device=logits.device)
    logp = F.log_softmax(logits, dim=-1).gather(1, tgt[:, None])[:, 0].double()  # (N,)
    hit = logits.argmax(dim=-1) == tgt  # (N,)
    out, at = [], 0
    for _, cont in batch:
        n = len(cont)
        out.append((float(logp[at:at + n].sum()), bool(hit[at:at + n].all())))
        at += n
    return out


# --- greedy generation --------------------------------------------------------------------


def generate_greedy(model: nn.Module, tokenizer: Any, prompts: Sequence[str],
                    stops: Sequence[Sequence[str]], max_new_tokens: int, *,
                    batch_size: int = 16, progress: Callable[[int], None] | None = None
                    ) -> list[str]:
    """The greedy continuation of each prompt, cut before the first of its stop strings
    (and at the model's end-of-text / end-of-turn tokens). Prompts of one token length
    decode together in batches; a prompt longer than C - max_new_tokens keeps its end."""
    C = unwrap_model(model).config.context_length
    room = C - max_new_tokens
    ids = []
    for p in prompts:
        enc = list(tokenizer.encode_prompt(p)) or [prefix_token(tokenizer)]
        ids.append(enc[-room:] if room >= 1 else enc[-(C - 1):])
    end_ids = list(tokenizer.end_of_turn_ids)
    groups: dict[int, list[int]] = {}
    for i, enc in enumerate(ids):
        groups.setdefault(len(enc), []).append(i)
    out = [""] * len(prompts)
    for members in groups.values():
        for b in range(0, len(members), batch_size):
            chunk = members[b:b + batch_size]
            streams = [TextStream(tokenizer, stops[i]) for i in chunk]
            _decode_rows(model, [ids[i] for i in chunk], streams, end_ids, max_new_tokens,
                         tokenizer.vocab_size)
            for i, stream in zip(chunk, streams, strict=True):
                out[i] = stream.text
            if progress is not None:
                progress(len(chunk))
    return out


def _decode_rows(model: nn.Module, rows: list[list[int]], streams: list[TextStream],
                 end_ids: list[int], max_new_tokens: int, vocab_size: int) -> None:
    """Greedy tokens of equal-length prompts pushed into their streams until every row
    has stopped (a stop string or an end token)."""
    ended = [False] * len(rows)
    steps = generate_stream(model, torch.tensor(rows, dtype=torch.long), max_new_tokens,
                            temperature=0.0, stop_ids=end_ids or None,
                            vocab_size=min(vocab_size, unwrap_model(model).config.vocab_size))
    try:
        for nxt in steps:
            for r, token in enumerate(nxt.tolist()):
                if ended[r]:
                    continue
                if token in end_ids:
                    ended[r] = True
                    continue
                streams[r].push(token)
                ended[r] = streams[r].stopped
            if all(ended):
                break
    finally:
        steps.close()


# --- scoring ------------------------------------------------------------------------------


def fewshot_prefixes(task: Task, scored: Sequence[Item], pool: Sequence[Item],
                     num_fewshot: int, seed: int) -> list[str]:
    """The few-shot prefix of each scored item: ``num_fewshot`` examples of ``pool``
    drawn anew for each item by one ``random.Random(seed)``, joined with "\\n\\n"."""
    if num_fewshot == 0:
        return [""] * len(scored)
    if len(pool) < num_fewshot:
        raise ConfigError(
            f"--num-fewshot {num_fewshot} needs {num_fewshot} examples from task {task.name}'s "
            f"own train/dev split, but it has {len(pool)}; pass that split with "
            f"--fewshot-file, use --limit so unscored items remain, or ask for fewer")
    rnd = random.Random(seed)
    return [FEWSHOT_DELIMITER.join(s.shot for s in rnd.sample(list(pool), num_fewshot))
            + FEWSHOT_DELIMITER for _ in scored]


def _choice_metrics(items: Sequence[Item], scores: list[list[float]]) -> dict[str, float]:
    """acc, acc_norm and acc_bytes of multiple-choice items from their choices' sums."""
    acc, norm, by_bytes = [], [], []
    for it, lls in zip(items, scores, strict=True):
        ll = np.array(lls)
        texts = it.choice_texts or it.continuations  # an Item made without choice texts
        chars = np.array([float(len(t)) for t in texts])
        nbytes = np.array([float(len(t.encode("utf-8"))) for t in texts])
        acc.append(float(np.argmax(ll) == it.answer))
        norm.append(float(np.argmax(ll / chars) == it.answer))
        by_bytes.append(float(np.argmax(ll / nbytes) == it.answer))
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm)),
            "acc_bytes": float(np.mean(by_bytes))}


def _normalized(task: Task, text: str) -> str:
    for pattern in task.ignore:
        text = re.sub(pattern, "", text)
    return text.lower() if task.ignore_case else text


def _generate_metrics(task: Task, items: Sequence[Item], outputs: list[str]
                      ) -> dict[str, float]:
    """Exact match of each extractor's answer with the target (acc: the first's)."""
    out: dict[str, float] = {}
    for ex in task.extractors:
        hits = [_normalized(task, ex(text)) == _normalized(task, str(it.answer))
                for it, text in zip(items, outputs, strict=True)]
        out[ex.name] = float(np.mean(hits))
    out["acc"] = out[task.extractors[0].name]
    return out


def evaluate_task(model: nn.Module, tokenizer: Any, task: Task, *, limit: int | None = None,
                  num_fewshot: int = 0, seed: int = FEWSHOT_SEED, batch_size: int = 16,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Score ``task`` (its first ``limit`` items) with ``num_fewshot`` examples.

    Returns ``{"kind", "n", "acc", ..., "baseline", "num_fewshot", "seconds"}``: for
    multiple choice also acc_norm and acc_bytes; for cloze the targets' perplexity;
    for generate one exact-match accuracy per extractor. ``progress(done, total)`` is
    called as items are scored.
    """
    if limit is not None:
        check_int("limit", limit)
    check_int("num_fewshot", num_fewshot, 0)
    check_int("batch_size", batch_size)
    started = time.perf_counter()
    scored = task.items[:limit] if limit is not None else task.items
    pool = task.fewshot if task.fewshot is not None else task.items[len(scored):]
    prefixes = fewshot_prefixes(task, scored, pool, num_fewshot, seed)
    if task.kind == "generate":
        metrics = _run_generate(model, tokenizer, task, scored, prefixes, batch_size, progress)
    else:
        metrics = _run_likelihood(model, tokenizer, task, scored, prefixes, batch_size,
                                  progress)
    return {"kind": task.kind, "n": len(scored), **metrics,
            "baseline": task.baseline(scored), "num_fewshot": num_fewshot,
            "seconds": time.perf_counter() - started}


def _counter(total: int, progress: Progress | None, per_item: float
             ) -> Callable[[int], None] | None:
    """A ``progress(n requests)`` that reports items done (requests / ``per_item``)."""
    if progress is None:
        return None
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        progress(min(total, int(done[0] / per_item)), total)
    return step


def _run_likelihood(model: nn.Module, tokenizer: Any, task: Task, items: Sequence[Item],
                    prefixes: list[str], batch_size: int, progress: Progress | None
                    ) -> dict[str, float]:
    pairs = [it.pairs(p) for it, p in zip(items, prefixes, strict=True)]
    flat = [encode_pair(tokenizer, c, k) for ps in pairs for c, k in ps]
    results = loglikelihoods(model, flat, batch_size=batch_size,
                             progress=_counter(len(items), progress, len(flat) / len(items)))
    grouped, at = [], 0
    for ps in pairs:
        grouped.append(results[at:at + len(ps)])
        at += len(ps)
    if task.kind == "multiple_choice":
        return _choice_metrics(items, [[ll for ll, _ in g] for g in grouped])
    lls = [g[0][0] for g in grouped]
    return {"acc": float(np.mean([g[0][1] for g in grouped])),
            "perplexity": float(np.exp(-np.mean(lls)))}


def _run_generate(model: nn.Module, tokenizer: Any, task: Task, items: Sequence[Item],
                  prefixes: list[str], batch_size: int, progress: Progress | None
                  ) -> dict[str, float]:
    prompts = [p + it.contexts[0] for it, p in zip(items, prefixes, strict=True)]
    stops = [it.stop if it.stop is not None else task.stop for it in items]
    outputs = generate_greedy(model, tokenizer, prompts, stops, task.max_new_tokens,
                              batch_size=batch_size,
                              progress=_counter(len(items), progress, 1.0))
    return _generate_metrics(task, items, outputs)


__all__ = ["FEWSHOT_DELIMITER", "FEWSHOT_SEED", "KINDS", "Extractor", "Item", "Task",
           "encode_pair", "evaluate_task", "fewshot_prefixes", "generate_greedy",
           "loglikelihoods", "prefix_token"]
