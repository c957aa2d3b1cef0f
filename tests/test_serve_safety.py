"""The server as a hostile client or a web page would try it (issue 32): the Host check
(DNS rebinding), JSON-only bodies (cross-site text/plain POSTs), head and body timeouts
and the connection cap, a client that leaves mid-body, keys as UTF-8 bytes and their
length at startup, /health without a key, a relative slash redirect, requests that can
never fit the queue, and a model whose logits overflow at run time."""

from __future__ import annotations

import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    serve_app,
    tiny_model_and_tokenizer,
)
from tinylm.core.errors import CheckpointError
from tinylm.serve import app as app_module
from tinylm.serve import protocol
from tinylm.serve.app import Server, Settings
from tinylm.use.sampling import generate_text

KEY = "ключ-доступа-🔑-0123456789"  # outside Latin-1, 26 characters


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, model_name="tiny", max_tokens=16) as (url, server):
        yield url, server, model, tok


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_host_header_must_name_this_server(served):
    url, server = served[0], served[1]
    port = _port(url)
    body = {"prompt": "The", "max_tokens": 2}
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST",
                 f"[::1]:{port}"):
        assert httpx.post(url + "/v1/completions", json=body,
                          headers={"Host": host}).status_code == 200, host
    tokens = server.metrics.prompt_tokens
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 "localhost.:80x", f"127.0.0.2:{port}"):
        r = httpx.post(url + "/v1/completions", json=body, headers={"Host": host})
        assert r.status_code == 421, host
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
        assert httpx.get(url + "/", headers={"Host": host}).status_code == 421
    assert server.metrics.prompt_tokens == tokens  # nothing ran
    with socket.create_connection(("127.0.0.1", port)) as s:  # HTTP/1.0, no Host at all
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


def test_allowed_hosts_and_the_bound_port():
    model, tok = tiny_model_and_tokenizer()
    server = Server(Settings(host="0.0.0.0", allowed_hosts=("box.lan",), threads=1))
    server.load(model, tok)
    with serve_app(server) as url:
        ok = {"Host": "box.lan:1234"}
        assert httpx.get(url + "/health", headers=ok).status_code == 200  # port unknown
        assert httpx.get(url + "/health", headers={"Host": "0.0.0.0"}).status_code == 421
    server = Server(Settings(port=8123, threads=1))  # the port it serves: others refused
    server.load(model, tok)
    with serve_app(server) as url:
        assert httpx.get(url + "/health", headers={"Host": "localhost:8123"}).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "localhost:9"}).status_code == 421
    from tinylm.serve.guard import host_names
    assert host_names("::1", ["Box.LAN:8000", "[fe80::1]", " "]) == {
        "127.0.0.1", "localhost", "::1", "box.lan", "fe80::1"}
    server = Server(Settings(allowed_hosts=("*",), threads=1))
    server.load(model, tok)
    with serve_app(server) as url:
        assert httpx.get(url + "/health", headers={"Host": "any.where"}).status_code == 200


