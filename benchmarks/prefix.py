"""Prefix reuse: time to first token of a second request that shares a 1,000-token prefix.

Starts ``tinylm serve`` on SmolLM2-135M-Instruct (the GGUF file, or ``--model``) twice —
``--prefix-cache 0`` (off) and the default ``--prefix-cache 256`` (on) — and in each, for
every repeat, sends a fresh document of ``--prefix`` tokens (python-docs text at another
offset) followed by one short question, then the same document followed by another
question: the first request of a repeat finds nothing cached, the second finds the
document. Streamed greedy completions (token ids as the prompt, so the shared prefix is
exactly ``--prefix`` tokens); time to first token as the client sees it; medians over
the repeats; the speed-up of the second request, cache on against off.

    python benchmarks/prefix.py                     # writes its BENCHMARKS.md section
    python benchmarks/prefix.py --repeats 2 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
from pathlib import Path

import httpx
import torch

from report import closing_lines, write_section
from serve import one_request, start_server
from tinylm.data.corpora import load_corpus
from tinylm.io.checkpoint import load_tokenizer_of, resolve_checkpoint_dir

DEFAULT_GGUF = Path(os.environ.get("TINYLM_SMOLLM2_GGUF") or Path.home() / ".cache" / "tinylm"
                    / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTIONS = ["\n\nQuestion: What is this text about? Answer:",
             "\n\nQuestion: Name one keyword used above. Answer:",
             "\n\nQuestion: Is this about Python? Answer:"]


async def ttft_pairs(url: str, docs: list[list[int]], questions: list[list[int]],
                     max_tokens: int) -> list[tuple[float, float]]:
    """(first, second) time to first token per document: document + question 0, then
    document + question 1, one after another."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        await one_request(http, questions[2], 2)  # warm-up
        for doc in docs:
            first, _ = await one_request(http, doc + questions[0], max_tokens)
            second, _ = await one_request(http, doc + questions[1], max_tokens)
            out.append((first, second))
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


def measure(model: Path, args, docs, questions) -> dict[str, dict]:
    rows = {}
    for mode, mib in (("off", 0), ("on", 256)):
        proc, url = start_server(model, 1, args.threads, ("--prefix-cache", str(mib)))
        try:
            pairs = asyncio.run(ttft_pairs(url, docs, questions, args.max_tokens))
            reused = metric(url, "tinylm_prefix_cache_tokens_reused_total")
        finally:
            proc.terminate()
            proc.wait(30)
        rows[mode] = {"first": statistics.median(p[0] for p in pairs),
                      "second": statistics.median(p[1] for p in pairs), "reused": reused}
        print(f"cache {mode}: first {rows[mode]['first'] * 1e3:.0f} ms, second "
              f"{rows[mode]['second'] * 1e3:.0f} ms, tokens reused {reused:.0f}", flush=True)
    return rows


def report(args, rows: dict, load: float) -> str:
    off, on = rows["off"], rows["on"]
    lines = [
        f"Model: {args.model.name} (`tinylm serve --model` it, in its own process, "
        f"`--max-batch 1 --threads {args.threads}`). Each of {args.repeats} repeats sends a "
        f"fresh {args.prefix}-token document (python-docs text) + a short question "
        f"(~{args.question_tokens} tokens), then the same document + another question, "
        f"streamed greedy completions of {args.max_tokens} tokens; time to first token as "
        f"the client sees it (HTTP included), medians over the repeats. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}; "
        f"load average {load:.2f} at the start.",
        "",
        "| `--prefix-cache` | first request TTFT ms | second request TTFT ms | prompt tokens "
        "reused (all repeats) |",
        "| --- | ---: | ---: | ---: |",
        f"| 0 (off) | {off['first'] * 1e3:.0f} | {off['second'] * 1e3:.0f} | "
        f"{off['reused']:.0f} |",
        f"| 256 MiB (on, the default) | {on['first'] * 1e3:.0f} | {on['second'] * 1e3:.0f} | "
        f"{on['reused']:.0f} |",
        "",
        f"Second request with the cache on: **{off['second'] / on['second']:.1f}x** faster "
        f"to its first token than with it off (target >= 5x). The first request of a "
        f"document costs {on['first'] / off['first']:.2f}x the uncached one (cloning its "
        f"blocks into the cache).",
    ]
    lines += closing_lines("benchmarks/prefix.py", load)
    return "\n".join(lines)


def server_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark of a live SmolLM2 server takes (this one, speculate.py):
    --model, --threads of the server's decoding loop, --no-write."""
    parser.add_argument("--model", type=Path, default=DEFAULT_GGUF,
                        help="a checkpoint folder or .gguf file (default: SmolLM2's GGUF)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the server's decoding loop (default 1)")
    parser.add_argument("--no-write", action="store_true", help="print only")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_flags(parser)
    parser.add_argument("--prefix", type=int, default=1000, help="shared prefix tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    tok = load_tokenizer_of(resolve_checkpoint_dir(args.model))
    ids = tok.encode(load_corpus("python-docs")[:400_000])
    step = len(ids) // (args.repeats + 1)
    docs = [ids[r * step:r * step + args.prefix] for r in range(args.repeats)]
    questions = [tok.encode(q) for q in QUESTIONS]
    args.question_tokens = round(statistics.mean(len(q) for q in questions))
    rows = measure(args.model, args, docs, questions)
    text = report(args, rows, load)
    print(text)
    if not args.no_write:
        write_section("prefix", "Prefix reuse", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
