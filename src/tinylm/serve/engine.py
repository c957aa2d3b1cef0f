"""Continuous batching: every active request decodes in one batched step.

A request's prompt is prefilled alone in a one-row cache by the decoding plan
:func:`tinylm.generate` uses (``acceleration.plan(model).decoder(1)``: the same
prefill), its first token sampled, and its keys and values copied into a row of one
:class:`~tinylm.core.decoding.RaggedKVCache`. From the next step on it decodes together
with every other active request: one step of ids (rows,) in which each row has its own
position and sees only its own keys, so its answer is the one it would get alone. The
step is ``acceleration.plan(model).ragged_decoder(max_batch)``: the fused native step
(fp32, int8 and GGUF-block layers; GPT-2's layout or the variants') where the plan
takes the model, else the model's own forward -- one decision, logged at start. A
request leaves the batch when it ends (end-of-text, ``max_tokens``, its deadline, or a
cancel — a client that went away or a stop string), and its row is freed at that step
(the last row moves into it). Sampling parameters and seeds are
per request. Requests beyond ``max_batch`` wait in a queue of at most ``max_queue``;
beyond that :meth:`Engine.submit` raises :class:`QueueFull`.

Two options: a prefix cache (:mod:`tinylm.serve.prefix`) lets a prompt reuse the keys
and values of an earlier prompt's identical start instead of prefilling it again; and
prompt-lookup decoding (:mod:`tinylm.serve.speculate`) feeds a greedy row its last token
and a draft copied from its own sequence in the same batched forward, ids (rows, C),
keeping the draft tokens the model's own choices confirm.

The loop runs in one background thread. Results go back through each request's
``emit`` callback, called from that thread with :class:`Token` and :class:`End` events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tinylm import acceleration
from tinylm.core.decoding import KVCache
from tinylm.core.model import GPT
from tinylm.serve.metrics import Metrics
from tinylm.serve.prefix import PrefixCache
from tinylm.serve.speculate import DRAFT_TOKENS, NgramLookup
from tinylm.use.sampling import SamplingConfig, sample_next

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The engine's queue is full; ``retry_after`` is a hint in seconds; ``why`` names
    the limit that was reached."""

    def __init__(self, retry_after: int, why: str = "") -> None:
        super().__init__(f"the server is at capacity{why}; retry after {retry_after} s")
        self.retry_after = retry_after


class NeverFits(Exception):
    """A request of more sequences than the batch and the queue can ever hold."""

    def __init__(self, count: int, capacity: int) -> None:
        super().__init__(f"{count} sequences can never fit a batch and queue of {capacity}")
        self.count, self.capacity = count, capacity


NON_FINITE = ("non-finite logits (inf or nan): the model's weights overflow float32 in the "
              "forward pass on this prompt")


@dataclass(frozen=True)
class Token:
    """One generated token: its id, log-probability, and the top alternatives
    (id, log-probability) when the request asked for them."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class End:
    """The request is over: reason is "stop" (end-of-text), "length" (max_tokens or
    the deadline), "cancelled" or "error" (with a message: non-finite logits, or a bug)."""

    reason: str
    message: str = ""


@dataclass
class Request:
    """One sequence to generate. ``logprobs`` None computes none; k >= 0 computes the
    chosen token's and the k most likely ones'. ``vocab_size`` restricts sampling to
    the tokenizer's ids. ``deadline`` is a ``time.monotonic()`` value. ``constraint``
    (a :class:`tinylm.serve.constrain.Constraint`) holds the output to a grammar."""

    prompt: Sequence[int]
    max_tokens: int
    emit: Callable[[Token | End], None]
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(0.0))
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    vocab_size: int | None = None
    deadline: float = float("inf")
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)
    constraint: Any = None

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (thread-safe)."""
        self.cancelled = True


