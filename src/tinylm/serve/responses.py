"""From engine events to OpenAI response bodies, for one HTTP request.

A :class:`Run` submits a request's choices (prompts × n) to the engine and turns the
token events each choice receives into text with :class:`tinylm.use.sampling.TextStream`
(whole characters only, cut before a stop string; a stop string or a client that went
away cancels the engine's row). :meth:`Run.updates` yields what changed, which the app
renders as one JSON body or as server-sent-event chunks.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tinylm.serve.engine import End, Engine, Request, Token
from tinylm.serve.schemas import Generation, RequestError
from tinylm.use.sampling import TextStream


class Mailbox:
    """Engine events handed to one event loop, with at most one wake-up in flight: the
    engine thread appends; the first post after a drain schedules :meth:`_drain` with
    ``call_soon_threadsafe``, later ones ride along. A batched step that emits a token
    for each of 16 requests then wakes the loop once, not 16 times (each wake-up is a
    write to the loop's self-pipe and a turn of the loop under the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = \
    weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The one :class:`Mailbox` of ``loop`` (made on the loop's thread, at a request)."""
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = Mailbox(loop)
    return box


@dataclass
class Choice:
    """One generated sequence of a response: its text so far and how it ended."""

    index: int
    prompt_tokens: int
    stream: TextStream
    request: Request | None = None
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0  # characters of text already reported (for text_offset)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Update:
    """New text and tokens of one choice; ``finish_reason`` set on its last update."""

    choice: Choice
    text: str
    tokens: list[Token]
    finish_reason: str | None = None


class Stopped(RuntimeError):
    """The server stopped this request before it finished (its shutdown timeout)."""


class Run:
    """The choices of one API request in flight on ``engine``. ``id`` is the hex id of
    its response body (``cmpl-{id}``), ``request_id`` the one its log lines and
    ``X-Request-Id`` header name (:func:`tinylm.serve.lifecycle.request_id`)."""

    def __init__(self, engine: Engine, tokenizer: Any, prompts: Sequence[Sequence[int]],
                 gen: Generation, stop_ids: Sequence[int], timeout: float,
                 given: Sequence[Token] | None = None, *, id: str | None = None,
                 request_id: str | None = None,
                 constraints: Sequence[Any] | None = None) -> None:
        self.id = id or uuid.uuid4().hex[:24]
        self.request_id = request_id or self.id
        self.stopping = False  # the server cancelled it (shutdown)
        self.client_left = False
        self.created = int(time.time())
        self.tokenizer, self.gen = tokenizer, gen
        self.stop_ids = tuple(stop_ids)
        self.mailbox = mailbox(asyncio.get_running_loop())
        self.events: asyncio.Queue[tuple[int, Token | End]] = asyncio.Queue()
        deadline = time.monotonic() + timeout
        self.choices: list[Choice] = []
        requests = []
        for p, ids in enumerate(prompts):
            for j in range(gen.n):
                i = p * gen.n + j
                seed = None if gen.seed is None else gen.seed + j
                req = Request(list(ids), gen.max_tokens, self._emitter(i), gen.sampling, seed,
                              self.stop_ids, gen.logprobs, tokenizer.vocab_size, deadline,
                              constraint=None if constraints is None else constraints[i])
                self.choices.append(Choice(i, len(ids), TextStream(tokenizer, gen.stop), req))
                requests.append(req)
        if gen.max_tokens == 0 or given is not None:
            self._finish_here(given)
            return
        engine.submit(requests)  # QueueFull propagates: nothing was queued

    def _finish_here(self, given: Sequence[Token] | None) -> None:
        """End every choice without the engine: at its prompt (max_tokens 0), or after
        the one token ``given`` per prompt (max_tokens 1, greedy: already computed)."""
        for c in self.choices:
            c.request = None
            if given is None:
                c.finish_reason = "length"
                continue
            self._apply(c, given[c.index // self.gen.n])
            self._apply(c, End("length"))

    def _emitter(self, i: int):
        def emit(event: Token | End) -> None:  # called from the engine thread
            self.mailbox.post(self.events, (i, event))
        return emit

    def cancel(self) -> None:
        """Free every row still generating (the client went away or we are done)."""
        for c in self.choices:
            if c.request is not None:
                c.request.cancel()

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def stop(self) -> None:
        """Cancel it for the server's shutdown: its response ends with a Stopped error."""
        if not self.done:
            self.stopping = True
            self.cancel()

    async def updates(self) -> AsyncIterator[Update]:
        """What each event changes, until every choice has finished."""
        try:
            while not all(c.done for c in self.choices):
                i, event = await self.events.get()
                update = self._apply(self.choices[i], event)
                if update is not None:
                    yield update
        finally:
            self.cancel()

    def _apply(self, c: Choice, event: Token | End) -> Update | None:
        if c.done:
            return None
        if isinstance(event, End):
            if event.reason == "error":
                raise RuntimeError(event.message)
            if event.reason == "cancelled" and self.stopping:
                raise Stopped("the server is shutting down and stopped this request before "
                              "it finished; send it again once the server is back")
            c.finish_reason = "stop" if event.reason == "stop" else "length"
            c.request = None
            return Update(c, c.stream.finish(), [], c.finish_reason)
        c.tokens.append(event)
        if event.id in self.stop_ids:
            c.finish_reason = "stop"
            c.request = None
            return Update(c, c.stream.finish(), [event], "stop")
        piece = c.stream.push(event.id)
        if c.stream.stopped:  # a stop string: the text is cut before it
            c.finish_reason = "stop"
            if c.request is not None:
                c.request.cancel()
            c.request = None
            return Update(c, piece + c.stream.finish(), [event], "stop")
        return Update(c, piece, [event])

    def usage(self) -> dict[str, int]:
        prompt = sum(c.prompt_tokens for c in self.choices[::self.gen.n])
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


