"""A tiny model served in its own process, as ``tinylm serve`` serves one: run as
``python tests/serve_proc.py SPEC`` (SPEC: JSON {"model": {ModelConfig sizes}, "chat": bool,
"settings": {Settings fields}, "max_connections": N, "header_timeout": S,
"body_timeout": S, "shutdown_timeout": S, "step_delay": S}); it prints
``port N`` on stdout once uvicorn listens on 127.0.0.1:N, and logs (tinylm's at INFO,
uvicorn's warnings) on stderr. The tests read its memory (psutil) and its log. It shuts
down as ``tinylm serve`` does (SIGTERM: drain, exit 0); ``step_delay`` seconds of sleep
before each batched decoding step keep a generation running long enough to be caught
in flight."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from serve_support import TEXT  # noqa: E402
from tinylm.core.config import ModelConfig  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer  # noqa: E402
from tinylm.serve import app as app_module  # noqa: E402
from tinylm.serve import protocol  # noqa: E402
from tinylm.serve.app import Server, Settings, create_app  # noqa: E402
from tinylm.serve.engine import Engine  # noqa: E402


def slow_steps(delay: float) -> None:
    """Every batched decoding step sleeps ``delay`` seconds first."""
    step = Engine._step

    def slow(self: Engine) -> None:
        time.sleep(delay)
        step(self)
    Engine._step = slow


def build(sizes: dict, chat: bool = False) -> tuple[GPT, BPETokenizer]:
    """The tiny model of serve_support (seed 0, logits scaled up) at ``sizes``; its
    vocabulary may be larger than the tokenizer's (more logits per position). With
    ``chat`` the tokenizer has tinylm's chat tokens and template."""
    specials = STANDARD_SPECIALS if chat else ["<|endoftext|>"]
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=specials)
    torch.manual_seed(0)
    sizes = {"vocab_size": tok.vocab_size, "n_layer": 2, "n_head": 2, "n_embd": 32,
             "context_length": 64, "tie_embeddings": False} | sizes
    model = GPT(ModelConfig(**sizes)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model, tok


def main() -> None:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    model, tok = build(spec.get("model", {}), spec.get("chat", False))
    settings = {"threads": 1} | spec.get("settings", {})
    settings["allowed_hosts"] = tuple(settings.get("allowed_hosts", ()))
    server = Server(Settings(**settings))
    server.load(model, tok)
    protocol.LimitedH11Protocol.header_timeout = spec.get("header_timeout",
                                                          protocol.HEADER_TIMEOUT)
    app_module.BODY_TIMEOUT = spec.get("body_timeout", app_module.BODY_TIMEOUT)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if spec.get("step_delay"):
        slow_steps(spec["step_delay"])
    uv = protocol.graceful_server(create_app(server), server, log_level="warning",
                                  max_connections=spec.get("max_connections", 128),
                                  shutdown_timeout=spec.get("shutdown_timeout", 30.0))
    print(f"port {sock.getsockname()[1]}", flush=True)
    uv.run(sockets=[sock])


if __name__ == "__main__":
    main()