class _Row:
    """An active request's state: its tokens so far and its random generator."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.seq = list(req.prompt)
        self.generated = 0
        self.last_token: float | None = None  # time.monotonic() of its latest token
        self.lookup: NgramLookup | None = None  # its draft proposer, if it speculates
        self.generator = None
        if req.seed is not None and not req.sampling.greedy:
            self.generator = torch.Generator().manual_seed(int(req.seed))


class Engine:
    """The batching loop over ``model`` (a GPT in eval mode; moved to no device).

    ``max_batch`` rows decode together; ``max_queue`` more may wait for a row;
    ``threads`` sets torch's intra-op threads of the loop's thread. ``prefix_cache``
    bytes of prompt keys and values are kept for reuse (0: none; :mod:`.prefix`);
    ``speculate="ngram"`` verifies up to ``draft_tokens`` prompt-lookup draft tokens per
    greedy row in each step (:mod:`.speculate`). Start with :meth:`start` (or use as a
    context manager); :meth:`stop` ends the thread and every request still in it.
    """

    def __init__(self, model: GPT, *, max_batch: int = 16, max_queue: int = 64,
                 threads: int | None = None, metrics: Metrics | None = None,
                 prefix_cache: int = 0, speculate: str | None = None,
                 draft_tokens: int = DRAFT_TOKENS) -> None:
        if speculate not in (None, "ngram"):
            raise ValueError(f"speculate must be None or 'ngram', got {speculate!r}")
        self.model = model.eval()
        self.threads = threads
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = model.config.context_length
        self.metrics = metrics or Metrics(max_batch)
        plan = acceleration.plan(model)
        self.decoder = plan.ragged_decoder(max_batch)  # the batched step (path, reason)
        self.cache = self.decoder.cache
        self._prefiller = plan.decoder(1)  # a prompt alone, prefilled as generate does
        self.rows: list[_Row] = []  # row i of the cache is rows[i]
        self.prefix = PrefixCache(prefix_cache) if prefix_cache > 0 else None
        self.speculate, self.draft_tokens = speculate, draft_tokens
        self.pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._masker: ThreadPoolExecutor | None = None  # constrained rows' masks

    # -- control -----------------------------------------------------------------------

    def start(self) -> Engine:
        if self.decoder.reason is None:
            log.info("serving on the fused native step (%s)", self.decoder.path)
        else:
            log.info("serving on the reference step: %s", self.decoder.reason)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="tinylm-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._masker is not None:
            self._masker.shutdown()
            self._masker = None
        for req in [r.req for r in self.rows] + list(self.pending):
            req.emit(End("cancelled", "the server is shutting down"))
        self.rows.clear()
        self.pending.clear()
        self.cache.reset()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (all or none); QueueFull when they do not fit now, NeverFits
        when they never can (more than max_batch + max_queue)."""
        if len(requests) > self.max_batch + self.max_queue:
            raise NeverFits(len(requests), self.max_batch + self.max_queue)
        with self._cv:
            free_rows = self.max_batch - len(self.rows)
            if len(self.pending) + len(requests) > self.max_queue + free_rows:
                self.metrics.rejected += len(requests)
                raise QueueFull(self._retry_after(),
                                f": {len(self.rows)} sequences decode (--max-batch "
                                f"{self.max_batch}) and {len(self.pending)} wait (--max-queue "
                                f"{self.max_queue}), raised by those flags")
            self.pending.extend(requests)
            self.metrics.queue_depth = len(self.pending)
            self._cv.notify()

    def _retry_after(self) -> int:
        """Seconds until a queue slot likely frees: the queue's turns at the batch."""
        turns = len(self.pending) / max(self.max_batch, 1)
        return max(1, round(turns * self.metrics.mean_request_seconds()))

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while self._running and not self.pending and not self.rows:
                        self._cv.wait()
                    if not self._running:
                        return
                    admit = []
                    while self.pending and len(self.rows) + len(admit) < self.max_batch:
                        admit.append(self.pending.popleft())
                    self.metrics.queue_depth = len(self.pending)
                try:
                    for req in admit:
                        self._join(req)
                    self._drop_finished()
                    if self.rows:
                        self._step()
                except Exception as exc:  # a bug: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(admit, f"internal error in the decoding step: {exc}")

    def _fail_all(self, admitted: list[Request], message: str) -> None:
        reqs = {id(r.req): r.req for r in self.rows}
        reqs.update((id(r), r) for r in admitted)
        for req in reqs.values():
            req.emit(End("error", message))
        self.rows.clear()
        self.cache.reset()

    def _prefill(self, tokens: Sequence[int]) -> tuple[Tensor, KVCache]:
        """tokens (T,) alone through the model: (logits of the last position (V,),
        the filled one-row cache, valid until the next prefill). tinylm.generate's own
        prefill (its decoding plan's), or, with a prefix cache, its cached prefix copied
        and the rest run after it by that same plan (``Decoder.extend``)."""
        if self.prefix is not None:
            out = self.prefix.prefill(self.model, tokens, self.context, self._prefiller)
            self.metrics.prefix_cache(self.prefix)
            return out
        ids = torch.tensor([list(tokens)], dtype=torch.long)  # (1, T)
        return self._prefiller.prefill(ids)[0], self._prefiller.cache  # (V,)

    def _join(self, req: Request) -> None:
        """Prefill ``req``, emit its first token and give it a row unless it ended."""
        if req.cancelled:
            req.emit(End("cancelled"))
            return
        if time.monotonic() > req.deadline:  # it waited in the queue for all its time
            req.emit(End("length", "the request's time limit was reached in the queue"))
            return
        row = _Row(req)
        if self.speculate and req.sampling.greedy and req.constraint is None:
            row.lookup = NgramLookup()
        logits, cache = self._prefill(row.seq[-self.context:])
        self.metrics.prompt_tokens += len(row.seq)
        end = self._take(row, logits[None], first=True)
        if end is not None:
            self.metrics.finished(time.monotonic() - req.submitted)
            req.emit(end)
            return
        self.cache.put(len(self.rows), cache)
        self.rows.append(row)
        self.cache.rows = len(self.rows)

    def _drop_finished(self) -> None:
        """Free the rows of cancelled or timed-out requests (before the step)."""
        now = time.monotonic()
        for i in reversed(range(len(self.rows))):
            req = self.rows[i].req
            if req.cancelled:
                self._free(i, End("cancelled"))
            elif now > req.deadline:
                self._free(i, End("length", "the request's time limit was reached"))

    def _free(self, i: int, end: End) -> None:
        row = self.rows[i]
        self.cache.remove(i)
        self.rows[i] = self.rows[-1]
        self.rows.pop()
        self.metrics.finished(time.monotonic() - row.req.submitted)
        row.req.emit(end)

    def _step(self) -> None:
        """One batched forward of every row's last token, then each row's next token."""
        for i, row in enumerate(self.rows):
            if int(self.cache.lengths[i]) >= self.context:  # full: slide the window
                self._slide(i, row)
        drafts = self._drafts() if self.speculate else None
        if drafts is not None:
            self._verify(drafts)
            return
        ids = torch.tensor([r.seq[-1] for r in self.rows], dtype=torch.long)  # (rows,)
        self.metrics.step(len(self.rows))
        masks = self._masks_begin()
        logits = self.decoder.step(ids)  # (rows, V)
        if masks is not None:
            masks.result()
        greedy = logits.argmax(-1).tolist() if any(r.req.sampling.greedy for r in self.rows) \
            else None
        for i in reversed(range(len(self.rows))):
            row = self.rows[i]
            end = self._take(row, logits[i:i + 1], greedy_id=greedy[i] if greedy else None)
            if end is not None:
                self._free(i, end)

    def _drafts(self) -> list[list[int]] | None:
        """Each row's draft tokens (none for a row that does not speculate), each short
        enough to fit the context and the row's max_tokens; None when no row has any."""
        room = self.context - self.cache.length - 1  # positions after the fed token
        drafts = []
        for row in self.rows:
            k = min(self.draft_tokens, room, row.req.max_tokens - row.generated - 1)
            drafts.append(row.lookup.propose(row.seq, k) if row.lookup is not None else [])
        return drafts if any(drafts) else None

    def _verify(self, drafts: list[list[int]]) -> None:
        """One batched forward of every row's last token and its draft (padded to the
        longest, ids (rows, C)); each row takes tokens through :meth:`_take` while they
        equal its draft, then keeps in the cache only the positions of what it took.
        This forward is the model's own (the fused step feeds one token per row), on the
        same cache; its choices equal the step's where logits are not near-ties."""
        C = 1 + max(len(d) for d in drafts)
        ids = torch.tensor([[r.seq[-1], *d] + [0] * (C - 1 - len(d))
                            for r, d in zip(self.rows, drafts, strict=True)])  # (rows, C)
        before = self.cache.lengths[:len(self.rows)].tolist()
        self.metrics.step(len(self.rows))
        masks = self._masks_begin()  # constrained rows (never drafting) take one token
        logits = self.model(ids, self.cache)  # (rows, C, V)
        if masks is not None:
            masks.result()
        greedy = logits.argmax(-1).tolist()  # (rows, C)
        for i in reversed(range(len(self.rows))):
            row, draft = self.rows[i], drafts[i]
            for j in range(len(draft) + 1):
                end = self._take(row, logits[i, j:j + 1], greedy_id=greedy[i][j])
                if end is not None or j == len(draft) or row.seq[-1] != draft[j]:
                    break
            self.metrics.speculated(len(draft), j)
            self.cache.truncate(i, before[i] + j + 1)  # its token and the j accepted
            if end is not None:
                self._free(i, end)

    def _masks_begin(self) -> Future | None:
        """Start the constrained rows' allowed-token masks in a worker thread, to run
        while the batched forward does (llguidance releases the GIL); None when no row
        is constrained (then nothing is done for masks at all)."""
        constraints = [r.req.constraint for r in self.rows if r.req.constraint is not None]
        if not constraints:
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="tinylm-mask")
        return self._masker.submit(lambda: [c.fill() for c in constraints])

    def _slide(self, i: int, row: _Row) -> None:
        """Restart row i on its last context - 2 tokens before its last one, as
        tinylm.generate restarts its cache on the last context - 1 (which then
        include the token this step feeds)."""
        _, cache = self._prefill(row.seq[-(self.context - 1):-1])
        self.cache.put(i, cache)

    def _take(self, row: _Row, logits: Tensor, first: bool = False,
              greedy_id: int | None = None) -> End | None:
        """Choose row's next token from logits (1, V) and emit it; its End if it ended
        (an error End, and no token, when the logits are not all finite)."""
        req = row.req
        if req.vocab_size is not None:
            logits = logits[:, :req.vocab_size]
        if not bool(torch.isfinite(logits).all()):
            log.warning("a request ended: %s", NON_FINITE)
            return End("error", NON_FINITE)
        choose = logits  # a constrained row chooses among the tokens its grammar allows
        if req.constraint is not None:
            choose, greedy_id = req.constraint.apply(logits), None
            if choose is None:
                return End("error", req.constraint.error())
        if req.sampling.greedy:
            token = greedy_id if greedy_id is not None and greedy_id < logits.shape[-1] \
                else int(choose.argmax(-1))
        else:
            token = int(sample_next(choose.float(), req.sampling, row.generator))
        row.seq.append(token)
        row.generated += 1
        now = time.monotonic()
        if first:
            self.metrics.generated(1, ttft=now - req.submitted)
        else:
            self.metrics.generated(1, latency=now - row.last_token)
        row.last_token = now
        req.emit(self._token(token, logits[0], req.logprobs))  # the model's own logprobs
        if token in req.stop_ids:
            return End("stop")
        if req.constraint is not None and (end := req.constraint.advance(token)) is not None:
            return end
        if row.generated >= req.max_tokens:
            return End("length")
        return None

    @staticmethod
    def _token(token: int, logits: Tensor, k: int | None) -> Token:
        if k is None:
            return Token(token)
        logp = F.log_softmax(logits.float(), dim=-1)  # (V,)
        top = ()
        if k > 0:
            values, ids = torch.topk(logp, min(k, logp.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return Token(token, float(logp[token]), top)
