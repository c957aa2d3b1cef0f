"""Serving throughput: continuous batching on the native step, on the reference step,
and one request at a time; and SmolLM2 against llama.cpp's server.

Starts ``tinylm serve`` in a subprocess three times on the same checkpoint — with
``--max-batch 64`` (continuous batching on the fused native step), the same with
``TINYLM_NATIVE=0`` (continuous batching on the reference step: the model's own forward)
and with ``--max-batch 1`` (one request at a time, native step) — and drives each with
1, 4, 16 and 64 concurrent streaming clients (asyncio + httpx in this process). Each
client sends ``--requests`` greedy completions of ``--max-tokens`` tokens after a random
prompt of ``--prompt-len`` tokens. Reports aggregate generated tokens/s and the p50/p99
time to first token as the clients see it, writes the table to BENCHMARKS.md and a plot
to benchmarks/serve.png.

``--smollm2 FILE.gguf`` instead serves SmolLM2-135M-Instruct (its Q4_1 blocks kept as
stored: ``tinylm convert --from-gguf --keep-quantized``) with ``tinylm serve`` and with
llama.cpp's ``python -m llama_cpp.server`` (one sequence at a time, its default single
slot), the same ``--threads``, and drives both with the official ``openai`` client
(streamed greedy text completions): :func:`start_llamacpp_server`,
:func:`start_server` and :func:`drive_openai` are the pieces benchmarks/llamacpp.py can
call.

The model is ``--model DIR`` (e.g. the ``make demo`` run, runs/demo) or, by default,
random weights of configs/demo.toml's shape with a byte-level BPE tokenizer of 1024
tokens trained on the built-in python-docs corpus: throughput depends on the shape,
not on the weights.

    python benchmarks/serve.py                       # the full run (a few minutes)
    python benchmarks/serve.py --clients 1 4 --requests 1 --max-tokens 16 --no-write
    python benchmarks/serve.py --smollm2 ~/.cache/tinylm/models/SmolLM2-135M-Instruct.Q4_1.gguf
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


def start_server(model: Path, max_batch: int, threads: int, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``tinylm serve`` on ``model`` in its own process, with ``extra`` flags and
    ``env`` added to the environment (``{"TINYLM_NATIVE": "0"}``: the reference step);
    (process, base URL) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "tinylm", "-q", "serve", "--model", str(model), "--port",
           str(port), "--max-batch", str(max_batch), "--max-queue", "4096", "--timeout",
           "3600", "--max-tokens", "4096", "--threads", str(threads), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **(env or {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "/health")


def start_llamacpp_server(gguf: Path, threads: int, n_ctx: int = 2048
                          ) -> tuple[subprocess.Popen, str]:
    """llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``) on ``gguf``
    with ``threads`` threads for decoding and for prompts, its default single slot (one
    sequence at a time; requests queue, not interrupting the running one); (process,
    base URL) once it answers /v1/models."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
           "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--verbose", "False",
           "--interrupt_requests", "False"]  # its default True cuts a stream off for the next
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "/v1/models")


