"""A fuzz campaign against a live server in its own process (issue 32): over 1,000
malformed requests — every route and method, random JSON shapes and values, bytes that
are not JSON, wrong content types, bad Host and Authorization headers, and raw-socket
connections that send broken, slow or cut requests — give no 5xx, no traceback in the
server's log, and the server answers a normal request exactly as before.

Hypothesis draws the cases (derandomized: the same cases each run, so the suite is
stable); the server runs with one-second head and body timeouts so slow connections
end quickly. Bounded: about 1,000 HTTP cases and 200 raw ones, well under a minute."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_support import proc_server

SPEC = {"model": {"context_length": 32}, "chat": True, "header_timeout": 0.25, "body_timeout": 0.25,
        "settings": {"model_name": "tiny", "max_tokens": 4, "max_batch": 8, "max_queue": 16,
                     "max_explore_tokens": 24, "timeout": 10.0}}
ROUTES = ["/", "/explorer", "/health", "/metrics", "/v1/models", "/v1/models/",
          "/v1/completions", "/v1/chat/completions", "/v1/explain", "/v1/explore",
          "/v1/completions/", "/v1/nowhere", "/v1/completions?stream=true", "/%00", "//x/",
          "/v1/../health", "/" + "a" * 3000]
POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/explain", "/v1/explore"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "n", "stop", "seed", "logprobs", "top_logprobs", "echo", "stream",
          "stream_options", "model", "presence_penalty", "frequency_penalty", "logit_bias",
          "layers", "layer", "head", "include_usage", "role", "content"]
SCALARS = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.sampled_from([0, 1, 2, 3, -1, 4, 5, 8, 16, 31, 32, 33, 10 ** 9, 2 ** 63])
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["The cat", "tiny", "user", "text", "",
                                                    "<|endoftext|>", "\ud800", "日本語"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), kids,
                                      max_size=4), max_leaves=10)
BODY = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=7)
CTYPES = ["application/json", "application/json; charset=utf-8", "text/plain", None,
          "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
          "application/json; charset=utf-16", "APPLICATION/JSON", "*/*", b"\xe9\x7f"]


BODIES = st.one_of(
    BODY.map(lambda b: json.dumps(b).encode("utf-8", "surrogatepass")),
    JSON.map(lambda b: json.dumps(b).encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),
    BODY.map(lambda b: json.dumps(b).encode()[:max(1, len(json.dumps(b)) // 2)]),
    st.sampled_from([b"", b"{", b"[" * 5000, b"\xff\xfe{}", b'{"prompt": "x"' + b" " * 9000,
                     b'{"prompt": [1e999]}', b'{"prompt": NaN}', b'{"prompt":"\\ud800"}']),
)


VALID = {"/v1/completions": {"prompt": "The cat", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2},
         "/v1/explain": {"prompt": "The cat"}, "/v1/explore": {"prompt": "The cat"}}


def _one_in(n: int):
    """True about once in n draws (st.integers favours its bounds)."""
    return st.sampled_from([False] * (n - 1) + [True])


@st.composite
def http_case(draw):
    route = draw(st.sampled_from(ROUTES) if draw(_one_in(4)) else st.sampled_from(POSTS))
    method = draw(st.sampled_from(METHODS)) if route not in POSTS or draw(_one_in(6)) \
        else "POST"
    headers = {}
    ctype = draw(st.sampled_from(CTYPES) if draw(_one_in(4)) else st.just("application/json"))
    if ctype is not None:
        headers["Content-Type"] = ctype
    if draw(_one_in(8)):
        headers["Host"] = draw(st.sampled_from(["evil.example", "localhost", "[::1]",
                                                "127.0.0.1:1", "", "a" * 300, "localhost:x",
                                                b"\xff\xfe", "[::1"]))
    if draw(_one_in(8)):
        headers["Authorization"] = draw(st.sampled_from([
            "Bearer", "Bearer x", "Basic Og==", "bearer  tiny", ("Bearer " + "é" * 9).encode()]))
    if draw(_one_in(8)):
        headers["Accept-Encoding"] = draw(st.sampled_from(["gzip", "identity", "br"]))
    if method in ("GET", "HEAD"):
        body = b""
    elif route in VALID and draw(st.booleans()):  # a valid body with a few fields changed
        changed = VALID[route] | draw(st.dictionaries(st.sampled_from(FIELDS), JSON,
                                                      max_size=3))
        body = json.dumps(changed).encode("utf-8", "surrogatepass")
    else:
        body = draw(BODIES)
    return method, route, headers, body


HEADS = [b"POST /v1/completions HTTP/1.1\r\n", b"GET /health HTTP/1.1\r\n",
         b"POST /v1/explore HTTP/1.1\r\n", b"GET / HTTP/1.0\r\n", b"BREW /pot HTCPCP/1.0\r\n",
         b"POST /v1/chat/completions HTTP/1.1\r\n", b"GET /v1/models HTTP/2.0\r\n",
         b"\r\n\r\n", b"GET /\x00 HTTP/1.1\r\n", b"POST /v1/explain HTTP/1.1\r\n"]
LINES = [b"Host: 127.0.0.1\r\n", b"Host: evil.example\r\n", b"Content-Type: application/json\r\n",
         b"Content-Type: text/plain\r\n", b"Content-Length: 20\r\n", b"Content-Length: -1\r\n",
         b"Content-Length: 99999999999\r\n", b"Content-Length: x\r\n",
         b"Transfer-Encoding: chunked\r\n", b"Connection: close\r\n", b"Expect: 100-continue\r\n",
         b"X: " + b"y" * 20000 + b"\r\n", b"Bad Header\r\n", b": empty\r\n",
         b"Host: 127.0.0.1\r\nHost: localhost\r\n",
         b"Connection: upgrade\r\nUpgrade: websocket\r\n"]
TAILS = [b"\r\n", b"\r\n" + b'{"prompt": "The cat", "max_tokens": 2}', b"\r\n{\"pro",
         b"\r\n5\r\n{\"pro\r\nzz\r\n", b"\r\n0\r\n\r\n", b"", b"\r\n" + b"x" * 100]


@st.composite
def raw_case(draw):
    """(pieces to send, the pause between them, how the client ends): a broken request,
    or a well-formed POST whose body is cut short, sent slowly or in pieces."""
    if draw(st.booleans()):
        body = json.dumps(draw(st.sampled_from(list(VALID.items())))[1]).encode()
        route = draw(st.sampled_from(POSTS))
        declared = len(body) + draw(st.sampled_from([0, 0, 1, 50]))
        data = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                f"\r\nContent-Length: {declared}\r\n").encode() \
            + b"".join(draw(st.lists(st.sampled_from(LINES), max_size=2))) + b"\r\n" \
            + body[:draw(st.integers(0, len(body)))]
    else:
        head = draw(st.sampled_from(HEADS))
        lines = draw(st.lists(st.sampled_from(LINES), max_size=5))
        tail = draw(st.sampled_from(TAILS) | st.binary(max_size=40))
        data = head + b"".join(lines) + tail
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)], strict=True)]
    return pieces, draw(st.sampled_from([0.0, 0.0, 0.02, 0.1])), draw(
        st.sampled_from(["read", "read", "cut", "half"]))


def _status_of(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])


def _send_raw(port: int, pieces: list[bytes], pause: float, end: str) -> bytes:
    """Send pieces with pauses; then cut, half-close or just wait; what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
                time.sleep(pause)
            if end == "cut":
                return b""
            if end == "half":
                s.shutdown(socket.SHUT_WR)
            answer = b""
            s.settimeout(2.0)  # more than the server's head and body timeouts
            while len(answer) < 1 << 16:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
                if b"\r\n\r\n" in answer:
                    break  # the head of the answer is enough
            return answer
        except OSError:  # reset, not connected, timed out: the server closed it
            return b""


