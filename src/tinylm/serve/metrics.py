"""Counters, gauges and histograms of the server, rendered as Prometheus text
(``GET /metrics``, text exposition format 0.0.4).

The engine thread updates them; the HTTP side reads them. Plain attribute updates of
ints and floats are atomic enough under the GIL for monitoring figures; a histogram's
observation takes its own small lock so that its buckets, sum and count agree.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

# Upper bounds of the time-to-first-token histogram, seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Upper bounds of the per-token latency histogram (between a sequence's tokens), seconds.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW = 10.0  # seconds over which tokens/s is measured
CANCEL_STAGES = ("body", "queue", "generation", "shutdown")  # where a request was cancelled


def row_buckets(max_batch: int) -> tuple[int, ...]:
    """Upper bounds of the rows-per-step histogram: powers of two below ``max_batch``,
    then ``max_batch`` itself."""
    bounds, b = [], 1
    while b < max_batch:
        bounds.append(b)
        b *= 2
    return (*bounds, max_batch)


def _number(v: float) -> str:
    """A sample value or bucket bound as Prometheus writes it (ints without a point)."""
    if isinstance(v, int):
        return str(v)
    return repr(round(v, 6)) if v == v and abs(v) != float("inf") else str(v)


class Histogram:
    """A Prometheus histogram: cumulative ``_bucket{le=...}`` counts, ``+Inf``,
    ``_sum`` and ``_count``."""

    def __init__(self, name: str, help_: str, bounds: Sequence[float]) -> None:
        self.name, self.help, self.bounds = name, help_, tuple(bounds)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            self.count += 1
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self.counts[i] += 1
                    break

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        out = [f"# HELP tinylm_{self.name} {self.help}", f"# TYPE tinylm_{self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, counts, strict=True):
            cumulative += n
            out.append(f'tinylm_{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out += [f'tinylm_{self.name}_bucket{{le="+Inf"}} {count}',
                f"tinylm_{self.name}_sum {_number(float(total))}",
                f"tinylm_{self.name}_count {count}"]
        return out


class Metrics:
    """What ``/metrics`` reports: requests by endpoint and status, tokens, the queue
    and batch now, running requests, cancellations by stage, time to first token and
    per-token latency, and generated tokens/s over the last 10 s."""

    def __init__(self, max_batch: int = 16) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rejected = 0
        self.cancelled = dict.fromkeys(CANCEL_STAGES, 0)  # requests, by where they were
        self.explore = (0, 0, 0)  # explore/explain requests running, waiting, bytes reserved
        self.queue_depth = 0
        self.batch_size = 0
        self.max_batch = max_batch
        self.running = 0  # generation requests in flight (HTTP side)
        self.ttft = Histogram("time_to_first_token_seconds",
                              "Time from arrival to a sequence's first token.", TTFT_BUCKETS)
        self.token_latency = Histogram(
            "token_latency_seconds", "Time between a sequence's consecutive tokens.",
            TOKEN_BUCKETS)
        self.batch_rows = Histogram("batch_rows", "Rows decoded in each batched step.",
                                    row_buckets(max_batch))
        # prefix reuse (serve/prefix.py) and prompt-lookup decoding (serve/speculate.py)
        self.prefix_hits = self.prefix_misses = self.prefix_tokens_reused = 0
        self.prefix_bytes = 0
        self.draft_tokens = self.accepted_tokens = 0
        self._done_seconds = deque(maxlen=64)  # durations of recent finished requests
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per event

    def request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def cancel(self, stage: str) -> None:
        """A request was cancelled at ``stage`` (one of CANCEL_STAGES)."""
        self.cancelled[stage] += 1

    def generated(self, n: int, ttft: float | None = None,
                  latency: float | None = None) -> None:
        """n tokens were generated; ``ttft`` when they are a sequence's first,
        ``latency`` the time since that sequence's previous token otherwise."""
        now = time.monotonic()
        self.completion_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        if ttft is not None:
            self.ttft.observe(ttft)
        if latency is not None:
            self.token_latency.observe(latency)

    def step(self, rows: int) -> None:
        """A batched decoding step of ``rows`` rows."""
        self.batch_size = rows
        self.batch_rows.observe(rows)

    def prefix_cache(self, cache) -> None:
        """Copy a :class:`~tinylm.serve.prefix.PrefixCache`'s counters."""
        self.prefix_hits, self.prefix_misses = cache.hits, cache.misses
        self.prefix_tokens_reused, self.prefix_bytes = cache.tokens_reused, cache.nbytes

    def speculated(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def finished(self, seconds: float) -> None:
        self._done_seconds.append(seconds)

    def mean_request_seconds(self) -> float:
        done = list(self._done_seconds)
        return sum(done) / len(done) if done else 1.0

    def tokens_per_second(self) -> float:
        recent = list(self._recent)
        if not recent:
            return 0.0
        span = max(time.monotonic() - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span if span <= RATE_WINDOW else 0.0

    def rows(self) -> list[tuple[str, str, str, float]]:
        """The plain counters and gauges: (name, kind, help, value) rows. Counters of
        other parts of the server (the prefix cache's hits, misses and reused tokens)
        belong here as rows too."""
        return [
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
            ("completion_tokens_total", "counter", "Tokens generated.",
             self.completion_tokens),
            ("rejected_total", "counter", "Requests refused because the queue was full.",
             self.rejected),
            ("queue_depth", "gauge", "Requests waiting for a batch row.", self.queue_depth),
            ("running_requests", "gauge",
             "Completion and chat requests in flight (queued or decoding).", self.running),
            ("explore_running", "gauge", "Explore and explain requests running.",
             self.explore[0]),
            ("explore_waiting", "gauge", "Explore and explain requests waiting for memory.",
             self.explore[1]),
            ("explore_memory_bytes", "gauge",
             "Estimated memory of the explore and explain requests running.", self.explore[2]),
            ("batch_size", "gauge", "Rows in the last decoding step.", self.batch_size),
            ("batch_occupancy", "gauge",
             "Rows in the last decoding step over --max-batch (0 to 1).",
             round(self.batch_size / max(self.max_batch, 1), 6)),
            ("prefix_cache_hits_total", "counter",
             "Prompts that reused cached prefix blocks.", self.prefix_hits),
            ("prefix_cache_misses_total", "counter",
             "Prompts (with a prefix cache) that found no cached block.", self.prefix_misses),
            ("prefix_cache_tokens_reused_total", "counter",
             "Prompt tokens whose keys and values came from the prefix cache.",
             self.prefix_tokens_reused),
            ("prefix_cache_bytes", "gauge", "Bytes of keys and values in the prefix cache.",
             self.prefix_bytes),
            ("draft_tokens_total", "counter", "Prompt-lookup draft tokens verified.",
             self.draft_tokens),
            ("draft_tokens_accepted_total", "counter",
             "Draft tokens equal to the model's own greedy choice.", self.accepted_tokens),
            ("tokens_per_second", "gauge", "Generated tokens per second, last 10 s.",
             round(self.tokens_per_second(), 3)),
        ]

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out = ["# HELP tinylm_requests_total HTTP requests by endpoint and status.",
               "# TYPE tinylm_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(f'tinylm_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        out += ["# HELP tinylm_cancelled_total Requests cancelled, by stage: the client left "
                "while sending its body, waiting for a row, or during generation; or the "
                "server stopped.", "# TYPE tinylm_cancelled_total counter"]
        out += [f'tinylm_cancelled_total{{stage="{stage}"}} {n}'
                for stage, n in self.cancelled.items()]
        for name, kind, help_, value in self.rows():
            out += [f"# HELP tinylm_{name} {help_}", f"# TYPE tinylm_{name} {kind}",
                    f"tinylm_{name} {_number(value)}"]
        for hist in (self.ttft, self.token_latency, self.batch_rows):
            out += hist.render()
        return "\n".join(out) + "\n"