def wait_healthy(proc: subprocess.Popen, url: str, path: str, timeout: float = 300) -> str:
    """``url`` once ``url + path`` answers 200 (the process killed if it never does)."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s")


async def drive_openai(url: str, clients: int, prompts: list[str], max_tokens: int) -> dict:
    """``clients`` concurrent clients of the official ``openai`` client, each streaming
    one greedy text completion of up to ``max_tokens`` tokens (prompt i for client i):
    total tokens/s (streamed chunks with text, one per token on both servers) and the
    p50 / p99 time to first token."""
    import openai
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600,
                             max_retries=0)
    name = (await api.models.list()).data[0].id

    async def client(c: int) -> tuple[float, int]:
        start, first, tokens = time.perf_counter(), None, 0
        stream = await api.completions.create(model=name, prompt=prompts[c % len(prompts)],
                                              max_tokens=max_tokens, temperature=0,
                                              stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                tokens += 1
                first = first if first is not None else time.perf_counter() - start
        return (first if first is not None else time.perf_counter() - start), tokens
    start = time.perf_counter()
    results = await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - start
    await api.close()
    ttft = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {"tps": tokens / wall, "p50": statistics.median(ttft),
            "p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "tokens": tokens, "wall": wall}


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


MODES = (("batched, native step", None, {}),  # (mode, --max-batch (None: the most
          ("batched, reference step", None, {"TINYLM_NATIVE": "0"}),  # clients), env)
          ("one at a time", 1, {}))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for (mode, _, _), style in zip(MODES, ("o-", "^-", "s--"), strict=True):
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
    fig.suptitle("tinylm serve: continuous batching (native and reference step) vs one at a "
                 "time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_modes(model: Path, args: argparse.Namespace) -> list[dict]:
    """Each of :data:`MODES` served and driven at every ``--clients``."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (256, args.prompt_len), generator=g).tolist()
    rows = []
    for mode, max_batch, env in MODES:
        proc, url = start_server(model, max_batch or max(args.clients), args.threads, env=env)
        try:
            asyncio.run(drive(url, 1, 1, prompts, 4))  # warm-up
            for clients in args.clients:
                r = asyncio.run(drive(url, clients, args.requests, prompts, args.max_tokens))
                rows.append(dict(r, mode=mode, clients=clients))
                print(f"{mode:>23}, {clients:3d} clients: {r['tps']:7.1f} tok/s, TTFT p50 "
                      f"{r['p50'] * 1e3:7.1f} ms, p99 {r['p99'] * 1e3:7.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    return rows


def table(rows: list[dict]) -> list[str]:
    by = {(r["mode"], r["clients"]): r for r in rows}
    native, ref, one = (m for m, _, _ in MODES)
    lines = ["| clients | native step tok/s | reference step tok/s | native / reference "
             "| one-at-a-time tok/s | native / one-at-a-time | native TTFT p50 / p99 ms "
             "| one-at-a-time TTFT p50 / p99 ms |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (mode, clients), n in by.items():
        if mode != native:
            continue
        r, s = by[ref, clients], by[one, clients]
        lines.append(f"| {clients} | {n['tps']:.1f} | {r['tps']:.1f} | {n['tps'] / r['tps']:.2f}x "
                     f"| {s['tps']:.1f} | {n['tps'] / s['tps']:.2f}x | {n['p50'] * 1e3:.0f} / "
                     f"{n['p99'] * 1e3:.0f} | {s['p50'] * 1e3:.0f} / {s['p99'] * 1e3:.0f} |")
    return lines


def machine(load: float) -> str:
    return (f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), torch "
            f"{torch.__version__}; load average {load:.2f} at the start.")


def demo(args: argparse.Namespace) -> str:
    """The three modes on ``--model`` (or random demo-shaped weights): the table."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_demo_checkpoint(Path(tmp) / "demo-random")
        cfg = json.loads((Path(model) / "config.json").read_text())["model"]
        rows = run_modes(Path(model), args)
    lines = [
        f"Model: {'`' + str(args.model) + '`' if args.model else 'random weights'} in the "
        f"`make demo` shape ({cfg['n_layer']} layers x {cfg['n_head']} heads x "
        f"E={cfg['n_embd']}, C={cfg['context_length']}, V={cfg['vocab_size']}). Each client "
        f"streams {args.requests} greedy completions of {args.max_tokens} tokens after a "
        f"{args.prompt_len}-token prompt, one after another; `tinylm serve` in its own "
        f"process, --threads {args.threads}; clients: asyncio + httpx in another. Native "
        f"step: `--max-batch {max(args.clients)}` (the fused native decoding step over the "
        f"ragged batch); reference step: the same with `TINYLM_NATIVE=0` (the model's own "
        f"forward); one at a time: `--max-batch 1`. {machine(load)}", "", *table(rows),
        "", "![serving throughput](benchmarks/serve.png)",
        *closing_lines("benchmarks/serve.py", load)]
    if not args.no_write:
        plot(rows, PNG)
    return "\n".join(lines)


def smollm2(args: argparse.Namespace) -> str:
    """SmolLM2 served by tinylm (Q4_1 blocks kept) and by llama.cpp's server, the same
    GGUF, threads and openai-client driver, at every ``--clients``: the table."""
    from tinylm.data.corpora import load_corpus
    from tinylm.io.gguf_checkpoint import convert_gguf
    load = os.getloadavg()[0]
    text = load_corpus("python-docs")[:200_000]
    prompts = [text[i * 997:i * 997 + 80] for i in range(64)]  # ~16-20 tokens each
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm2-q4_1"
        convert_gguf(args.smollm2, folder, keep_quantized=True)
        servers = (("tinylm serve", lambda: start_server(folder, max(args.clients),
                                                         args.threads)),
                   ("llama_cpp.server", lambda: start_llamacpp_server(args.smollm2,
                                                                     args.threads)))
        for name, start in servers:
            proc, url = start()
            try:
                asyncio.run(drive_openai(url, 1, prompts, 4))  # warm-up
                for clients in args.clients:
                    r = asyncio.run(drive_openai(url, clients, prompts, args.max_tokens))
                    rows[name, clients] = r
                    print(f"{name:>16}, {clients:3d} clients: {r['tps']:7.1f} tok/s, TTFT "
                          f"p50 {r['p50'] * 1e3:7.1f} ms", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    return smollm2_text(args, rows, load)


def smollm2_text(args: argparse.Namespace, rows: dict, load: float) -> str:
    import llama_cpp
    lines = [
        f"Model: `{args.smollm2.name}` (SmolLM2-135M-Instruct, Q4_1). tinylm: `tinylm serve` "
        f"on it converted with `--keep-quantized` (the Q4_1 blocks as stored, the fused "
        f"native step), `--max-batch {max(args.clients)} --threads {args.threads}`. llama.cpp: "
        f"`python -m llama_cpp.server` (llama-cpp-python {llama_cpp.__version__}), "
        f"`--n_threads {args.threads} --n_threads_batch {args.threads} --n_ctx 2048 "
        f"--interrupt_requests False`, its default single slot (one sequence at a time). "
        f"Each client (the official `openai` client, asyncio) streams one greedy text "
        f"completion of up to {args.max_tokens} tokens after a ~18-token prompt "
        f"(python-docs text); tokens = streamed chunks with text. {machine(load)}", "",
        "| clients | tinylm tok/s | llama.cpp tok/s | tinylm / llama.cpp | tinylm TTFT p50 / "
        "p99 ms | llama.cpp TTFT p50 / p99 ms |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for clients in args.clients:
        t, c = rows["tinylm serve", clients], rows["llama_cpp.server", clients]
        lines.append(f"| {clients} | {t['tps']:.1f} | {c['tps']:.1f} | {t['tps'] / c['tps']:.2f}x "
                     f"| {t['p50'] * 1e3:.0f} / {t['p99'] * 1e3:.0f} | {c['p50'] * 1e3:.0f} / "
                     f"{c['p99'] * 1e3:.0f} |")
    return "\n".join([*lines, *closing_lines("benchmarks/serve.py", load)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint folder (default: random weights, demo shape)")
    parser.add_argument("--smollm2", type=Path, default=None, metavar="FILE.gguf",
                        help="serve this SmolLM2 GGUF with tinylm and llama.cpp's server "
                             "instead (default --clients 1 4 16, --max-tokens 64)")
    parser.add_argument("--clients", type=int, nargs="+", default=None)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of the server's decoding loop (default 1: the model "
                             "is small, and the HTTP side needs a core too)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    args.clients = args.clients or ([1, 4, 16] if args.smollm2 else [1, 4, 16, 64])
    text = smollm2(args) if args.smollm2 else demo(args)
    print(text)
    if not args.no_write:
        if args.smollm2:
            write_section("serve-smollm2", "Serving SmolLM2: tinylm serve vs llama.cpp's "
                          "server", text)
        else:
            write_section("serve", "Serving throughput (tinylm serve)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
