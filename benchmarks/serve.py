"""Serving throughput: continuous batching against one request at a time.

Starts ``tinylm serve`` in a subprocess twice on the same checkpoint — once with
``--max-batch 64`` (continuous batching) and once with ``--max-batch 1`` (the same
server limited to one request at a time) — and drives each with 1, 4, 16 and 64
concurrent streaming clients (asyncio + httpx in this process). Each client sends
``--requests`` greedy completions of ``--max-tokens`` tokens after a random prompt of
``--prompt-len`` tokens. Reports aggregate generated tokens/s and the p50/p99 time to
first token as the clients see it, writes the table to BENCHMARKS.md and a plot to
benchmarks/serve.png.

The model is ``--model DIR`` (e.g. the ``make demo`` run, runs/demo) or, by default,
random weights of configs/demo.toml's shape with a byte-level BPE tokenizer of 1024
tokens trained on the built-in python-docs corpus: throughput depends on the shape,
not on the weights.

    python benchmarks/serve.py                       # the full run (a few minutes)
    python benchmarks/serve.py --clients 1 4 --requests 1 --max-tokens 16 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from report import closing_lines, write_section
from tinylm.core.config import ModelConfig, read_toml
from tinylm.core.model import GPT
from tinylm.data.corpora import load_corpus
from tinylm.data.tokenizers import BPETokenizer
from tinylm.io.checkpoint_files import save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PNG = Path(__file__).resolve().parent / "serve.png"


def random_demo_checkpoint(folder: Path) -> Path:
    """Random weights in configs/demo.toml's shape, with a 1024-token BPE tokenizer."""
    model_section, _ = read_toml(ROOT / "configs" / "demo.toml")
    text = load_corpus("python-docs")[:2_000_000]
    tok = BPETokenizer.train([text], vocab_size=1024, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, **{k: v for k, v in model_section.items()
                                                    if k != "dropout"})
    save_checkpoint(folder, GPT(cfg).eval(), tok)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, max_batch: int, threads: int,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """``tinylm serve`` on ``model`` in its own process, with ``extra`` flags; (process,
    base URL) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "tinylm", "-q", "serve", "--model", str(model), "--port",
           str(port), "--max-batch", str(max_batch), "--max-queue", "4096", "--timeout",
           "3600", "--max-tokens", "4096", "--threads", str(threads), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 120 s")


async def one_request(http, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(time to first token, generated tokens) of one streamed greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, tokens


async def drive(url: str, clients: int, requests: int, prompts: list[list[int]],
                max_tokens: int) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def client(c: int) -> list[tuple[float, int]]:
            return [await one_request(http, prompts[(c * requests + r) % len(prompts)],
                                      max_tokens) for r in range(requests)]
        start = time.perf_counter()
        results = await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - start
    ttft = sorted(t for res in results for t, _ in res)
    tokens = sum(n for res in results for _, n in res)
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
    return {"tps": tokens / wall, "p50": statistics.median(ttft), "p99": p99,
            "tokens": tokens, "wall": wall}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("batched", "o-"), ("one at a time", "s--")):
        rs = [r for r in rows if r["mode"] == mode]
        a.plot([r["clients"] for r in rs], [r["tps"] for r in rs], style, label=mode)
        b.plot([r["clients"] for r in rs], [r["p50"] for r in rs], style, label=f"{mode} p50")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.legend()
        ax.grid(alpha=0.3)
    a.set_ylabel("aggregate tokens/s")
    b.set_ylabel("time to first token, s")
    b.set_yscale("log")
    fig.suptitle("tinylm serve: continuous batching vs one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint folder (default: random weights, demo shape)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the server's decoding loop (default 1: the "
                             "model is small, and the HTTP side needs a core too)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_demo_checkpoint(Path(tmp) / "demo-random")
        cfg = json.loads((Path(model) / "config.json").read_text())["model"]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, 1000, (256, args.prompt_len), generator=g).tolist()
        rows = []
        for mode, max_batch in (("batched", max(args.clients)), ("one at a time", 1)):
            proc, url = start_server(Path(model), max_batch, args.threads)
            try:
                asyncio.run(drive(url, 1, 1, prompts, 4))  # warm-up
                for clients in args.clients:
                    r = asyncio.run(drive(url, clients, args.requests, prompts,
                                          args.max_tokens))
                    rows.append(dict(r, mode=mode, clients=clients))
                    print(f"{mode:>13}, {clients:3d} clients: {r['tps']:7.1f} tok/s, TTFT p50 "
                          f"{r['p50'] * 1e3:7.1f} ms, p99 {r['p99'] * 1e3:7.1f} ms", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    single = {r["clients"]: r for r in rows if r["mode"] == "one at a time"}
    lines = [
        f"Model: {'`' + str(args.model) + '`' if args.model else 'random weights'} in the "
        f"`make demo` shape ({cfg['n_layer']} layers x {cfg['n_head']} heads x "
        f"E={cfg['n_embd']}, C={cfg['context_length']}, V={cfg['vocab_size']}). Each client "
        f"streams {args.requests} greedy completions of {args.max_tokens} tokens after a "
        f"{args.prompt_len}-token prompt, one after another; `tinylm serve` in its own "
        f"process, --threads {args.threads}; clients: asyncio + httpx in another. Batched: "
        f"`--max-batch {max(args.clients)}`; one at a time: `--max-batch 1`. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}; load "
        f"average {load:.2f} at the start.",
        "",
        "| clients | batched tok/s | one-at-a-time tok/s | speed-up | batched TTFT p50 / p99 ms "
        "| one-at-a-time TTFT p50 / p99 ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in (r for r in rows if r["mode"] == "batched"):
        s = single[r["clients"]]
        lines.append(f"| {r['clients']} | {r['tps']:.1f} | {s['tps']:.1f} | "
                     f"{r['tps'] / s['tps']:.2f}x | {r['p50'] * 1e3:.0f} / {r['p99'] * 1e3:.0f} "
                     f"| {s['p50'] * 1e3:.0f} / {s['p99'] * 1e3:.0f} |")
    lines += ["", "![serving throughput](benchmarks/serve.png)",
              *closing_lines("benchmarks/serve.py", load)]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        plot(rows, PNG)
        write_section("serve", "Serving throughput (tinylm serve)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
