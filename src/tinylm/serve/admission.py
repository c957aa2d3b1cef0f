"""Admission of the explorer's requests (``/v1/explore``, ``/v1/explain``): a memory cost
decided before any work starts, and a queue bounded like the engine's.

A completion's memory is bounded by the engine (``--max-batch`` rows of one KV cache,
allocated once). An explorer request is not: it grows with layers × heads × prompt
tokens (and its passes with the vocabulary). So each one gets an estimate,
:func:`explore_bytes` or :func:`explain_bytes` (the explorer's own upper bound, from
:mod:`tinylm.use.explorer`, plus a fixed overhead), and :class:`WorkQueue` runs requests
only while the estimates of those running add up to at most the budget
(``--explore-memory``), at most ``max_running`` at once; others wait, at most
``max_waiting`` of them (``--max-queue``), each until its deadline (``--timeout``). A
request larger than the whole budget, or than ``--max-explore-tokens``, can never run: a
413 that names the flag raising the limit. A full queue or a wait past the deadline is a
429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tinylm.serve.engine import QueueFull
from tinylm.serve.schemas import RequestError
from tinylm.use.explorer import explain_cost, explore_cost

MIB = 1 << 20
OVERHEAD = 16 * MIB  # a request's fixed part: the trace's small tensors, the interpreter


def explore_bytes(cfg: Any, tokens: int, *, top_k: int = 5, layers: int | None = None) -> int:
    """The memory one ``/v1/explore`` of ``tokens`` tokens may use: the explorer's own
    estimate (:func:`tinylm.use.explorer.explore_cost`, the one home of what its passes
    keep; ``layers``: a request for that many layers' step-by-step part) plus a fixed
    overhead."""
    return OVERHEAD + explore_cost(cfg, tokens, top_k=top_k, layers=layers).bytes


def explain_bytes(cfg: Any, tokens: int, *, top_k: int = 5) -> int:
    """The memory one ``/v1/explain`` may use (:func:`tinylm.use.explorer.explain_cost`
    plus the fixed overhead)."""
    return OVERHEAD + explain_cost(cfg, tokens, top_k=top_k).bytes


def check_explore_size(route: str, tokens: int, cost: int, *, max_tokens: int,
                       budget: int) -> None:
    """A 413 naming the flag when a request is more than the server will ever run."""
    if tokens > max_tokens:
        raise RequestError(f"{route} takes at most {max_tokens} prompt tokens on this server, "
                           f"got {tokens}; send a shorter prompt (the server's "
                           f"--max-explore-tokens raises the limit)", param="prompt",
                           status=413, code="explore_too_large")
    if cost > budget:
        raise RequestError(f"{route} for {tokens} tokens on this model needs about "
                           f"{-(-cost // MIB)} MiB, more than the server's budget of "
                           f"{budget // MIB} MiB for explorer requests; send a shorter prompt "
                           f"(the server's --explore-memory raises the budget)",
                           param="prompt", status=413, code="explore_too_large")


class WorkQueue:
    """Runs blocking functions in threads within a memory budget, first come first
    served; every method is called on the event loop's thread."""

    def __init__(self, budget: int, max_running: int, max_waiting: int) -> None:
        self.budget, self.max_running, self.max_waiting = budget, max_running, max_waiting
        self.used = 0
        self.running = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()
        self._seconds: deque[float] = deque(maxlen=32)  # durations of recent runs

    def _fits(self, cost: int) -> bool:
        return self.running < self.max_running and self.used + cost <= self.budget

    def retry_after(self) -> int:
        """Seconds until a slot likely frees: the queue's turns at the running slots."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        turns = (len(self.waiting) + 1) / max(self.max_running, 1)
        return max(1, round(turns * mean))

    async def run(self, cost: int, deadline: float, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a thread once ``cost`` bytes fit; QueueFull when the queue is
        full or the wait reaches ``deadline`` (a ``time.monotonic()`` value)."""
        if self.waiting or not self._fits(cost):
            await self._wait(cost, deadline)  # returns with the cost reserved
        else:
            self._reserve(cost)
        start = time.monotonic()
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._seconds.append(time.monotonic() - start)
            self._release(cost)
            self._wake()

    def _reserve(self, cost: int) -> None:
        self.used += cost
        self.running += 1

    def _release(self, cost: int) -> None:
        self.used -= cost
        self.running -= 1

    async def _wait(self, cost: int, deadline: float) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(self.retry_after(), self._why(f"{len(self.waiting)} wait"))
        future = asyncio.get_running_loop().create_future()
        entry = (cost, future)
        self.waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future),
                                   max(deadline - time.monotonic(), 0.0))
        except BaseException as exc:  # timed out, or cancelled (the client went away)
            if entry in self.waiting:
                self.waiting.remove(entry)
            elif future.done() and not future.cancelled():
                self._release(cost)  # granted just now: give it back
            future.cancel()
            self._wake()
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                raise QueueFull(self.retry_after(),
                                self._why("this one waited its whole --timeout")) from None
            raise

    def _why(self, waiting: str) -> str:
        return (f": explore and explain requests use {self.used // MIB} of {self.budget // MIB}"
                f" MiB (--explore-memory), {self.running} running, and {waiting} (--max-queue "
                f"{self.max_waiting})")

    def _wake(self) -> None:
        """Admit waiting requests in order while the first one fits (its cost reserved
        for it here, so no later arrival takes its place)."""
        while self.waiting and self._fits(self.waiting[0][0]):
            cost, future = self.waiting.popleft()
            if not future.done():
                self._reserve(cost)
                future.set_result(None)
