"""What log-probabilities cost a server: throughput without logprobs, with the chosen
token's only, with the top 5 and with the top 20 alternatives.

Starts one ``tinylm serve`` (benchmarks/serve.py's model and server: random weights in
the ``make demo`` shape unless ``--model``) and drives it with ``--clients`` concurrent
streaming clients, each sending ``--requests`` greedy completions of ``--max-tokens``
tokens. The four settings run in turn within each of ``--repeats`` rounds (so a busy
spell of the machine falls on all of them); the table has the median tokens/s of each
and its ratio to the run without logprobs, and goes to BENCHMARKS.md.

    python benchmarks/serve_logprobs.py                 # about a minute
    python benchmarks/serve_logprobs.py --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from report import closing_lines, write_section
from serve import random_demo_checkpoint, start_server

SETTINGS = (("none", None), ("chosen token only", 0), ("top 5", 5), ("top 20", 20))


async def one_request(http, prompt: list[int], max_tokens: int, k: int | None) -> int:
    """Tokens of one streamed greedy completion (with ``logprobs: k`` unless None)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if k is not None:
        body["logprobs"] = k
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def drive(url: str, clients: int, requests: int, prompts: list[list[int]],
                max_tokens: int, k: int | None) -> float:
    """Aggregate generated tokens/s of ``clients`` clients."""
    import httpx
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def client(c: int) -> int:
            return sum([await one_request(http, prompts[(c * requests + r) % len(prompts)],
                                          max_tokens, k) for r in range(requests)])
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(c) for c in range(clients))))
        return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint folder (default: random weights, demo shape)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_demo_checkpoint(Path(tmp) / "demo-random")
        cfg = json.loads((Path(model) / "config.json").read_text())["model"]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, 1000, (256, 16), generator=g).tolist()
        proc, url = start_server(Path(model), args.clients, args.threads)
        try:
            asyncio.run(drive(url, 1, 1, prompts, 4, 5))  # warm-up
            for _ in range(args.repeats):
                for name, k in SETTINGS:
                    tps = asyncio.run(drive(url, args.clients, args.requests, prompts,
                                            args.max_tokens, k))
                    runs[name].append(tps)
                    print(f"{name:>17}: {tps:7.1f} tok/s", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    base = statistics.median(runs["none"])
    lines = [
        f"Model: {'`' + str(args.model) + '`' if args.model else 'random weights'} in the "
        f"`make demo` shape ({cfg['n_layer']} layers x {cfg['n_head']} heads x "
        f"E={cfg['n_embd']}, V={cfg['vocab_size']}). {args.clients} concurrent clients "
        f"each stream {args.requests} greedy completions of {args.max_tokens} tokens "
        f"(`--max-batch {args.clients}`, --threads {args.threads}); medians of "
        f"{args.repeats} rounds, the settings interleaved. Machine: {os.cpu_count()} CPU "
        f"cores ({platform.machine()}), torch {torch.__version__}; load average {load:.2f} "
        f"at the start.",
        "",
        "| logprobs | tokens/s (median) | runs | vs none |",
        "| --- | ---: | --- | ---: |",
    ]
    for name, _ in SETTINGS:
        med = statistics.median(runs[name])
        lines.append(f"| {name} | {med:.1f} | {', '.join(f'{v:.0f}' for v in runs[name])} "
                     f"| {med / base:.2f}x |")
    lines += closing_lines("benchmarks/serve_logprobs.py", load)
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("serve-logprobs", "What log-probabilities cost (tinylm serve)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
