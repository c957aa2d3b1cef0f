"""The explorer's admission (issue 32): /v1/explore and /v1/explain get a memory estimate
before any work, run within --explore-memory, wait in a queue of --max-queue for at most
--timeout, and are refused with 413 (never fits) or 429 (busy, Retry-After) naming the
flag. Oracles: the server process's resident memory (psutil, sampled), the queue's own
accounting, and explorer_data for the answers."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    proc_server,
    tiny_model_and_tokenizer,
)
from tinylm.core.config import ModelConfig
from tinylm.serve import app as serve_app_module
from tinylm.serve.admission import MIB, WorkQueue, explain_bytes, explore_bytes
from tinylm.serve.engine import QueueFull
from tinylm.use.explorer import explorer_data

PROMPT = "The cat sat on the mat. A dog ran in the park."  # 30-odd tokens
BIG = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 16384}  # logits: C x 16384


class Sampler:
    """Peak resident memory of a process, sampled every few milliseconds."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.003)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Gauges:
    """The largest values /metrics showed of the explorer's gauges, polled while it runs."""

    def __init__(self, url: str) -> None:
        self.url, self.peak, self._stop = url, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
                name, _, value = line.partition(" ")
                if name in ("tinylm_explore_running", "tinylm_explore_memory_bytes"):
                    self.peak[name] = max(self.peak.get(name, 0.0), float(value))
            time.sleep(0.01)

    def __enter__(self) -> Gauges:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _flood(url: str, n: int) -> list[httpx.Response]:
    """n explore and n completion requests at once, from 2n threads."""
    def explore(_):
        return httpx.post(url + "/v1/explore", json={"prompt": PROMPT, "top_k": 3},
                          timeout=120)

    def complete(_):
        return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0}, timeout=120)
    with ThreadPoolExecutor(2 * n) as pool:
        futures = [pool.submit(f, i) for i in range(n) for f in (explore, complete)]
        return [f.result() for f in futures]


def test_peak_memory_is_bounded_under_30_explores_and_30_completions(tmp_path):
    cost = explore_bytes(ModelConfig(context_length=64, **BIG), 40)
    budget = cost * 3 // 2  # one explore at a time fits, two do not
    spec = {"model": BIG, "settings": {"explore_memory": budget, "max_batch": 32,
                                       "max_queue": 8, "max_tokens": 16}}
    with proc_server(spec, tmp_path / "log") as (url, proc):
        warm = httpx.post(url + "/v1/explore", json={"prompt": PROMPT, "top_k": 3},
                          timeout=60)  # the allocator's first growth is not the request's
        assert warm.status_code == 200
        base = psutil.Process(proc.pid).memory_info().rss
        with Sampler(proc.pid) as rss, Gauges(url) as gauges:
            answers = _flood(url, 30)
        explores, completions = answers[0::2], answers[1::2]
    assert all(r.status_code == 200 for r in completions)  # the engine was not starved
    ok = [r for r in explores if r.status_code == 200]
    busy = [r for r in explores if r.status_code == 429]
    assert len(ok) + len(busy) == 30 and len(ok) >= 9  # 1 running + 8 queued, at least
    assert all(r.json() == warm.json() for r in ok)
    assert busy and all(int(r.headers["retry-after"]) >= 1 for r in busy)
    assert all("--explore-memory" in r.json()["error"]["message"] and "--max-queue 8"
               in r.json()["error"]["message"] for r in busy)
    # the admission itself: never two explores at once, never more reserved than the budget
    assert gauges.peak["tinylm_explore_running"] == 1, gauges.peak
    assert 0 < gauges.peak["tinylm_explore_memory_bytes"] <= budget, gauges.peak
    grown = (rss.peak - base) / MIB
    # one explore's worth (its estimate, an upper bound) and the completions' small change
    # (+64 MiB: RSS also holds what the worker threads' malloc arenas keep after a request;
    # 79-135 MiB measured over five runs against this 106 MiB budget, 147-171 MiB with the
    # budget lifted: the explorer's passes are bounded by themselves, tests/test_explore_memory)
    assert grown < budget / MIB + 64, f"the server grew by {grown:.0f} MiB"


