"""Sampling: logit filters as pure functions, and generation with the KV cache.

Shapes (letters as in attention.py): B samples generated side by side, T prompt
length, C the model's context length, V the vocabulary.

Filters map logits (..., V) to logits (..., V) with removed tokens set to -inf, so a
softmax afterwards is the renormalised distribution over the kept tokens:

    temperature   logits / t  (t -> 0 is greedy, t = 1 leaves them alone)
    top-k         keep the k largest logits of each row
    top-p         keep the smallest set of most likely tokens whose probability
                  reaches p (nucleus sampling)

:func:`generate_stream` runs the prompt through the model in one forward pass, filling
a preallocated :class:`~tinylm.core.decoding.KVCache`, then feeds one token per step: each
step reads every weight once and attends to the cached keys and values, so its cost
does not grow with the sequence. When the sequence outgrows the context length C, the
window slides: the cache is reset and refilled with the last C − 1 tokens (absolute
positional embeddings cannot be shifted in place), which is logged once.
:func:`generate` collects the stream into one tensor. :class:`TextStream` turns
generated ids into printable text pieces (never half a UTF-8 character, cut at stop
strings) for the CLI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tinylm import acceleration
from tinylm.core.checks import check_int, is_int, is_number
from tinylm.core.config import available_memory, format_bytes
from tinylm.core.decoding import Decoder
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.io.checkpoint import nonfinite_error

log = logging.getLogger(__name__)

__all__ = [
    "SamplingConfig",
    "TextStream",
    "apply_temperature",
    "check_generation",
    "check_logits",
    "encode_prompt",
    "filter_logits",
    "generate",
    "generate_stream",
    "generate_text",
    "next_token_probs",
    "sample_next",
    "top_k_filter",
    "top_p_filter",
]


# --- the filters, as pure functions --------------------------------------------------------


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature, (..., V) -> (..., V). Below 1 sharpens, above 1 flattens.

    Temperature 0 means greedy decoding, which :func:`sample_next` handles by argmax
    (dividing by 0 is not defined), so here it must be > 0.
    """
    if not temperature > 0:
        raise ConfigError(f"apply_temperature needs temperature > 0, got {temperature!r}; "
                          f"use temperature 0 only through sample_next (greedy)")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row, set the rest to -inf; (..., V) -> (..., V).

    Tokens tied with the k-th largest logit are kept too (so ties never make the
    choice depend on sort order); k >= V keeps everything.
    """
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1), the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability
    reaches p, set the rest to -inf; (..., V) -> (..., V).

    Sorted by probability, token i is kept when the probability of the tokens before it
    is still below p, so the most likely token is always kept and p = 1 keeps all.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V) each
    probs = F.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to id order
    return logits.masked_fill(drop, float("-inf"))


_F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32, ~1.18e-38
_F32_MAX = float(torch.finfo(torch.float32).max)  # ~3.40e38
_INT64_MAX = 2**63 - 1
#: Host memory per generated token per sample: the int64 id buffer, the Python list of
#: ids and the decoded text each sample's TextStream keeps (measured ~50 bytes).
_BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits, validated on construction.

    temperature  0 = greedy (argmax); otherwise logits are divided by it before softmax
    top_k        keep only the k most likely tokens (None = all)
    top_p        keep the smallest set of tokens whose probability reaches p (None = all)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not is_number(t) or not t >= 0 or t == float("inf"):
            raise ConfigError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}; "
                              f"try --temperature 0.8")
        if 0 < t < _F32_TINY or t > _F32_MAX:
            raise ConfigError(f"temperature {t!r} is outside what float32 logits can be "
                              f"divided by ({_F32_TINY:.3g} to {_F32_MAX:.3g}); use "
                              f"--temperature 0 for greedy decoding, or e.g. 0.8")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, _INT64_MAX,
                      hint="try --top-k 40, or leave it out to keep every token")
        p = self.top_p
        if p is not None and (not is_number(p) or not 0 < p <= 1):
            raise ConfigError(f"top_p must be a number in (0, 1], got {p!r}; try --top-p 0.9,"
                              f" or leave it out to keep every token")
        if p is not None and p < _F32_TINY:
            raise ConfigError(f"top_p {p!r} is below float32's smallest normal number "
                              f"({_F32_TINY:.3g}), so probabilities cannot be compared with "
                              f"it; use --temperature 0 (greedy) to keep only the top token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def check_generation(max_new_tokens: Any, num_samples: Any = 1, seed: Any = None, *,
                     prompt_tokens: int = 1, device: Any = "cpu",
                     model_config: Any = None) -> None:
    """ConfigError unless a request for ``num_samples`` x ``max_new_tokens`` tokens is
    well-formed: positive integers, a seed within int64, and what it allocates fitting
    in the memory available (the message gives the estimate): the ids and text of every
    sample on the host and, given the ``model_config``, the KV cache (float32,
    2·L·B·C·kv_dim) and the logits (B·V) on ``device``."""
    for name, value, flag in (("max_new_tokens", max_new_tokens, "--max-new-tokens 200"),
                              ("num_samples", num_samples, "--num-samples 4")):
        check_int(name, value, 1, _INT64_MAX, hint=f"e.g. {flag}")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= _INT64_MAX):
        raise ConfigError(f"seed must be an integer in [0, {_INT64_MAX}] (int64), got "
                          f"{seed!r}; e.g. --seed 1")
    tokens = num_samples * (prompt_tokens + max_new_tokens)
    cache = 0  # the KV cache and two rows of logits per sample
    if model_config is not None:
        c = model_config
        kv = getattr(c, "kv_dim", c.n_head * c.head_dim)
        cache = 4 * num_samples * (2 * c.n_layer * c.context_length * kv + 2 * c.vocab_size)
    what = f"{_plural(num_samples, 'sample')} of {max_new_tokens:,} new tokens"
    fix = ("ask for fewer --num-samples or --max-new-tokens (a sample also ends at the "
           "end-of-text token or a --stop string)")
    cpu = getattr(device, "type", str(device).split(":")[0]) == "cpu"
    host = tokens * _BYTES_PER_TOKEN + (cache if cpu else 0)
    on_device = 0 if cpu else 8 * tokens + cache  # the int64 id buffer lives there too
    for need, where in ((host, "cpu"), (on_device, device)):
        have = available_memory(where) if need else None
        if tokens > _INT64_MAX or (have is not None and need > have):
            room = "" if have is None else f" but only {format_bytes(have)} is available"
            raise ConfigError(f"{what} need about {format_bytes(need)} of memory on {where} "
                              f"for their ids, text and KV cache{room}; {fix}")


def filter_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """Temperature, then top-k, then top-p (the usual order); (..., V) -> (..., V).

    Not for greedy configs (temperature 0): greedy takes the argmax of the raw logits.
    """
    logits = apply_temperature(logits, config.temperature)
    if config.top_k is not None:
        logits = top_k_filter(logits, config.top_k)
    if config.top_p is not None:
        logits = top_p_filter(logits, config.top_p)
    return logits


def next_token_probs(logits: Tensor, config: SamplingConfig) -> Tensor:
    """The distribution the next token is drawn from, (..., V), each row summing to 1.

    Greedy configs give a one-hot row on the argmax; otherwise it is the softmax of the
    filtered logits, i.e. the kept tokens' probabilities renormalised.
    """
    if config.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits.float()
    if config.temperature < 1:  # shift first so that logits / t cannot overflow to inf
        logits = logits - logits.amax(-1, keepdim=True)  # softmax is shift-invariant
    return F.softmax(filter_logits(logits, config), dim=-1)


def check_logits(model: Any, logits: Tensor) -> None:
    """A one-line CheckpointError naming ``model``'s checkpoint unless every one of
    ``logits`` (B, V) is finite: NaN or inf there means weights that overflow float32
    in the forward pass, and no token can be drawn from them (one isfinite, one sync).
    Every decoding loop calls it on each step's logits (:func:`generate_stream`'s, and a
    server's)."""
    if not bool(torch.isfinite(logits).all()):
        raise nonfinite_error(model, "the next-token logits")