def test_api_posts_take_only_json_bodies(served):
    """A web page can POST text/plain or a form cross-site without a preflight: refused
    with 415 before the body is read or anything runs."""
    url, server = served[0], served[1]
    tokens = server.metrics.prompt_tokens
    body = json.dumps({"prompt": "The", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None, "application/jsonx", "text/json"):
        for route in ("/v1/completions", "/v1/chat/completions", "/v1/explain",
                      "/v1/explore"):
            headers = {} if ctype is None else {"Content-Type": ctype}
            r = httpx.post(url + route, content=body, headers=headers)
            assert r.status_code == 415, (route, ctype)
            assert r.json()["error"]["code"] == "unsupported_media_type"
    assert server.metrics.prompt_tokens == tokens
    r = httpx.post(url + "/v1/completions", content=body,
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sent first is read
    and dropped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_slow_heads_slow_bodies_and_too_many_connections(monkeypatch):
    monkeypatch.setattr(protocol.LimitedH11Protocol, "header_timeout", 0.5)
    monkeypatch.setattr(app_module, "BODY_TIMEOUT", 0.5)
    model, tok = tiny_model_and_tokenizer()
    server = Server(Settings(threads=1))
    server.load(model, tok)
    with serve_app(server, max_connections=4) as url:
        port = _port(url)
        with socket.create_connection(("127.0.0.1", port)) as s:  # a head never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            assert _closed_within(s, 5)
        with socket.create_connection(("127.0.0.1", port)) as s:  # a body never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pr")
            s.settimeout(5)
            answer = b""
            while b"}}" not in answer:
                answer += s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
            assert _closed_within(s, 5)  # then the connection is dropped too
        time.sleep(0.3)  # the server has seen the two above close
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            extra = socket.create_connection(("127.0.0.1", port))
            assert _closed_within(extra, 5)  # the fifth is closed at once
            extra.close()
            held[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            held[0].settimeout(5)
            assert held[0].recv(4096).startswith(b"HTTP/1.1 200")  # the first four live
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        assert httpx.get(url + "/health").status_code == 200  # slots free again


def test_a_client_leaving_mid_body_is_a_cancelled_request(served, caplog):
    url, server = served[0], served[1]
    before = server.metrics.cancelled["body"]
    with caplog.at_level(logging.INFO, logger="tinylm"):
        with socket.create_connection(("127.0.0.1", _port(url))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                      b"{\"prompt\": \"The")
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while server.metrics.cancelled["body"] == before:
            assert time.monotonic() < deadline, "the disconnect was not counted"
            time.sleep(0.02)
    assert server.metrics.cancelled["body"] == before + 1
    mine = [r for r in caplog.records if r.name.startswith("tinylm")]
    assert len(mine) == 1 and "cancelled" in mine[0].getMessage()
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in caplog.text
    text = httpx.get(url + "/metrics").text
    assert 'endpoint="completions",status="499"' in text
    assert f'tinylm_cancelled_total{{stage="body"}} {before + 1}' in text


def test_keys_are_compared_as_utf8_bytes():
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, api_key=KEY) as (url, _):
        good = {"Authorization": b"Bearer " + KEY.encode("utf-8")}
        assert httpx.get(url + "/v1/models", headers=good).status_code == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="x" * 26, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        for given in (b"Bearer " + KEY.encode("utf-8")[:-1], KEY.encode("utf-8"),
                      b"Bearer " + KEY.encode("latin-1", "replace"), b"Basic x"):
            assert httpx.get(url + "/v1/models",
                             headers={"Authorization": given}).status_code == 401


@pytest.mark.parametrize("argv, message", [
    (["--host", "0.0.0.0", "--api-key", "short-key"], "at least 16"),
    (["--host", "0.0.0.0", "--api-key", "   "], "blank"),
    (["--api-key", " "], "blank"),
    (["--host", "0.0.0.0", "--api-key", ""], "blank"),
])
def test_weak_keys_are_refused_at_startup(tmp_path, capsys, monkeypatch, argv, message):
    from tinylm.cli import main

    monkeypatch.delenv("TINYLM_API_KEY", raising=False)
    assert main(["serve", "--model", str(tmp_path / "missing"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_long_enough_key_passes_the_key_check(tmp_path, capsys, monkeypatch):
    from tinylm.cli import main

    monkeypatch.setenv("TINYLM_API_KEY", KEY)
    assert main(["serve", "--model", str(tmp_path / "missing"), "--host", "0.0.0.0"]) == 2
    assert "does not exist" in capsys.readouterr().err  # the next check: the folder


def test_health_without_the_key_says_only_ok_or_not_ok():
    secret = "/home/someone/private/checkpoints/run-7"

    def failing():
        raise CheckpointError(f"{secret} has no model.safetensors")
    server = Server(Settings(api_key=KEY, threads=1), failing)
    with serve_app(server) as url:
        deadline = time.monotonic() + 10
        while server.load_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "not ok"}
        assert secret not in r.text
        r = httpx.get(url + "/health",
                      headers={"Authorization": b"Bearer " + KEY.encode("utf-8")})
        assert r.status_code == 503 and secret in r.json()["message"]
        assert r.json()["state"] == "error"


def test_trailing_slash_redirect_is_relative(served):
    url = served[0]
    r = httpx.get(url + "/v1/models/?x=1", headers={"Host": f"localhost:{_port(url)}"})
    assert r.status_code == 307 and r.headers["location"] == "/v1/models?x=1"
    assert httpx.get(url + "/v1/models/", follow_redirects=True).json()["data"][0]["id"] == \
        "tiny"
    r = httpx.get(url + "//evil.example/")
    assert r.status_code == 404 and "location" not in r.headers


def test_a_request_that_can_never_fit_is_a_400_naming_the_limits():
    """max_batch 2 + max_queue 3 hold 5 sequences: 6 is refused as such on an idle
    server (it used to be a 429 'retry in 1 s' forever); 5 runs."""
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, max_batch=2, max_queue=3) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": ["The", "A", "Cat"], "n": 2,
                                                      "max_tokens": 2})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "--max-batch 2" in msg and "--max-queue 3" in msg and "6 sequences" in msg
        r = httpx.post(url + "/v1/completions", json={"prompt": ["The", "A", "Cat", "Dog",
                                                                 "Sat"], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 5


def _poisoned(everything: bool):
    """The tiny model with huge finite weights: every tensor 3e38 (every prompt
    overflows), or position 10's embedding 3e38 (a sequence that reaches position 10
    overflows to nan there; shorter ones stay finite)."""
    model, tok = tiny_model_and_tokenizer()
    with torch.no_grad():
        if everything:
            for p in model.parameters():
                p.fill_(3e38)
        else:
            model.pos_emb.weight[10].fill_(3e38)
    return model, tok


def test_non_finite_logits_are_a_500_naming_the_model_and_the_server_goes_on(caplog):
    model, tok = _poisoned(everything=True)
    with caplog.at_level(logging.INFO), live_server(model, tok, model_name="huge") as (url, _):
        for route, body in (("/v1/completions", {"prompt": "The cat", "max_tokens": 4}),
                            ("/v1/completions", {"prompt": "The cat", "logprobs": 2}),
                            ("/v1/explain", {"prompt": "The cat"}),
                            ("/v1/explore", {"prompt": "The cat"})):
            r = httpx.post(url + route, json=body)
            assert r.status_code == 500, (route, r.text)
            err = r.json()["error"]
            assert "'huge'" in err["message"] and "non-finite" in err["message"]
        with httpx.stream("POST", url + "/v1/completions", json={
                "prompt": "The", "max_tokens": 4, "stream": True}) as resp:
            frames = [line for line in resp.iter_lines() if line]
        assert "non-finite" in json.loads(frames[-2][6:])["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in caplog.text


def test_a_sequence_that_overflows_fails_alone_while_the_batch_goes_on():
    """Position 10 overflows: a 24-token prompt is a 500, a 6-token one decoding 4 tokens
    next to it (the same batch) gets tinylm's own answer; one that reaches position 10
    while decoding ends there with a 500 (non-streamed) too."""
    model, tok = _poisoned(everything=False)
    want = "".join(p for _, p in generate_text(model, tok, "The cat sat", 4, temperature=0))
    assert len(tok.encode("The cat sat")) == 6
    with live_server(model, tok, model_name="huge") as (url, server), \
            ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, url + "/v1/completions", json={
            "prompt": "The cat sat" * 4, "max_tokens": 16, "temperature": 0})
        good = pool.submit(httpx.post, url + "/v1/completions", json={
            "prompt": "The cat sat", "max_tokens": 4, "temperature": 0})
        assert bad.result().status_code == 500
        assert "'huge'" in bad.result().json()["error"]["message"]
        assert good.result().status_code == 200
        assert good.result().json()["choices"][0]["text"] == want
        late = httpx.post(url + "/v1/completions", json={"prompt": "The cat sat",
                                                         "max_tokens": 16, "temperature": 0})
        assert late.status_code == 500 and "non-finite" in late.json()["error"]["message"]
        assert not server.engine.rows and server.engine._thread.is_alive()