def test_explore_and_explain_too_big_ever_are_413_naming_the_flag():
    model, tok = tiny_model_and_tokenizer()
    n = len(tok.encode(PROMPT))
    with live_server(model, tok, max_explore_tokens=n - 1) as (url, _):
        for route in ("/v1/explore", "/v1/explain"):
            r = httpx.post(url + route, json={"prompt": PROMPT})
            assert r.status_code == 413 and "--max-explore-tokens" in r.json()["error"]["message"]
            assert f"at most {n - 1} prompt tokens" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/explore", json={"prompt": "The cat"})
        assert r.status_code == 200
    need = explore_bytes(model.config, n)
    with live_server(model, tok, explore_memory=need - 1) as (url, _):
        r = httpx.post(url + "/v1/explore", json={"prompt": PROMPT})
        assert r.status_code == 413 and "--explore-memory" in r.json()["error"]["message"]
        assert httpx.post(url + "/v1/explain", json={"prompt": PROMPT}).status_code == (
            200 if explain_bytes(model.config, n) < need else 413)


def test_a_busy_explorer_is_a_429_with_retry_after_and_a_wait_ends_at_the_timeout(
        monkeypatch):
    """One explore holds the budget (a slow explorer_data); with no queue the next is a
    429 at once; with a queue, one waits until --timeout and is then a 429."""
    model, tok = tiny_model_and_tokenizer()
    release, started = threading.Event(), threading.Event()

    def slow(*args, **kw):
        started.set()
        release.wait(30)
        return explorer_data(*args, **kw)
    monkeypatch.setattr(serve_app_module, "explorer_data", slow)
    for queue, timeout in ((0, 60.0), (1, 0.5)):
        started.clear()
        release.clear()
        with live_server(model, tok, max_batch=1, max_queue=queue, timeout=timeout) as (url,
                                                                                        srv):
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(httpx.post, url + "/v1/explore", json={"prompt": "The"},
                                   timeout=60)
                assert started.wait(30)
                text = httpx.get(url + "/metrics").text
                assert "tinylm_explore_running 1" in text and "tinylm_explore_waiting 0" in text
                assert f"tinylm_explore_memory_bytes {srv.explorer.used}" in text
                assert srv.explorer.used == explore_bytes(model.config, 1)
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/explain", json={"prompt": "The cat"}, timeout=60)
                waited = time.monotonic() - t0
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
                msg = r.json()["error"]["message"]
                assert "--explore-memory" in msg and f"--max-queue {queue}" in msg
                assert ("--timeout" in msg) == bool(queue)
                assert (waited >= timeout) if queue else True
                release.set()
                assert held.result().status_code == 200
            assert srv.explorer.used == 0 and srv.explorer.running == 0
            assert not srv.explorer.waiting


def test_work_queue_runs_in_order_within_the_budget():
    """Costs 60 + 60 + 30 with a budget of 100: the first runs, the second waits, and
    the third (which would fit) waits behind it; the queue's own books balance."""
    log, gates = [], {i: threading.Event() for i in range(3)}

    def job(i):
        log.append(("start", i))
        gates[i].wait(10)
        log.append(("end", i))
        return i

    async def go():
        q = WorkQueue(100, max_running=4, max_waiting=2)
        far = time.monotonic() + 30
        tasks = [asyncio.create_task(q.run(c, far, job, i))
                 for i, c in enumerate((60, 60, 30))]
        await asyncio.sleep(0.2)
        assert log == [("start", 0)] and len(q.waiting) == 2 and q.used == 60
        with pytest.raises(QueueFull):  # the queue (2) is full
            await q.run(1, far, job, 9)
        gates[0].set()
        await asyncio.sleep(0.2)
        assert ("start", 1) in log and ("start", 2) in log and q.used == 90
        gates[1].set()
        gates[2].set()
        assert await asyncio.gather(*tasks) == [0, 1, 2]
        assert q.used == 0 and q.running == 0 and not q.waiting
    asyncio.run(go())
