"""Prompt-lookup decoding: greedy tokens/s with and without ``--speculate ngram``.

Starts ``tinylm serve`` on SmolLM2-135M-Instruct (the GGUF file, or ``--model``) twice —
plain, and ``--speculate ngram`` (``--draft-tokens``) — and sends each the same greedy
chat prompts (ChatML, as token ids) of two kinds, one client at a time:

- input-grounded: repeat, quote or correct a given passage (the answer copies its input);
- free text: a story, an explanation (the answer copies little).

Per kind: decoding tokens/s (tokens after the first / time after the first, so the
prefill, the same in both, is left out), the median over ``--repeats`` rounds of all its
prompts; the speed-up; the draft acceptance rate (/metrics); and whether every answer
was the same text in both servers.

    python benchmarks/speculate.py                   # writes its BENCHMARKS.md section
    python benchmarks/speculate.py --repeats 1 --max-tokens 32 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import httpx
import torch

from prefix import metric, server_flags
from report import closing_lines, write_section
from serve import start_server
from tinylm.io.checkpoint import load_tokenizer_of, resolve_checkpoint_dir

PASSAGE = ("The Python interpreter reads a program one line at a time. Each statement is "
           "compiled to bytecode, and the bytecode is executed by a virtual machine that "
           "keeps a stack of values. Functions are objects: they can be passed to other "
           "functions, stored in lists, and returned from calls. A module is a file of "
           "definitions; importing it runs the file once and binds its name.")
TASKS = {
    "input-grounded": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Quote the second and third sentences of this text:\n\n{PASSAGE}",
        f"Copy this text and replace every 'Python' with 'Ruby':\n\n{PASSAGE}",
    ],
    "free text": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue, in a few paragraphs.",
        "Give me ten ideas for a weekend trip, with a sentence on each.",
    ],
}


def chat_ids(tok, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def timed_completion(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int, str]:
    """(time to first token, total time, tokens, text) of one streamed greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens, text = time.perf_counter(), None, 0, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                first = first if first is not None else time.perf_counter() - start
                text.append(chunk["choices"][0]["text"])
    return first or 0.0, time.perf_counter() - start, tokens, "".join(text)


def run_mode(args, extra: tuple[str, ...], prompts: dict[str, list[list[int]]]) -> dict:
    """Per task kind: decoding tokens/s of each round, drafted and accepted tokens, texts."""
    proc, url = start_server(args.model, 1, args.threads, extra)
    out = {}
    try:
        timed_completion(url, prompts["free text"][0], 4)  # warm-up
        for kind, ids in prompts.items():
            d0 = metric(url, "tinylm_draft_tokens_total")
            a0 = metric(url, "tinylm_draft_tokens_accepted_total")
            rates, texts, tokens = [], [], 0
            for _ in range(args.repeats):
                n_sum = t_sum = 0.0
                for p in ids:
                    first, total, n, text = timed_completion(url, p, args.max_tokens)
                    n_sum, t_sum = n_sum + n - 1, t_sum + total - first
                    texts.append(text)
                    tokens += n
                rates.append(n_sum / t_sum)
            out[kind] = {"tps": statistics.median(rates), "texts": texts, "tokens": tokens,
                         "drafted": metric(url, "tinylm_draft_tokens_total") - d0,
                         "accepted": metric(url, "tinylm_draft_tokens_accepted_total") - a0}
            print(f"{extra or 'plain'} {kind}: {out[kind]['tps']:.1f} tok/s, drafted "
                  f"{out[kind]['drafted']:.0f}, accepted {out[kind]['accepted']:.0f}",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def report(args, plain: dict, spec: dict, load: float) -> str:
    lines = [
        f"Model: {args.model.name} (`tinylm serve --model` it, in its own process, "
        f"`--max-batch 1 --threads {args.threads}`), greedy, one client. Each kind is "
        f"{len(TASKS['input-grounded'])} chat prompts of up to {args.max_tokens} tokens; "
        f"decoding tokens/s = tokens after the first / time after the first token (the "
        f"prefill, the same in both, left out), median over {args.repeats} rounds. "
        f"Speculating: `--speculate ngram --draft-tokens {args.draft_tokens}`. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}; "
        f"load average {load:.2f} at the start.",
        "",
        "| task | plain tok/s | `--speculate ngram` tok/s | speed-up | draft tokens accepted "
        "| tokens per forward | same text |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for kind in TASKS:
        p, s = plain[kind], spec[kind]
        rate = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        forwards = s["tokens"] - s["accepted"]  # each forward takes one token + its accepted
        same = "yes" if p["texts"] == s["texts"] else \
            f"no ({sum(a != b for a, b in zip(p['texts'], s['texts'], strict=True))} differ)"
        lines.append(f"| {kind} | {p['tps']:.1f} | {s['tps']:.1f} | {s['tps'] / p['tps']:.2f}x "
                     f"| {rate:.0%} ({s['accepted']:.0f} / {s['drafted']:.0f}) "
                     f"| {s['tokens'] / forwards:.2f} | {same} |")
    lines.append("")
    for kind in TASKS:
        ratio = spec[kind]["tps"] / plain[kind]["tps"]
        verdict = f"{ratio:.2f}x as fast" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        lines.append(f"- {kind}: {verdict} with speculation.")
    lines += closing_lines("benchmarks/speculate.py", load)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_flags(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft-tokens", type=int, default=8)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    tok = load_tokenizer_of(resolve_checkpoint_dir(args.model))
    prompts = {kind: [chat_ids(tok, t) for t in texts] for kind, texts in TASKS.items()}
    plain = run_mode(args, (), prompts)
    spec = run_mode(args, ("--speculate", "ngram", "--draft-tokens", str(args.draft_tokens)),
                    prompts)
    text = report(args, plain, spec, load)
    print(text)
    if not args.no_write:
        write_section("speculate", "Prompt-lookup decoding", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
