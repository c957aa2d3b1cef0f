"""Training-step throughput, peak memory and MFU: tinylm vs Hugging Face GPT-2, in one run.

    python benchmarks/train.py [--repeats 15] [--steps 10] [--threads N] [--no-write]

For each shape both models are built with the same weights (``tinylm.io.hf.to_hf``), both in
train mode with dropout 0, fp32, the same thread count, the same batches and the same
optimizer (``torch.optim.AdamW(fused=True)`` as tinylm trains, identical settings). One
step is zero_grad (set_to_none) + forward + mean cross-entropy over all B·C positions + backward +
optimizer step. Timings alternate tinylm/HF blocks so machine noise hits both alike;
the figure is the median step time over the repeats after warm-up.

Peak memory is measured per (model, shape, batch) in a fresh subprocess each: the peak
resident set size (VmHWM) during two training steps minus the RSS just before the
model is built (so imported libraries do not count). MFU is model FLOPs per second
(6·N per token for the matmul weights plus 12·L·C·E per token for attention, as in
nanoGPT/PaLM) divided by the fp32 matmul rate measured at the start of the run.

The vocabulary is 65 (the character vocabulary of tiny Shakespeare): both shapes are the
nanoGPT shakespeare_char configurations this project trains on a CPU.
The table is printed and written to BENCHMARKS.md between ``<!-- bench:train -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402
from tinylm import native  # noqa: E402
from tinylm.core.config import ModelConfig  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402

VOCAB = 65
# name -> (n_layer, n_head, n_embd, context_length)
SHAPES = {"4x128": (4, 4, 128, 64), "6x384": (6, 6, 384, 256)}
THROUGHPUT = [("4x128", 12), ("6x384", 8)]
MEMORY = [("4x128", 12), ("6x384", 8), ("6x384", 64)]
# The same for both models: torch's fused AdamW, as tinylm.training.loop uses on CPU.
OPTIMIZER = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def model_config(shape: str) -> ModelConfig:
    n_layer, n_head, n_embd, context = SHAPES[shape]
    return ModelConfig(vocab_size=VOCAB, context_length=context, n_layer=n_layer,
                       n_head=n_head, n_embd=n_embd, dropout=0.0)


def build(kind: str, config: ModelConfig, *, same_as: GPT | None = None):
    """A model in train mode and its ``step(x, y) -> loss`` closure (optimizer included)."""
    if kind == "tinylm":
        model = GPT(config)
        native.accelerate(model, "cpu")  # the fast paths, as tinylm.training.loop applies them

        def loss_fn(x, y):
            return model.loss(x, y)
    else:
        from tinylm.io.hf import to_hf

        model = to_hf(same_as if same_as is not None else GPT(config))

        def loss_fn(x, y):  # the same objective: mean CE of row t against y[:, t]
            logits = model(input_ids=x, use_cache=False).logits  # (B, C, V)
            return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        return loss

    return model, step


def batch(config: ModelConfig, B: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (B, config.context_length + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()  # ids (B, C), targets (B, C)


def matmul_rate(sizes: tuple[int, ...] = (512, 1024, 2048), seconds: float = 0.5) -> float:
    """Best observed fp32 GEMM rate (FLOP/s) of this machine at the current thread count,
    over square sizes (each timed for about ``seconds``, best of 5 blocks)."""
    best_rate = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        t = time.perf_counter()
        a @ b
        reps = max(1, int(seconds / 5 / max(time.perf_counter() - t, 1e-6)))
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            best_rate = max(best_rate, 2 * n**3 * reps / (time.perf_counter() - t))
    return best_rate


def flops_per_token(model: GPT) -> float:
    c = model.config
    n = model.num_parameters() - model.pos_emb.weight.numel()  # weights used in matmuls
    return 6 * n + 12 * c.n_layer * c.context_length * c.inner_dim


def throughput(shape: str, B: int, repeats: int, steps: int, block_s: float = 1.0) -> dict:
    """Median step time of both models, in alternating blocks of up to ``steps`` steps
    (fewer when HF's step is long, so one block lasts about ``block_s`` seconds)."""
    config = model_config(shape)
    ours, step_ours = build("tinylm", config)
    hf, step_hf = build("hf", config, same_as=ours)
    x, y = batch(config, B)
    with torch.no_grad():  # same weights, same function: the losses must agree
        ref = F.cross_entropy(hf(input_ids=x).logits.reshape(-1, VOCAB), y.reshape(-1))
        assert torch.allclose(ours.loss(x, y), ref, atol=1e-4), "models disagree"
    times: dict[str, list[float]] = {"tinylm": [], "hf": []}
    for _ in range(2):  # warm-up
        step_ours(x, y)
        t = time.perf_counter()
        step_hf(x, y)
    steps = max(1, min(steps, round(block_s / (time.perf_counter() - t))))
    for _ in range(repeats):
        for name, step in (("tinylm", step_ours), ("hf", step_hf)):
            t = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            times[name].append((time.perf_counter() - t) / steps)
    tokens = B * config.context_length
    out = {"shape": shape, "B": B, "tokens_per_step": tokens,
           "flops_per_step": flops_per_token(ours) * tokens,
           "attn_implementation": getattr(hf.config, "_attn_implementation", "?")}
    for name in times:
        out[f"{name}_step_s"] = statistics.median(times[name])
        out[f"{name}_tok_s"] = tokens / out[f"{name}_step_s"]
    return out


def _status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process; unlike ru_maxrss, VmHWM starts afresh
    at exec, so a child does not inherit its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(kind: str, shape: str, B: int, threads: int) -> None:
    """Run in a fresh process: print JSON with the RSS before build and the peak after."""
    torch.set_num_threads(threads)
    if kind == "hf":
        import transformers  # noqa: F401  (imported before the baseline, like torch)
    config = model_config(shape)
    x, y = batch(config, B)
    before = _status_bytes("VmRSS")
    _model, step = build(kind, config)
    for _ in range(2):  # the second step holds activations and the AdamW moments
        step(x, y)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"before": before, "peak": peak}))


