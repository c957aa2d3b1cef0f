"""The life of a generation request in the server, and the server's own end.

Each request gets an id (:func:`request_id`: the client's ``X-Request-Id`` when it is
sane, else one made here in OpenAI's style, ``chatcmpl-...`` / ``cmpl-...``), sent back
in the ``X-Request-Id`` header and named in every log line about the request: accepted
(prompt tokens, choices), finished (reason, tokens, seconds), cancelled (where: waiting
for a row, during generation, or at shutdown), failed.

A :class:`Tracker` holds the completion and chat requests in flight. On SIGTERM or
SIGINT the server drains (:meth:`Tracker.drain`): new requests get 503
``server_shutting_down`` and ``/health`` says not ok, the running ones may finish
within ``--shutdown-timeout`` seconds, then what is left is cancelled (a stream ends
with an error event, a waiting client gets a 503), and one log line says how many
finished and how many were cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING

from tinylm.serve.metrics import Metrics

if TYPE_CHECKING:
    from tinylm.serve.responses import Run

log = logging.getLogger("tinylm.serve")

_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
CANCEL_WAIT = 5.0  # seconds cancelled requests may take to end their responses


def request_id(given: str | None, prefix: str) -> tuple[str, str]:
    """(the request's id, a fresh hex id for its response body): the client's
    ``X-Request-Id`` when it is 1-128 characters of letters, digits and ``._:-``
    (starting with a letter or digit), else ``prefix`` + the hex id."""
    hex_id = uuid.uuid4().hex[:24]
    if given is not None and _SANE_ID.fullmatch(given):
        return given, hex_id
    return f"{prefix}{hex_id}", hex_id


class Tracker:
    """The completion and chat requests in flight, their log lines and counts, and
    the drain at shutdown."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.active: dict[Run, float] = {}  # run -> time.monotonic() at its start
        self.draining = False
        self.outcomes = {"finished": 0, "cancelled": 0, "failed": 0}  # since the drain

    def begin(self, run: Run, stream: bool) -> None:
        self.active[run] = time.monotonic()
        self.metrics.running = len(self.active)
        n = len(run.choices)
        log.info("request %s: accepted, %d prompt tokens, %d choice%s%s", run.request_id,
                 run.usage()["prompt_tokens"], n, "" if n == 1 else "s",
                 ", streamed" if stream else "")

    def end(self, run: Run, outcome: str, detail: str = "") -> None:
        """``run`` is over: ``outcome`` "finished", "cancelled" (the client left, or
        the server stopped it) or "failed" (``detail``: why). Once per run."""
        started = self.active.pop(run, None)
        if started is None:
            return
        self.metrics.running = len(self.active)
        seconds = time.monotonic() - started
        tokens = run.usage()["completion_tokens"]
        if self.draining:
            self.outcomes[outcome] += 1
        if outcome == "finished":
            reasons = ",".join(sorted({c.finish_reason or "?" for c in run.choices}))
            log.info("request %s: finished (%s), %d tokens in %.2f s", run.request_id,
                     reasons, tokens, seconds)
        elif outcome == "cancelled":
            stage = "shutdown" if run.stopping else \
                "generation" if any(c.tokens for c in run.choices) else "queue"
            self.metrics.cancel(stage)
            why = {"shutdown": "the server is shutting down",
                   "generation": "the client left during generation",
                   "queue": "the client left while waiting for a batch row"}[stage]
            log.info("request %s: cancelled (%s) after %d tokens in %.2f s",
                     run.request_id, why, tokens, seconds)
        else:
            log.warning("request %s: failed after %d tokens in %.2f s: %s", run.request_id,
                        tokens, seconds, detail)

    def start_draining(self) -> None:
        """From now on new requests are refused (503) and /health says not ok."""
        if not self.draining:
            self.draining = True
            log.info("shutting down: %d requests running; new requests get 503",
                     len(self.active))

    async def drain(self, timeout: float) -> None:
        """Let the running requests finish within ``timeout`` seconds, then cancel the
        rest and wait (at most CANCEL_WAIT s) for their responses to end; log the count."""
        self.start_draining()
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = list(self.active)
        for run in left:
            run.stop()
        deadline = time.monotonic() + CANCEL_WAIT
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        o = self.outcomes
        log.info("shut down: %d requests finished, %d cancelled (--shutdown-timeout %g s), "
                 "%d failed", o["finished"], o["cancelled"], timeout, o["failed"])