async def collect(run: Run) -> None:
    """Run to the end (non-streamed responses)."""
    async for _ in run.updates():
        pass


# --- logprobs in OpenAI's two shapes --------------------------------------------------------


_spellings: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, str, list[int]]]] = \
    weakref.WeakKeyDictionary()


def _spelling(tokenizer: Any, i: int) -> tuple[str, str, list[int]]:
    """Token i's (text decoded alone, display text, bytes), computed once per tokenizer
    (a top-20 list asks for 20 of them per generated token)."""
    known = _spellings.setdefault(tokenizer, {})
    found = known.get(i)
    if found is None:
        if i >= tokenizer.vocab_size:  # a model id beyond the tokenizer's
            found = ("", "", [])
        else:
            found = (tokenizer.decode([i]), tokenizer.id_to_token(i),
                     list(tokenizer.token_bytes(i)))
        known[i] = found
    return found


def _text(tokenizer: Any, i: int) -> str:
    """A token's text in completions' logprobs: the token decoded alone (a byte that
    is not a whole UTF-8 character decodes to U+FFFD, as in the text)."""
    return _spelling(tokenizer, i)[0]


def _token(tokenizer: Any, i: int) -> str:
    """A token's text in chat's logprobs: its characters, with bytes that do not make
    whole UTF-8 characters written as ``\\xNN`` (the raw bytes are in ``bytes``)."""
    return _spelling(tokenizer, i)[1]


def _bytes(tokenizer: Any, i: int) -> list[int]:
    return list(_spelling(tokenizer, i)[2])


def prompt_tokens(model: Any, ids: Sequence[int], k: int,
                  vocab_size: int) -> tuple[list[Token], Token]:
    """The prompt's own tokens scored as OpenAI's ``echo`` + ``logprobs`` does: token t's
    log-probability under the model's next-token distribution after tokens < t (the
    log_softmax of the logits over the model's whole vocabulary, as ``tinylm eval`` and
    lm-evaluation-harness score), with the k likeliest there; the first token has none
    (None, as OpenAI). One forward of the prompt alone, the reference model's forward.
    Also the greedy next token, chosen and scored as the engine does (over the
    tokenizer's ``vocab_size`` ids)."""
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)], dtype=torch.long))[0]  # (T, V)
        logp = F.log_softmax(logits[:-1].float(), dim=-1)  # (T-1, V): tokens 1..T-1
        chosen = logp.gather(1, torch.tensor(list(ids[1:]), dtype=torch.long)[:, None])
        top_v, top_i = torch.topk(logp, min(k, logp.shape[-1])) if k > 0 else (None, None)
        last = F.log_softmax(logits[-1, :vocab_size].float(), dim=-1)  # (vocab_size,)
        last_top = torch.topk(last, min(k, last.shape[-1])) if k > 0 else None
    out = [Token(int(ids[0]))]
    for t, lp in enumerate(chosen[:, 0].tolist()):
        top = () if top_v is None else tuple(zip(top_i[t].tolist(), top_v[t].tolist(),
                                                 strict=True))
        out.append(Token(int(ids[t + 1]), lp, top))
    best = int(last.argmax())
    top = () if last_top is None else tuple(zip(last_top.indices.tolist(),
                                                last_top.values.tolist(), strict=True))
    return out, Token(best, float(last[best]), top)


def score_prompts(model: Any, prompts: Sequence[Sequence[int]], k: int, vocab_size: int,
                  threads: int | None) -> list[tuple[list[Token], Token]]:
    """:func:`prompt_tokens` of each prompt, on the calling thread with ``threads`` torch
    threads (the server's --threads: torch's thread count is per thread, and a worker
    thread left at the default oversubscribes a busy machine)."""
    if threads is not None:
        torch.set_num_threads(threads)
    return [prompt_tokens(model, p, k, vocab_size) for p in prompts]


def completion_logprobs(tokenizer: Any, tokens: Sequence[Token], offset: int) -> dict:
    """Completions' logprobs object; ``offset`` is the text offset of the first token.
    A token without a log-probability (an echoed prompt's first) has null top_logprobs."""
    texts = [_text(tokenizer, t.id) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    tops = []
    for t in tokens:  # tokens with the same text share a key: the likelier one's value
        top: dict[str, float] = {}
        for i, lp in t.top:
            top.setdefault(_text(tokenizer, i), lp)
        tops.append(None if t.logprob is None else top)
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, tokens: Sequence[Token]) -> dict:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(i: int, lp: float) -> dict:
        return {"token": _token(tokenizer, i), "logprob": lp, "bytes": _bytes(tokenizer, i)}
    return {"content": [dict(entry(t.id, t.logprob),
                             top_logprobs=[entry(i, lp) for i, lp in t.top]) for t in tokens]}


def check_prompt(ids: Sequence[int], context_length: int, vocab_size: int) -> None:
    """A prompt that fits the context and the vocabulary, or a RequestError."""
    if not ids:
        raise RequestError("the prompt is empty (0 tokens) and the tokenizer has no "
                           "end-of-text token to start from; send some text", param="prompt")
    if len(ids) > context_length:
        raise RequestError(f"the prompt is {len(ids)} tokens but the model's context length is "
                           f"{context_length}; shorten it to at most {context_length} tokens",
                           param="prompt", code="context_length_exceeded")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="prompt")
