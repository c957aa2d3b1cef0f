"""Helpers for the serve tests: a tiny model with a byte-level BPE tokenizer, and a
live uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tinylm.core.config import ARCH_PRESETS, ModelConfig
from tinylm.core.model import GPT
from tinylm.data.tokenizers import BPETokenizer
from tinylm.serve.app import Server, Settings, create_app
from tinylm.serve.protocol import uvicorn_config

TEXT = ("The cat sat on the mat. A dog ran in the park. Café au lait, naïve façade, "
        "日本語のテキスト. Numbers 0123456789 and more words: attention is all you need. ")


def tiny_model_and_tokenizer(context_length: int = 64, eos: bool = True):
    """A random model whose logits are far apart (weights scaled up), so greedy choices
    are not near-ties that float rounding could flip. Without ``eos`` the tokenizer has
    no end-of-text token, so a generation runs until max_tokens (a row held on purpose)."""
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300,
                             special_tokens=["<|endoftext|>"] if eos else [])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                      context_length=context_length, tie_embeddings=False)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model, tok


def layout_model(layout: str, context_length: int) -> GPT:
    """A random 2-layer, 50-token model (seed 0) of GPT-2's layout ("gpt2", 2 heads) or
    Llama's with grouped-query attention ("llama-gqa": 4 query heads sharing 2 K/V)."""
    torch.manual_seed(0)
    arch = dict(ARCH_PRESETS["llama"], n_head=4, n_kv_head=2) \
        if layout == "llama-gqa" else {"n_head": 2}
    cfg = ModelConfig(**{"vocab_size": 50, "n_layer": 2, "n_embd": 32,
                         "context_length": context_length, "tie_embeddings": False, **arch})
    return GPT(cfg).eval()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and a busy machine makes more threads
    spin; the tests' own reference generations use one too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextmanager
def live_server(model=None, tokenizer=None, **settings):
    """(base URL, Server) of a running server; stopped on exit."""
    if model is None:
        model, tokenizer = tiny_model_and_tokenizer()
    settings.setdefault("threads", 1)  # tiny matrices: one thread beats two (and a busy box)
    server = Server(Settings(**settings))
    server.load(model, tokenizer)
    with serve_app(server) as url:
        yield url, server


@contextmanager
def serve_app(server: Server, max_connections: int = 128):
    """The base URL of uvicorn serving ``server``'s app in a thread (with `tinylm
    serve`'s uvicorn limits); stopped on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(create_app(server), log_level="warning",
                            max_connections=max_connections)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()
        server.stop()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, output) -> None:
    """Until ``url``'s /health answers 200; fails with ``output()`` (the server's log) if
    the process ends first, or after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, output()
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


@contextmanager
def proc_server(spec: dict, log: Path):
    """(base URL, Popen) of tests/serve_proc.py serving a tiny model in its own process
    (``spec``: see there), its stderr written to ``log``; healthy on entry, stopped on
    exit."""

    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("serve_proc.py")),
                                 json.dumps(spec)], stdout=subprocess.PIPE, stderr=err)
        try:
            line = proc.stdout.readline().decode()
            assert line.startswith("port "), log.read_text()
            url = f"http://127.0.0.1:{int(line.split()[1])}"
            wait_healthy(url, proc, 60, log.read_text)
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(30)


def run_engine(engine, requests: list[tuple[list[int], int, dict]], timeout: float = 120):
    """Submit ``requests`` ((prompt, max_tokens, Request keyword arguments)) to a started
    engine at once; each one's (token ids, their logprobs, its End) when all ended."""
    from tinylm.serve.engine import Request, Token

    results = [([], [], None) for _ in requests]
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            if isinstance(ev, Token):
                results[i][0].append(ev.id)
                results[i][1].append(ev.logprob)
            else:
                results[i] = (*results[i][:2], ev)
                done.release()
        return emit
    engine.submit([Request(p, n, emitter(i), **kw) for i, (p, n, kw) in enumerate(requests)])
    for _ in requests:
        assert done.acquire(timeout=timeout), "the engine did not answer in time"
    return results
