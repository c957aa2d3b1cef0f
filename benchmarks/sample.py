"""Sampling throughput: tinylm with its KV cache vs Hugging Face generate vs no cache.

One run measures, on the same random weights (6 layers x 6 heads x E=384, C=512,
vocabulary --vocab, default GPT-2's 50257; the Hugging Face model is the same weights
through ``tinylm.io.hf.to_hf``), greedy decoding of --new-tokens tokens after a
--prompt-len token prompt, at batch 1 and 8:

- tinylm ``generate`` (prompt in one pass, then one token per step through the cache)
- Hugging Face ``GPT2LMHeadModel.generate`` (its own cache, greedy, same threads)
- tinylm without a cache: a full forward over the whole sequence for every token

plus the time per token as the context grows (64 -> 512), and the machine's memory
read bandwidth (a large-array sum), which gives the batch-1 ceiling: a cached step
must read every weight once, so tokens/s <= bandwidth / weight bytes.

Writes the table and benchmarks/sample.png into BENCHMARKS.md under
"## Sampling throughput" (between the bench:sample markers) and prints the table.

    python benchmarks/sample.py            # about 2-4 minutes on 2 cores

``--models`` adds (default) a Llama-shaped model: 6 layers, E=384, 6 query heads and 2
key/value heads (grouped-query attention), RMSNorm, RoPE, SwiGLU (F=1024), untied head,
vocabulary 32000 (``LLAMA``), against Hugging Face ``LlamaForCausalLM.generate`` on the
same weights (``tinylm.io.hf.to_hf``), greedy ids compared; its table goes under
"## Sampling throughput: Llama-shaped model" (bench:sample-llama markers).

    python benchmarks/sample.py            # about 3-6 minutes on 2 cores
    python benchmarks/sample.py --models llama --new-tokens 64 --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402
from tinylm import GPT, ModelConfig, generate, native  # noqa: E402
from tinylm.core.config import resolve_arch  # noqa: E402
from tinylm.io.hf import to_hf  # noqa: E402
from tinylm.use.sampling import generate_stream  # noqa: E402

HERE = Path(__file__).resolve().parent
PNG = HERE / "sample.png"
#: The Llama-shaped model of issue 13 (the llama preset: RMSNorm, RoPE, SwiGLU, no biases).
LLAMA = resolve_arch("llama", dict(vocab_size=32000, context_length=512, n_layer=6, n_head=6,
                                   n_kv_head=2, n_embd=384))


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the median time of ``sum`` over a float32 array of
    ``nbytes``, with torch's threads (the same as decoding). The default, 512 MiB, is
    larger than the caches; an array the size of the weights, summed again and again,
    measures the bandwidth from wherever the weights themselves stay between steps."""
    a = torch.empty(nbytes // 4).normal_()
    return a.numel() * 4 / median_seconds(lambda: a.sum(), repeats)


def weight_bytes(model: GPT) -> int:
    """Bytes a cached decoding step must read: every weight once (the tied LM head is
    the token embedding, read in full), but only one row of each embedding lookup."""
    total = 0
    for name, p in model.named_parameters():  # a tied head is listed once, as tok_emb
        if name in ("tok_emb.weight", "pos_emb.weight"):
            continue
        total += p.numel() * p.element_size()
    total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def uncached_greedy(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding with a full forward over the whole sequence for every token
    (only the last position goes through the LM head, as generate does)."""
    seq = prompt
    with torch.inference_mode():
        for _ in range(n):
            h = model.hidden_states(seq)  # (B, T, E), no cache
            nxt = model.lm_head(h[:, -1]).argmax(-1, keepdim=True)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def hf_greedy(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0)


def cached_ms_per_token(model: GPT, context: int, steps: int, repeats: int) -> float:
    """Median ms per cached step when the sequence grows from context - steps to context."""
    prompt = torch.randint(0, model.config.vocab_size, (1, context - steps))

    def run() -> float:
        stream = generate_stream(model, prompt, steps, temperature=0)
        next(stream)  # the prompt pass and the first token
        t = time.perf_counter()
        for _ in stream:
            pass
        return (time.perf_counter() - t) / (steps - 1)

    run()
    return 1e3 * statistics.median(run() for _ in range(repeats))


def uncached_ms_per_token(model: GPT, context: int, repeats: int) -> float:
    """Median ms of one full forward over ``context`` tokens (one uncached step there)."""
    ids = torch.randint(0, model.config.vocab_size, (1, context))

    def step() -> None:
        with torch.inference_mode():
            model.lm_head(model.hidden_states(ids)[:, -1]).argmax(-1)

    return 1e3 * median_seconds(step, repeats)


def plot(rows, contexts, cached, uncached, ceiling_tps, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["tinylm (KV cache)", "HF generate", "tinylm, no cache"]
    keys = ["tinylm", "hf", "nocache"]
    width = 0.25
    for j, (name, key) in enumerate(zip(names, keys, strict=True)):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax1.bar(xs, [r[key] for r in rows], width, label=name)
    ax1.axhline(ceiling_tps, color="k", ls="--", lw=1,
                label=f"batch-1 bandwidth ceiling ({ceiling_tps:.0f} tok/s)")
    ax1.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax1.set_ylabel("new tokens / s (higher is better)")
    ax1.set_title("Greedy generation throughput")
    ax1.legend(fontsize=8)
    ax2.plot(contexts, cached, "o-", label="tinylm (KV cache)")
    ax2.plot(contexts, uncached, "s-", label="tinylm, no cache (full forward)")
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("ms per token, batch 1")
    ax2.set_yscale("log")
    ax2.set_title("Time per token as the context grows")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def llama_section(args: argparse.Namespace) -> str:
    """Greedy tokens/s of the Llama-shaped model: tinylm vs LlamaForCausalLM.generate."""
    torch.manual_seed(0)
    config = ModelConfig(**LLAMA)
    model = GPT(config).eval()
    hf = to_hf(model)  # LlamaForCausalLM, the same weights
    n, load = args.new_tokens, os.getloadavg()[0]
    with torch.inference_mode(), native.plan(model, "cpu").decoder(1) as decoder:
        path = decoder.path
    lines = [
        f"Model: random weights, Llama-shaped: {config.n_layer} layers, {config.n_head} "
        f"query heads and {config.n_kv_head} key/value heads (GQA) of D={config.head_dim}, "
        f"E={config.n_embd}, RMSNorm, RoPE (θ={config.rope_theta:g}), SwiGLU "
        f"(F={config.ffn_dim}), untied head, C={config.context_length}, "
        f"V={config.vocab_size} ({model.num_parameters() / 1e6:.1f} M parameters, fp32). "
        f"Greedy decoding of {n} new tokens after a {args.prompt_len}-token prompt; median "
        f"of {args.repeats} runs. Hugging Face: `{type(hf).__name__}.generate` "
        f"(transformers, its KV cache, default attention) on the same weights. "
        f"{os.cpu_count()} CPU cores, {args.threads} threads; load average {load:.2f} at "
        f"the start. tinylm's decoding path: {path}.",
        "",
        "| batch | tinylm tok/s | HF generate tok/s | tinylm / HF | same tokens as HF |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for B in args.batches:
        prompt = torch.randint(0, config.vocab_size, (B, args.prompt_len))
        same = torch.equal(generate(model, prompt, n, temperature=0), hf_greedy(hf, prompt, n))
        t_ours = median_seconds(lambda p=prompt: generate(model, p, n, temperature=0),
                                args.repeats)
        t_hf = median_seconds(lambda p=prompt: hf_greedy(hf, p, n), args.repeats)
        print(f"llama batch {B}: tinylm {B * n / t_ours:.1f} tok/s, HF {B * n / t_hf:.1f}; "
              f"same tokens as HF: {same}", flush=True)
        lines.append(f"| {B} | {B * n / t_ours:.1f} | {B * n / t_hf:.1f} | "
                     f"{t_hf / t_ours:.2f}x | {'yes' if same else 'no'} |")
    lines += ["", "Target (issue 13): tinylm ≥ 2× HF at batch 1 and ≥ 1.8× at batch 8.", "",
              "Command: `python benchmarks/sample.py`"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size V")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--models", default="gpt2,llama",
                        help="comma-separated: gpt2 (GPT-2 small shape, V=--vocab) and/or "
                        "llama (the Llama-shaped model, V=32000)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {m.strip() for m in args.models.split(",") if m.strip()}
    if not models or models - {"gpt2", "llama"}:
        parser.error(f"--models takes gpt2 and/or llama, got {args.models!r}")
    if "llama" in models:
        body = llama_section(args)
        print(body)
        if not args.no_write:
            write_section("sample-llama", "Sampling throughput: Llama-shaped model", body)
    if "gpt2" not in models:
        return 0
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=args.vocab, context_length=512, n_layer=6, n_head=6,
                         n_embd=384)
    model = GPT(config).eval()
    hf = to_hf(model)
    n = args.new_tokens
    load = os.getloadavg()[0]

    bandwidth = read_bandwidth()
    wbytes = weight_bytes(model)
    ceiling_tps = bandwidth / wbytes
    cached_bandwidth = read_bandwidth(wbytes, repeats=20)  # the weights' own size
    native.accelerate(model, "cpu")  # the uncached forwards below: tinylm's fast paths
    with torch.inference_mode(), native.plan(model, "cpu").decoder(1) as decoder:
        path = decoder.path

    rows = []
    for B in args.batches:
        prompt = torch.randint(0, args.vocab, (B, args.prompt_len))
        ours = generate(model, prompt, n, temperature=0)
        same = torch.equal(ours, hf_greedy(hf, prompt, n))
        t_ours = median_seconds(lambda p=prompt: generate(model, p, n, temperature=0),
                                args.repeats)
        t_hf = median_seconds(lambda p=prompt: hf_greedy(hf, p, n), args.repeats)
        start = time.perf_counter()  # one run: it is slow, and its spread is small
        uncached_greedy(model, prompt, n)
        t_nc = time.perf_counter() - start
        rows.append({"batch": B, "tinylm": B * n / t_ours, "hf": B * n / t_hf,
                     "nocache": B * n / t_nc, "same": same})
        print(f"batch {B}: tinylm {B * n / t_ours:.1f} tok/s, HF {B * n / t_hf:.1f}, "
              f"no cache {B * n / t_nc:.1f}; same tokens as HF: {same}", flush=True)

    steps = 32
    cached = [cached_ms_per_token(model, c, steps, args.repeats) for c in args.contexts]
    uncached = [uncached_ms_per_token(model, c, args.repeats) for c in args.contexts]

    lines = [
        f"Model: random weights, {config.n_layer} layers x {config.n_head} heads x "
        f"E={config.n_embd}, C={config.context_length}, V={config.vocab_size} "
        f"({model.num_parameters() / 1e6:.1f} M parameters, fp32). Greedy decoding of {n} "
        f"new tokens after a {args.prompt_len}-token prompt; median of {args.repeats} runs "
        f"(the no-cache column: 1 run). Hugging Face: `GPT2LMHeadModel.generate` "
        f"(transformers, its KV cache) on the same weights. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, "
        f"{args.threads} threads; load average {load:.2f} at the start. tinylm's decoding "
        f"path: {path} (see `tinylm.native.decoding`).",
        "",
        "| batch | tinylm tok/s | HF generate tok/s | tinylm no cache tok/s | tinylm / HF "
        "| tinylm / no cache | same tokens as HF |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tinylm']:.1f} | {r['hf']:.1f} | {r['nocache']:.1f} "
                     f"| {r['tinylm'] / r['hf']:.2f}x | {r['tinylm'] / r['nocache']:.2f}x "
                     f"| {'yes' if r['same'] else 'no'} |")
    b1 = next((r for r in rows if r["batch"] == 1), None)
    lines += [
        "",
        f"Memory-bandwidth ceiling at batch 1: a cached step reads every weight once, "
        f"{wbytes / 1e6:.1f} MB (the blocks' {sum(p.numel() for p in model.blocks.parameters()) * 4 / 1e6:.1f} MB "  # noqa: E501
        f"plus the {config.vocab_size}x{config.n_embd} LM head); measured read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (`sum` of a 512 MB float32 array, {args.threads} "
        f"threads), so at most {ceiling_tps:.1f} tokens/s"
        + (f"; tinylm reaches {b1['tinylm']:.1f} tokens/s = "
           f"**{100 * b1['tinylm'] / ceiling_tps:.0f} % of the ceiling**." if b1 else ".")
        + f" The same `sum` over an array of the weights' size, read again and again as "
        f"the weights are between steps, runs at {cached_bandwidth / 1e9:.1f} GB/s "
        f"(the data stays in the CPU's caches); against that stricter ceiling, "
        f"{cached_bandwidth / wbytes:.1f} tokens/s, "
        + (f"tinylm is at {100 * b1['tinylm'] * wbytes / cached_bandwidth:.0f} %." if b1
           else "."),
        "",
        "Time per token (batch 1) as the context grows: cached = one step through the KV "
        f"cache (median over {steps - 1} steps ending at that length); no cache = one full "
        "forward over that many tokens.",
        "",
        "| context | " + " | ".join(str(c) for c in args.contexts) + " |",
        "| --- | " + " | ".join("---:" for _ in args.contexts) + " |",
        "| tinylm cached, ms/token | " + " | ".join(f"{v:.2f}" for v in cached) + " |",
        "| no cache, ms/token | " + " | ".join(f"{v:.2f}" for v in uncached) + " |",
        "",
        "![sampling throughput](benchmarks/sample.png)",
        "",
        "Command: `python benchmarks/sample.py`",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        plot(rows, args.contexts, cached, uncached, ceiling_tps, PNG)
        write_section("sample", "Sampling throughput", body)
        print(f"wrote {PNG} and BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
