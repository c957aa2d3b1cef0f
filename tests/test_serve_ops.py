"""Operating ``tinylm serve``: ``/metrics`` parsed by the Prometheus client library's own
parser and moving as requests are made (counters, gauges, histograms, cancellations by
stage), request ids in the ``X-Request-Id`` header and in every log line about the
request, and the graceful shutdown on SIGTERM of a real server process (a stream in
flight finishes, or ends with an error event when the timeout is short; exit code 0; one
log line with the counts)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    proc_server,
    tiny_model_and_tokenizer,
    wait_healthy,
)
from tinylm.serve.engine import Engine

MODEL = "tiny"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value, through
    prometheus_client's parser (which refuses malformed text)."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("tinylm_") and family.documentation
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def histogram(samples: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets by bound, sum, count), checked to be a histogram."""
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items()
                     if n == f"tinylm_{name}_bucket")
    counts = [v for _, v in buckets]
    assert buckets and buckets[-1][0] == float("inf") and counts == sorted(counts)
    count = samples[(f"tinylm_{name}_count", ())]
    assert buckets[-1][1] == count
    return buckets, samples[(f"tinylm_{name}_sum", ())], count


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model_and_tokenizer(eos=False)  # every answer runs to max_tokens
    with live_server(model, tok, model_name=MODEL, max_tokens=400, max_batch=4) as (url, s):
        yield url, s, tok


@pytest.fixture
def slow_steps(monkeypatch):
    """Each batched decoding step sleeps 20 ms first (a generation then lasts long
    enough for a client to leave in the middle of it)."""
    step = Engine._step

    def slow(self):
        time.sleep(0.02)
        step(self)
    monkeypatch.setattr(Engine, "_step", slow)


def test_metrics_move_as_requests_are_made(served):
    url, _, tok = served
    before = scrape(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="A dog ran", max_tokens=6,
                                            temperature=0, stream=True))
    assert chunks
    after = scrape(url)

    def moved(name, **labels):
        key = (f"tinylm_{name}", tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert moved("requests_total", endpoint="completions", status="200") == 2
    assert moved("completion_tokens_total") == 8 + 6
    assert moved("prompt_tokens_total") == len(tok.encode("The cat")) + \
        len(tok.encode("A dog ran"))
    assert after[("tinylm_running_requests", ())] == 0
    assert after[("tinylm_queue_depth", ())] == 0
    assert 0 < after[("tinylm_batch_occupancy", ())] <= 1
    _, _, ttft = histogram(after, "time_to_first_token_seconds")
    assert ttft - histogram(before, "time_to_first_token_seconds")[2] == 2
    _, latency_sum, latency = histogram(after, "token_latency_seconds")
    assert latency - histogram(before, "token_latency_seconds")[2] == 7 + 5
    assert latency_sum > 0
    rows, rows_sum, steps = histogram(after, "batch_rows")
    assert steps - histogram(before, "batch_rows")[2] >= 7 + 5 - 7  # overlapping steps
    assert rows[-2][0] == 4  # the last finite bound is --max-batch
    assert rows_sum >= steps  # each step decodes >= 1 row
    assert set(k[1] for k in after if k[0] == "tinylm_cancelled_total") == {
        (("stage", s),) for s in ("body", "queue", "generation", "shutdown")}


def test_a_client_leaving_mid_stream_is_counted(served, slow_steps, caplog):
    url = served[0]
    key = ("tinylm_cancelled_total", (("stage", "generation"),))
    before = scrape(url)[key]
    with caplog.at_level(logging.INFO, logger="tinylm"):
        with httpx.stream("POST", url + "/v1/completions", json={
                "prompt": "The cat", "max_tokens": 300, "stream": True},
                headers={"X-Request-Id": "leaver-1"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then hang up
        deadline = time.monotonic() + 20
        while scrape(url)[key] == before:
            assert time.monotonic() < deadline, "the cancellation was not counted"
            time.sleep(0.05)
    assert scrape(url)[key] == before + 1
    assert scrape(url)[("tinylm_running_requests", ())] == 0
    lines = [r.getMessage() for r in caplog.records if "leaver-1" in r.getMessage()]
    assert len(lines) == 2 and "accepted" in lines[0]
    assert "cancelled (the client left during generation)" in lines[1]


def test_a_client_leaving_while_queued_is_counted(slow_steps):
    """One batch row, held by a stream; a second client gives up while its request
    waits for the row: a cancellation at stage "queue"."""
    model, tok = tiny_model_and_tokenizer(eos=False)
    with live_server(model, tok, max_tokens=400, max_batch=1) as (url, server):
        with httpx.stream("POST", url + "/v1/completions", json={
                "prompt": "The cat", "max_tokens": 100, "stream": True}) as held:
            lines = held.iter_lines()  # (kept: a dropped iterator closes the response)
            next(lines)  # the row is taken
            with pytest.raises(httpx.ReadTimeout):  # gives up, closing its connection
                httpx.post(url + "/v1/completions", timeout=0.5,
                           json={"prompt": "A dog", "max_tokens": 5})
        deadline = time.monotonic() + 20
        while server.metrics.running:
            assert time.monotonic() < deadline, "the requests did not end"
            time.sleep(0.05)
        after = scrape(url)
    assert after[("tinylm_cancelled_total", (("stage", "queue"),))] == 1
    assert after[("tinylm_cancelled_total", (("stage", "generation"),))] == 1  # the stream


def test_request_ids_in_headers_bodies_and_logs(served, caplog):
    url = served[0]
    with caplog.at_level(logging.INFO, logger="tinylm"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 3})
        mine = httpx.post(url + "/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "hi"}]}, headers={"X-Request-Id": "job-42.a:b"})
        odd = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 2,
                                                         "stream": True},
                         headers={"X-Request-Id": "no spaces; " + "x" * 200})
        bad = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": -1},
                         headers={"X-Request-Id": "bad-one"})
    rid = r.headers["x-request-id"]
    assert rid == r.json()["id"] and rid.startswith("cmpl-")  # ours: the body's id
    assert mine.headers["x-request-id"] == "job-42.a:b"  # a client's sane id is kept
    assert mine.status_code == 400  # this model has no chat template
    assert odd.headers["x-request-id"].startswith("cmpl-")  # an odd one is replaced
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-one"
    logs = [rec.getMessage() for rec in caplog.records]
    about = [m for m in logs if rid in m]
    assert len(about) == 2 and "accepted, 1 prompt tokens, 1 choice" in about[0]
    assert f"request {rid}: finished (length), 3 tokens in " in about[1]
    streamed = [m for m in logs if odd.headers["x-request-id"] in m]
    assert "streamed" in streamed[0] and "finished (length), 2 tokens" in streamed[1]