def sample_next(logits: Tensor, config: SamplingConfig,
                generator: torch.Generator | None = None,
                argmax: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """One token id per row: logits (B, V) -> ids (B,), on the logits' device (no sync).
    ``argmax`` replaces ``logits.argmax(-1)`` for greedy configs (a decoding plan's)."""
    if config.greedy:
        return argmax(logits) if argmax is not None else logits.argmax(-1)
    probs = next_token_probs(logits, config)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B, 1) -> (B,)


# --- generation -------------------------------------------------------------------------------


def _as_batch(ids: Tensor | Sequence[int] | Sequence[Sequence[int]], device) -> Tensor:
    """Prompt ids as a (B, T) int64 tensor on ``device``; a 1-D prompt becomes B = 1."""
    try:
        t = ids if isinstance(ids, Tensor) else torch.as_tensor(ids)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"prompt ids must be a list of ints or of equal-length rows "
                          f"({exc}); pad or batch prompts of the same length") from exc
    if t.dim() == 1:
        t = t.unsqueeze(0)  # (T,) -> (1, T)
    if t.dim() != 2 or t.dtype in (torch.bool,) or t.is_floating_point():
        raise ConfigError(f"prompt ids must be integers of shape (T,) or (B, T), got "
                          f"{tuple(t.shape)} {t.dtype}")
    if t.shape[1] == 0:
        raise ConfigError("the prompt is empty; give at least one token (e.g. the "
                          "tokenizer's end-of-text id) to start from")
    return t.to(device=device, dtype=torch.long)


