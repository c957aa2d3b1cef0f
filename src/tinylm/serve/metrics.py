"""Counters and gauges of the server, rendered as Prometheus text (``GET /metrics``).

The engine thread updates them; the HTTP side reads them. Plain attribute updates of
ints and floats are atomic enough under the GIL for monitoring figures.
"""

from __future__ import annotations

import time
from collections import deque

# Upper bounds of the time-to-first-token histogram, seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATE_WINDOW = 10.0  # seconds over which tokens/s is measured


class Metrics:
    """What ``/metrics`` reports: requests by endpoint and status, tokens, the queue
    and batch now, time to first token, and generated tokens/s over the last 10 s."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rejected = 0
        self.cancelled = 0  # clients that left before their request was read
        self.explore = (0, 0, 0)  # explore/explain requests running, waiting, bytes reserved
        self.queue_depth = 0
        self.batch_size = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        # prefix reuse (serve/prefix.py) and prompt-lookup decoding (serve/speculate.py)
        self.prefix_hits = self.prefix_misses = self.prefix_tokens_reused = 0
        self.prefix_bytes = 0
        self.draft_tokens = self.accepted_tokens = 0
        self._done_seconds = deque(maxlen=64)  # durations of recent finished requests
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per event

    def request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def generated(self, n: int, ttft: float | None = None) -> None:
        """n tokens were generated; ``ttft`` when they are a request's first."""
        now = time.monotonic()
        self.completion_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if ttft <= bound:
                    self.ttft_buckets[i] += 1

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

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out = ["# HELP tinylm_requests_total HTTP requests by endpoint and status.",
               "# TYPE tinylm_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(f'tinylm_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for name, kind, help_, value in (
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
            ("completion_tokens_total", "counter", "Tokens generated.",
             self.completion_tokens),
            ("rejected_total", "counter", "Requests refused because the queue was full.",
             self.rejected),
            ("cancelled_total", "counter",
             "Requests cancelled: the client left while sending the body.", self.cancelled),
            ("queue_depth", "gauge", "Requests waiting for a batch row.", self.queue_depth),
            ("explore_running", "gauge", "Explore and explain requests running.",
             self.explore[0]),
            ("explore_waiting", "gauge", "Explore and explain requests waiting for memory.",
             self.explore[1]),
            ("explore_memory_bytes", "gauge",
             "Estimated memory of the explore and explain requests running.", self.explore[2]),
            ("batch_size", "gauge", "Rows in the last decoding step.", self.batch_size),
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
        ):
            out += [f"# HELP tinylm_{name} {help_}", f"# TYPE tinylm_{name} {kind}",
                    f"tinylm_{name} {value}"]
        out += ["# HELP tinylm_time_to_first_token_seconds Time from arrival to first token.",
                "# TYPE tinylm_time_to_first_token_seconds histogram"]
        for bound, n in zip(TTFT_BUCKETS, self.ttft_buckets, strict=True):
            out.append(f'tinylm_time_to_first_token_seconds_bucket{{le="{bound}"}} {n}')
        out += [f'tinylm_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
                f"tinylm_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                f"tinylm_time_to_first_token_seconds_count {self.ttft_count}"]
        return "\n".join(out) + "\n"