def test_draining_refuses_new_work_and_health_says_so():
    with live_server(model_name=MODEL) as (url, server):
        assert httpx.get(url + "/health").status_code == 200
        server.tracker.start_draining()
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert "shutting down" in r.json()["error"]["message"]


# --- SIGTERM on a real server process -------------------------------------------------------


def _refused(url: str) -> bool:
    """Whether a new request is refused: a 503 server_shutting_down, or no connection
    (the listening socket is closed)."""
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    except httpx.TransportError:
        return True
    return r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def _stream_then_sigterm(url: str, proc: subprocess.Popen, max_tokens: int) -> list[dict]:
    """A streamed completion; SIGTERM once its first chunk arrives; every event after."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "The cat", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)  # the server is draining now
                assert _refused(url)
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_sigterm_lets_a_running_stream_finish_and_exits_0(tmp_path):
    log = tmp_path / "server.log"
    spec = {"step_delay": 0.02, "shutdown_timeout": 30, "settings": {"max_tokens": 100}}
    with proc_server(spec, log) as (url, proc):
        events = _stream_then_sigterm(url, proc, 60)
        assert proc.wait(30) == 0
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text and not any("error" in e for e in events[:-1])
    assert "shut down: 1 requests finished, 0 cancelled" in log.read_text()


def test_sigterm_cancels_what_outlives_the_timeout_and_exits_0(tmp_path):
    log = tmp_path / "server.log"
    spec = {"step_delay": 0.05, "shutdown_timeout": 0.3, "settings": {"max_tokens": 400}}
    whole = []  # a client waiting for a whole (not streamed) answer meanwhile
    with proc_server(spec, log) as (url, proc):
        waiter = threading.Thread(target=lambda: whole.append(httpx.post(
            url + "/v1/completions", timeout=60, json={"prompt": "A dog", "max_tokens": 400})))
        waiter.start()
        deadline = time.monotonic() + 30
        while scrape(url)[("tinylm_running_requests", ())] != 1:  # it is in flight
            assert time.monotonic() < deadline and waiter.is_alive()
            time.sleep(0.02)
        events = _stream_then_sigterm(url, proc, 400)  # 20 s of decoding: cut short
        assert proc.wait(30) == 0
        waiter.join(30)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "server_shutting_down"
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])
    assert whole[0].status_code == 503
    assert whole[0].json()["error"]["code"] == "server_shutting_down"
    logged = log.read_text()
    assert "shut down: 0 requests finished, 2 cancelled (--shutdown-timeout 0.3 s)" in logged
    assert logged.count("cancelled (the server is shutting down)") == 2


def test_tinylm_serve_exits_0_on_sigterm(tmp_path):
    """The real command: SIGTERM, then exit code 0 and the shutdown's log line."""
    from tinylm.io.checkpoint_files import save_checkpoint

    model, tok = tiny_model_and_tokenizer()
    save_checkpoint(tmp_path / "ckpt", model, tok)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(tmp_path / "err.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "serve", "--model",
                             str(tmp_path / "ckpt"), "--port", str(port), "--threads", "1",
                             "--shutdown-timeout", "5"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60, lambda: (tmp_path / "err.log").read_text())
        r = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 2})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        err.close()
    logged = (tmp_path / "err.log").read_text()
    assert "shut down: 0 requests finished, 0 cancelled (--shutdown-timeout 5 s)" in logged
    assert f"request {r.json()['id']}: finished" in logged
