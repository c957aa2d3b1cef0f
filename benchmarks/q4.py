"""Packed 4-bit weights (issue 30 item 2): decoding speed at batch 1, side by side in one run.

One model with random weights of SmolLM2-135M's shape (llama layout: 30 layers, E=576,
9 query / 3 key-value heads, SwiGLU 1536, V=49152, tied head), its blocks' Linear layers
stored as:

- int8 (``tinylm quantize``'s default: int8 per output channel; ``csrc/quant.c``,
  float32 activations)
- Q8_0, Q4_0, Q4_1 blocks (``tinylm.layers.blocks``: ``tinylm quantize --bits 4
  --group-size 32 [--asymmetric]``, or a GGUF file's tensors as they are; ``csrc/blocks.c``,
  activations quantized per block of 32)

and, with ``--untied``, an untied LM head quantized the same way (a tied head is the
token embedding and stays float32: 113 MB read per token, more than the 4-bit blocks).
Greedy decoding after a --prompt-len token prompt; tokens/s = (n2 − n1) / (t(n2) −
t(n1)) with n1 = 1 and n2 = 1 + --new-tokens, so the prompt's cost cancels. The variants
are timed in turns (one repeat of each, then the next round), medians over --repeats
rounds, so a change in the machine's load hits all of them alike; the load average is
printed with the table.

    python benchmarks/q4.py                       # about two minutes on 2 cores
    python benchmarks/q4.py --untied --no-write
"""

from __future__ import annotations

import argparse
import copy
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
from tinylm.commands.quantize import model_bytes, quantize  # noqa: E402
from tinylm.layers.blocks import BlockLinear  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, context_length=512, n_layer=30, n_head=9, n_kv_head=3,
               n_embd=576, ffn_hidden=1536, norm="rmsnorm", position="rope", mlp="swiglu",
               bias=False, rope_theta=100000.0)


def variants(base: GPT, head: bool) -> dict[str, GPT]:
    out = {}
    for name, how in (("int8", dict(bits=8)), ("Q8_0", "Q8_0"),
                      ("Q4_0", dict(bits=4, group_size=32)),
                      ("Q4_1", dict(bits=4, group_size=32, asymmetric=True))):
        m = copy.deepcopy(base)
        if isinstance(how, str):  # Q8_0: what a GGUF import keeps (quantize writes int8)
            for n, lin in list(m.named_modules()):
                if type(lin) is torch.nn.Linear and (head or n != "lm_head"):
                    m.set_submodule(n, BlockLinear.from_linear(lin, how))
        else:
            quantize(m, include_head=head, **how)
        out[name] = m.eval()
    return out


def decode_seconds(model: GPT, prompt: torch.Tensor, n: int) -> float:
    t = time.perf_counter()
    generate(model, prompt, n, temperature=0)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--untied", action="store_true", help="an untied head, quantized too")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert native.available(), "the native kernels are needed"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.no_grad():
        base = GPT(ModelConfig(**SMOLLM2, tie_embeddings=not args.untied)).eval()
    models = variants(base, args.untied)
    del base
    prompt = torch.randint(0, SMOLLM2["vocab_size"], (1, args.prompt_len))
    n1, n2 = 1, 1 + args.new_tokens
    rates: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():  # warm-up: packing, the first step
        decode_seconds(m, prompt, n1)
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for name, m in models.items():
            dt = decode_seconds(m, prompt, n2) - decode_seconds(m, prompt, n1)
            rates[name].append((n2 - n1) / dt)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rates.items()}
    head = "untied head quantized too" if args.untied else "tied head, float32"
    rows = [f"| {k} | {model_bytes(models[k]) / 1e6:.1f} | {med[k]:.1f} | "
            f"{min(rates[k]):.1f}–{max(rates[k]):.1f} | {med[k] / med['int8']:.2f}× |"
            for k in models]
    cmd = "python benchmarks/q4.py" + (" --untied" if args.untied else "")
    body = "\n".join([
        f"`{cmd}` ({args.repeats} rounds, {args.threads} thread(s), prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens; {platform.processor() or 'cpu'}, "
        f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after, shared "
        f"machine): SmolLM2-135M's shape with random weights, {head}.",
        "",
        "| blocks' Linear layers | model MB | tok/s (median) | range | vs int8 |",
        "|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if not args.no_write:
        section = "q4-untied" if args.untied else "q4"
        write_section(section, "Packed 4-bit weights: decoding at batch 1"
                      + (" (untied head)" if args.untied else ""), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