def generate_stream(
    model: GPT,
    ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row, (B,) int64, one step at a time.

    ``ids`` is the prompt, (T,) or (B, T) (all rows the same length; repeat one prompt
    B times to draw B samples in one batch). The prompt goes through the model in one
    forward pass; each further step feeds one token per row through the KV cache.
    ``seed`` makes the draw reproducible (same seed, same tokens); without it torch's
    global generator is used. A row that emits one of ``stop_ids`` is finished: it
    keeps yielding that id, and the stream ends when every row is finished or after
    ``max_new_tokens`` steps. ``vocab_size`` restricts sampling to ids below it (a
    tokenizer smaller than the model's embedding). Beyond the context length the
    window slides (see the module docstring). Runs under ``torch.inference_mode``, so
    break out of the loop at any time.
    """
    config = SamplingConfig(temperature, top_k, top_p)
    check_int("max_new_tokens", max_new_tokens)
    param = next(model.parameters())
    device = param.device
    prompt = _as_batch(ids, device)  # (B, T)
    B, T = prompt.shape
    V = model.config.vocab_size
    if vocab_size is not None and not 1 <= vocab_size <= V:
        raise ConfigError(f"vocab_size must be in [1, {V}] (the model's vocabulary), got "
                          f"{vocab_size!r}")
    if int(prompt.min()) < 0 or int(prompt.max()) >= V:
        raise DataError(f"prompt ids must be in [0, {V}) for this model, got "
                        f"{int(prompt.min())}..{int(prompt.max())}; the prompt was encoded "
                        f"with a different tokenizer")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    stops = None
    if stop_ids:
        stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    return _run(model, prompt, max_new_tokens, config, generator, stops, vocab_size, autocast)


def _run(model: GPT, prompt: Tensor, max_new_tokens: int, config: SamplingConfig,
         generator: torch.Generator | None, stops: Tensor | None, vocab_size: int | None,
         autocast: Any) -> Iterator[Tensor]:
    """:func:`_decode` in eval and inference mode, restoring the model's mode after, with
    the decoding plan of :mod:`tinylm.acceleration` (it never changes the model)."""
    was_training = model.training
    model.eval()
    try:
        decoder = acceleration.plan(model, prompt.device).decoder(prompt.shape[0])
        with torch.inference_mode(), autocast, decoder:
            yield from _decode(model, decoder, prompt, max_new_tokens, config, generator,
                               stops, vocab_size)
    finally:
        model.train(was_training)


def _decode(model: GPT, decoder: Decoder, prompt: Tensor, max_new_tokens: int,
            config: SamplingConfig, generator: torch.Generator | None, stops: Tensor | None,
            vocab_size: int | None) -> Iterator[Tensor]:
    """The loop of :func:`generate_stream` (already in inference mode); each step's
    logits go through :func:`check_logits` first."""
    B, T = prompt.shape
    cache = decoder.cache
    C = cache.max_len  # the model's context length
    seq = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=prompt.device)
    seq[:, :T] = prompt
    n = T  # tokens in seq so far
    warned = False
    start = 0
    if T > C:  # the prompt alone overflows: keep its last C - 1 tokens
        start = n - (C - 1)
        log.info("prompt of %d tokens is longer than the context length %d; using its "
                 "last %d tokens", T, C, C - 1)
        warned = True
    logits = decoder.prefill(seq[:, start:n])  # (B, V)
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device) if stops is not None else None
    for step in range(max_new_tokens):
        check_logits(model, logits)
        if vocab_size is not None:
            logits = logits[:, :vocab_size]  # (B, V) -> (B, V'), a view
        nxt = sample_next(logits.float(), config, generator, decoder.argmax)  # (B,)
        if done is not None:
            nxt = torch.where(done, seq[:, n - 1], nxt)  # finished rows repeat their stop id
            done |= torch.isin(nxt, stops)
        seq[:, n] = nxt
        n += 1
        yield nxt
        if step == max_new_tokens - 1 or (done is not None and bool(done.all())):
            return
        if cache.length < C:
            logits = decoder.step(nxt)  # (B,) -> (B, V)
        else:  # the window is full: restart the cache on the last C - 1 tokens
            if not warned:
                log.info("sequence reached the context length %d; sliding the window "
                         "(the cache restarts on the last %d tokens whenever it fills)",
                         C, C - 1)
                warned = True
            start = n - (C - 1)
            logits = decoder.prefill(seq[:, start:n])


def generate(
    model: GPT,
    ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Prompt plus generated tokens, (B, T + N) with N <= max_new_tokens.

    Same arguments as :func:`generate_stream` (temperature 0 = greedy). N is smaller
    than ``max_new_tokens`` only when every row hit one of ``stop_ids``; rows that
    stopped earlier are padded with their stop id.
    """
    prompt = _as_batch(ids, next(model.parameters()).device)
    steps = list(generate_stream(model, prompt, max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, stop_ids=stop_ids,
                                 vocab_size=vocab_size))
    return torch.cat([prompt, torch.stack(steps, dim=1)], dim=1)  # (B, T) + (B, N)


# --- text out ---------------------------------------------------------------------------------


class TextStream:
    """Generated ids of one sample -> text pieces that are safe to print as they come.

    :meth:`push` returns the new text (possibly empty) after one more token. Text is
    held back while it ends in U+FFFD (a byte-level token that ends inside a multi-byte
    character) and while its end could be the start of a stop string; at a stop string
    the text is cut just before it and :attr:`stopped` becomes True. :meth:`finish`
    returns whatever was held back. ``"".join(pieces) + finish() == text``.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False
        self._full = ""
        # Text of ids[:_clean], decoded when it ended on a whole character: later tokens
        # decode on their own after it, so each push decodes only the new tail.
        self._clean = 0
        self._clean_text = ""

    @property
    def text(self) -> str:
        """All text so far (emitted plus held back), cut at a stop string."""
        return self._full

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        full = self._clean_text + self.tokenizer.decode(self.ids[self._clean:])
        # A stop string cannot start inside the emitted text (its prefix is held back).
        start = len(self.emitted)
        cut = min((i for i in (full.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._full, self.stopped = full[:cut], True
            return self._emit(self._full)
        self._full = full
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for its remaining bytes
        self._clean, self._clean_text = len(self.ids), full
        hold = max((k for s in self.stop for k in range(len(s) - 1, 0, -1)
                    if full.endswith(s[:k])), default=0)
        return self._emit(full[:len(full) - hold])

    def finish(self) -> str:
        """The held-back rest of the text (call once, after the last token)."""
        return self._emit(self._full)

    def _emit(self, safe: str) -> str:
        piece = safe[len(self.emitted):]
        self.emitted = safe
        return piece


def encode_prompt(tokenizer: Any, text: str, *, allow_special: bool = False) -> list[int]:
    """Prompt ids for ``text``, after bos when the model asks for it (``add_bos_token``,
    :meth:`~tinylm.data.tokenizers.Tokenizer.encode_prompt`); an empty prompt starts
    from that bos, else from the end-of-text token. A special token's spelling in the
    text is ordinary text unless ``allow_special``.

    A char tokenizer raises its DataError naming characters it never saw. An empty
    prompt with a tokenizer that has no end-of-text token has nothing to condition on,
    which is a DataError too.
    """
    prefix = list(tokenizer.prompt_prefix()) if hasattr(tokenizer, "prompt_prefix") else []
    if text:
        return prefix + list(tokenizer.encode(text, allow_special=allow_special))
    if prefix:
        return prefix
    eos = tokenizer.eos_id
    if eos is None:
        raise DataError(f"the prompt is empty and this {tokenizer.kind} tokenizer has no "
                        f"end-of-text token to start from; pass --prompt with some text")
    return [eos]


def generate_text(
    model: GPT,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    stop: Sequence[str] = (),
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    allow_special: bool = False,
) -> Iterator[tuple[int, str]]:
    """Yield (sample index, text piece) as text becomes printable; text in, text out.

    ``num_samples`` continuations of ``prompt`` are generated in one batch. Each piece
    is new text of one sample: whole characters only, cut before the first of the
    ``stop`` strings; a sample also ends at the tokenizer's end-of-text token (not
    printed). Generation ends when every sample has ended or after ``max_new_tokens``.
    Joining the pieces of sample i gives its full continuation (without the prompt).
    ``allow_special``: special tokens spelled in the prompt become their ids.
    """
    check_int("num_samples", num_samples)
    ids = encode_prompt(tokenizer, prompt, allow_special=allow_special)
    eos = tokenizer.eos_id
    V = model.config.vocab_size
    if tokenizer.vocab_size > V:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{V}; the checkpoint mixes a tokenizer and a model that do not match")
    batch = torch.tensor([ids] * num_samples, dtype=torch.long)  # (B, T)
    steps = generate_stream(model, batch, max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed,
                            stop_ids=None if eos is None else [eos],
                            vocab_size=tokenizer.vocab_size)
    return _text_pieces(steps, [TextStream(tokenizer, stop) for _ in range(num_samples)], eos)


def _text_pieces(steps: Iterator[Tensor], streams: list[TextStream],
                 eos: int | None) -> Iterator[tuple[int, str]]:
    """The loop of :func:`generate_text`: token ids of every row -> (row, text piece)."""
    ended = [False] * len(streams)
    try:
        for nxt in steps:
            for i, token in enumerate(nxt.tolist()):
                if ended[i]:
                    continue
                if token == eos:
                    ended[i] = True
                    continue
                piece = streams[i].push(token)
                ended[i] = streams[i].stopped
                if piece:
                    yield i, piece
            if all(ended):
                break
    finally:
        steps.close()
    for i, stream in enumerate(streams):
        piece = stream.finish()
        if piece:
            yield i, piece