def memory(kind: str, shape: str, B: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", kind, shape, str(B),
           "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def render(rate: float, rows: list[dict], mem: list[dict], threads: int) -> str:
    import transformers

    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{threads} threads, fp32. Measured fp32 matmul rate (best square GEMM, "
        f"measured before and after the timings): "
        f"**{rate / 1e9:.1f} GFLOP/s**.",
        "",
        f"Vocabulary {VOCAB} (tiny Shakespeare characters). Same weights, fused AdamW "
        f"(lr 3e-4, betas 0.9/0.95, wd 0.1) for both, dropout 0, train mode; HF GPT-2 uses "
        f"its default attention implementation "
        f"(`{rows[0]['attn_implementation'] if rows else '?'}`). Median step time after "
        f"warm-up; MFU = model FLOPs/s ÷ matmul rate.",
        "",
        "| shape (L×E, C) | B | tinylm tok/s | HF tok/s | tinylm / HF | tinylm MFU | HF MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n_layer, _h, n_embd, ctx = SHAPES[r["shape"]]
        mfu = {k: r["flops_per_step"] / r[f"{k}_step_s"] / rate for k in ("tinylm", "hf")}
        lines.append(
            f"| {n_layer}×{n_embd}, C={ctx} | {r['B']} | {r['tinylm_tok_s']:,.0f} | "
            f"{r['hf_tok_s']:,.0f} | **{r['tinylm_tok_s'] / r['hf_tok_s']:.2f}×** | "
            f"{mfu['tinylm']:.0%} | {mfu['hf']:.0%} |")
    lines += [
        "",
        "Peak memory of two training steps (peak RSS minus RSS before the model is "
        "built; fresh process per cell):",
        "",
        "| shape (L×E, C) | B | tinylm MiB | HF MiB | tinylm / HF |",
        "|---|---|---|---|---|",
    ]
    for m in mem:
        n_layer, _h, n_embd, ctx = SHAPES[m["shape"]]
        lines.append(f"| {n_layer}×{n_embd}, C={ctx} | {m['B']} | {m['tinylm'] / 2**20:,.0f} | "
                     f"{m['hf'] / 2**20:,.0f} | **{m['tinylm'] / m['hf']:.2f}×** |")
    lines += ["", "Command: `python benchmarks/train.py`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed blocks per model")
    parser.add_argument("--steps", type=int, default=10, help="most steps per timed block")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", nargs=3, metavar=("KIND", "SHAPE", "B"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, shape, B = args.memory_child
        memory_child(kind, shape, int(B), args.threads)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rate = matmul_rate()
    rows = []
    for shape, B in THROUGHPUT:
        rows.append(throughput(shape, B, args.repeats, args.steps))
        print(json.dumps(rows[-1]), file=sys.stderr)
    rate = max(rate, matmul_rate())
    mem = []
    if not args.skip_memory:
        for shape, B in MEMORY:
            cell = {"shape": shape, "B": B}
            for kind in ("tinylm", "hf"):
                m = memory(kind, shape, B, args.threads)
                cell[kind] = m["peak"] - m["before"]
            mem.append(cell)
            print(json.dumps(cell), file=sys.stderr)
    table = render(rate, rows, mem, args.threads)
    print(table)
    if not args.no_write:
        write_section("train", "Training throughput", table)


if __name__ == "__main__":
    main()