def _normal(url: str) -> list:
    """What a normal client gets: a greedy completion, an explore and the model list."""
    c = httpx.post(url + "/v1/completions", json={"prompt": "The cat sat", "max_tokens": 4,
                                                  "temperature": 0, "logprobs": 2})
    e = httpx.post(url + "/v1/explore", json={"prompt": "The cat sat", "top_k": 3})
    m = httpx.get(url + "/v1/models")
    assert c.status_code == e.status_code == m.status_code == 200
    comp = c.json()
    return [comp["choices"], comp["usage"], e.json(), m.json()]


BATCH = 8  # cases sent at once, each on its own connection (a round trip here is ~40 ms)
# a fresh connection per case: the server's 0.25 s head timeout closes idle ones, and a
# request racing that close would be reset (a keep-alive race, not the server's answer)
NO_KEEP_ALIVE = httpx.Limits(max_keepalive_connections=0)


def test_fuzzed_requests_never_get_a_5xx_or_a_traceback(tmp_path):
    log = tmp_path / "server.log"
    statuses: list[int] = []
    start = time.monotonic()
    with proc_server(SPEC, log) as (url, _), httpx.Client(
            base_url=url, timeout=30, limits=NO_KEEP_ALIVE) as client, \
            ThreadPoolExecutor(BATCH) as pool:
        port = int(url.rsplit(":", 1)[1])
        before = _normal(url)

        def send(case):
            method, route, headers, body = case
            r = client.request(method, route, headers=headers, content=body)
            statuses.append(r.status_code)
            assert r.status_code < 500, (case, r.status_code, r.text[:300])
            if r.status_code >= 400 and route.startswith("/v1") and method != "HEAD":
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, case

        def connect(case):
            status = _status_of(_send_raw(port, *case))
            statuses.append(-1 if status is None else status)
            assert status is None or status < 500, (case, status)

        @settings(max_examples=1000 // BATCH, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases=st.lists(http_case(), min_size=BATCH, max_size=BATCH))
        def requests_at_once(cases):
            for f in [pool.submit(send, c) for c in cases]:
                f.result()

        @settings(max_examples=200 // BATCH, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases=st.lists(raw_case(), min_size=BATCH, max_size=BATCH))
        def connections_at_once(cases):
            for f in [pool.submit(connect, c) for c in cases]:
                f.result()

        requests_at_once()
        connections_at_once()
        after = _normal(url)
    text = log.read_text()
    elapsed = time.monotonic() - start
    counts = Counter(statuses)
    assert sum(counts.values()) >= 1200 and not [s for s in counts if s >= 500], counts
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
    assert after == before
    assert elapsed < 180, elapsed  # bounded (under a minute on an idle 2-core machine)
    for status in (200, 400, 404, 405, 415, 421, -1):  # the cases reach every kind of end
        assert counts[status], counts
