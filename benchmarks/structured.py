"""Structured output: the grammar mask's cost per decoded token.

Runs the server's engine (``tinylm.serve.engine.Engine``, in this process, --threads 1)
on the same greedy prompts with and without a JSON-schema constraint
(``tinylm.serve.constrain``, llguidance), side by side, on two models: random weights
in configs/demo.toml's shape (1024-token BPE) and SmolLM2-135M-Instruct (its 49k-token
vocabulary; skipped with --no-smollm2). Every request decodes exactly --max-tokens
tokens (no end token; the schema is a list of at least 1000 objects, so the grammar
never ends first). Reported, as medians over --repeats runs: tokens/s and ms per token at batch 1
(one request) and in a mixed batch (half the rows constrained) against the same batch
unconstrained, and the mask's own time per token (llguidance computing the allowed
set, measured inside the constraint; it runs in a worker thread beside the forward).

    python benchmarks/structured.py                    # writes BENCHMARKS.md
    python benchmarks/structured.py --repeats 1 --max-tokens 16 --no-smollm2 --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

from report import closing_lines, write_section
from tinylm.core.config import ModelConfig, read_toml
from tinylm.core.model import GPT
from tinylm.data.corpora import load_corpus
from tinylm.data.tokenizers import BPETokenizer
from tinylm.serve.constrain import OutputSpec, grammar_engine
from tinylm.serve.engine import End, Engine, Request

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = Path.home() / ".cache" / "tinylm" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def demo_model():
    model_section, _ = read_toml(ROOT / "configs" / "demo.toml")
    text = load_corpus("python-docs")[:2_000_000]
    tok = BPETokenizer.train([text], vocab_size=1024, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, **{k: v for k, v in model_section.items()
                                                    if k != "dropout"})
    return GPT(cfg).eval(), tok


def smollm2_model(path: Path):
    from tinylm.io.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": tmp}):
        return load_checkpoint(path)


def run_batch(engine: Engine, prompts: list[list[int]], constraints: list, max_tokens: int,
              vocab: int) -> float:
    """Seconds until every request (constraint or None each) has its max_tokens tokens."""
    done = threading.Semaphore(0)

    def emit(event) -> None:
        if isinstance(event, End):
            assert event.reason == "length", event
            done.release()
    reqs = [Request(p, max_tokens, emit, vocab_size=vocab, constraint=c)
            for p, c in zip(prompts, constraints, strict=True)]
    start = time.perf_counter()
    engine.submit(reqs)
    for _ in reqs:
        done.acquire()
    return time.perf_counter() - start


def measure(name: str, model, tok, args) -> list[dict]:
    engine = Engine(model, max_batch=16, threads=1).start()
    grammar = grammar_engine(tok, [tok.eos_id])
    spec = OutputSpec("json_schema", SCHEMA, "response_format")
    text = "Write a list of items as JSON. "
    prompts = [tok.encode(text * (1 + k % 3)) for k in range(args.batch)]
    rows = []
    try:
        run_batch(engine, prompts[:1], [None], 4, tok.vocab_size)  # warm-up
        for label, n in (("batch 1", 1), (f"mixed batch of {args.batch}", args.batch)):
            free, held, masks = [], [], []
            for _ in range(args.repeats):
                free.append(run_batch(engine, prompts[:n], [None] * n, args.max_tokens,
                                      tok.vocab_size))
                cons = grammar.constraints(spec, max(n // 2, 1))  # compiled before timing
                mixed = cons + [None] * (n - len(cons))
                held.append(run_batch(engine, prompts[:n], mixed, args.max_tokens,
                                      tok.vocab_size))
                masks += [s for c in cons for s in c.mask_seconds]
            tokens = n * args.max_tokens
            f, h = statistics.median(free), statistics.median(held)
            rows.append({"model": name, "case": label, "free_tps": tokens / f,
                         "held_tps": tokens / h, "free_ms": f / args.max_tokens * 1e3,
                         "held_ms": h / args.max_tokens * 1e3,
                         "mask_ms": statistics.median(masks) * 1e3, "constrained": len(cons),
                         "rows": n})
            print(rows[-1], flush=True)
    finally:
        engine.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8, help="rows of the mixed batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    models = [("demo shape, random weights (V=1024)", demo_model)]
    if not args.no_smollm2:
        models.append(("SmolLM2-135M-Instruct Q4_1 (V=49152)", lambda: smollm2_model(SMOLLM2)))
    rows = []
    for name, make in models:
        rows += measure(name, *make(), args)
    lines = [
        f"Greedy decoding in the server's engine (in-process, 1 torch thread), every request "
        f"{args.max_tokens} tokens; constrained rows held by a JSON schema (a list of at "
        f"least 1000 objects, so it never ends first) through llguidance. \"mixed\": half "
        f"the rows constrained, against the same rows all unconstrained. Medians of "
        f"{args.repeats} runs; ms/step is the wall time over the tokens (prefill included). "
        f"Mask ms: llguidance's "
        f"time for one row's allowed-token set (median over every step), computed in a worker "
        f"thread while the batched forward runs. Machine: {os.cpu_count()} CPU cores "
        f"({platform.machine()}), torch {torch.__version__}; load average {load:.2f} at the "
        f"start.",
        "",
        "| model | case | tok/s without | tok/s with | ms/step without | ms/step with "
        "| cost | mask ms (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        case = r["case"] + (f" ({r['constrained']} constrained)" if r["rows"] > 1 else "")
        lines.append(f"| {r['model']} | {case} | {r['free_tps']:.1f} | {r['held_tps']:.1f} | "
                     f"{r['free_ms']:.2f} | {r['held_ms']:.2f} | "
                     f"{r['held_ms'] / r['free_ms'] - 1:+.0%} | {r['mask_ms']:.3f} |")
    lines += closing_lines("benchmarks/structured.py", load)
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("structured", "Structured output: the mask's cost", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
