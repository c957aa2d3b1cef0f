"""Tokens/s and memory per rank of ``tinylm train --strategy ddp | zero1 | fsdp`` at 1 and
2 ranks (torchrun; gloo on CPU, nccl on CUDA).

Each configuration is its own ``tinylm train`` launch (one process, or ``torchrun
--standalone --nproc_per_node 2``) on the built-in python-docs corpus, ``--steps``
optimizer steps of the same global batch (2 ranks accumulate half as often), no periodic
evaluation, one save at the end. Reported per configuration: training tokens/s over the
steps after the first log interval (warm-up excluded), and per rank the training state
it holds (weights + gradients + optimizer moments, a shard counting its local part) and
its peak resident memory during the steps (both from the run's train_state.json).

On a CPU with gloo this measures correctness of the setup and memory, not speed: two
ranks on a 2-core machine share the cores, and gloo's collectives run over loopback TCP.
At one rank the strategies compute the same thing (``--strategy`` then only chooses the
checkpoint layout). With ``--preset gpt2 --device cuda --compile`` (GPT-2 124M shapes,
bf16 autocast) the table also gets the model FLOPs utilisation, MFU = 6 · parameters ·
tokens/s / (ranks · ``--peak-tflops``), and goes under a GPU heading (``--ranks 1`` on a
machine with one GPU). The GPU path has not been run yet.

The table is printed and, with ``--write``, put in BENCHMARKS.md between
``<!-- bench:distributed -->`` markers (``bench:distributed-gpu`` for a GPU run).
Quiet-machine command (the numbers in the table)::

    python benchmarks/distributed.py --write

A quick check that the script works (numbers meaningless)::

    python benchmarks/distributed.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))

from report import write_section  # noqa: E402

PRESETS = {
    # ~3.2M parameters: the optimizer state dominates the memory, steps stay short on CPU.
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 256, "context_length": 128,
              "dropout": 0.0, "batch": 8},
    # GPT-2 124M shapes (the tokenizer's vocabulary replaces 50257).
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "context_length": 1024,
             "dropout": 0.0, "batch": 8},
}
STRATEGIES = ("ddp", "zero1", "fsdp")


def _prepare(work: Path, context_length: int, bpe: bool) -> Path:
    from tinylm.data import prepare

    kw = {"tokenizer": "bpe", "vocab_size": 8192} if bpe else {"tokenizer": "char"}
    return prepare(work / "data", corpus="python-docs", context_length=context_length,
                   progress=False, **kw).dir


def _launch(args: argparse.Namespace, data: Path, out: Path, strategy: str,
            ranks: int) -> dict:
    preset = dict(PRESETS[args.preset])
    batch = preset.pop("batch")
    model_flags = [f"--{k.replace('_', '-')}={v}" for k, v in preset.items()]
    per_rank_accum = max(1, 2 // ranks)  # the same global batch at 1 and 2 ranks
    flags = [*model_flags, "--batch-size", str(batch), "--grad-accum", str(per_rank_accum),
             "--max-steps", str(args.steps), "--warmup-steps", "2", "--eval-every",
             str(10**9), "--save-every", str(10**9), "--eval-windows", "2",
             "--log-every", str(max(1, args.steps // 4)), "--device", args.device,
             "--strategy", strategy, "--threads", str(args.threads), "-q"]
    if args.compile:
        flags.append("--compile")
    train = ["-m", "tinylm", "train", "--data", str(data), "--out", str(out), *flags]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(ranks), *train] if ranks > 1 else [sys.executable, *train])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{strategy} x{ranks} failed:\n{proc.stderr[-3000:]}")
    return _result(out, strategy, ranks)


def _result(out: Path, strategy: str, ranks: int) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    later = speeds[1:] or speeds
    state = json.loads((out / "latest" / "train_state.json").read_text())
    config = json.loads((out / "latest" / "config.json").read_text())
    mem = state["memory"]
    held = [w + g + o for w, g, o in zip(mem["weights_mib"], mem["grads_mib"],
                                         mem["optimizer_mib"], strict=True)]
    return {"strategy": strategy, "ranks": ranks, "tok_s": sum(later) / len(later),
            "held_mib": held, "rss_mib": mem["peak_rss_mib"],
            "tokens_per_step": state["tokens_per_step"], "model": config["model"]}


def _params(model: dict) -> int:
    from tinylm.core.config import ModelConfig
    from tinylm.core.model import GPT

    return GPT(ModelConfig(**model)).num_parameters()


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    n = _params(rows[0]["model"])
    gpu = args.device.startswith("cuda")
    lines = [f"{args.preset} model ({n / 1e6:.1f}M parameters, context "
             f"{rows[0]['model']['context_length']}), {rows[0]['tokens_per_step']:,} tokens "
             f"per step, {args.steps} steps, device {args.device}"
             f"{' + torch.compile' if args.compile else ''}, {args.threads} thread(s) per "
             f"rank, {os.cpu_count()} CPUs" + ("" if gpu else "; gloo on CPU measures "
             "correctness and memory, not speed") + ".", "",
             "| strategy | ranks | tokens/s | held per rank (MiB) | peak RSS per rank (MiB) |"
             + (" MFU |" if gpu else ""),
             "| --- | --- | --- | --- | --- |" + (" --- |" if gpu else "")]
    for r in rows:
        held = " / ".join(f"{v:,.1f}" for v in r["held_mib"])
        rss = " / ".join(f"{v:,.0f}" for v in r["rss_mib"])
        line = f"| {r['strategy']} | {r['ranks']} | {r['tok_s']:,.0f} | {held} | {rss} |"
        if gpu:
            mfu = 6 * n * r["tok_s"] / (r["ranks"] * args.peak_tflops * 1e12)
            line += f" {100 * mfu:.1f}% |"
        lines.append(line)
    lines += ["", "Held = weights + gradients + optimizer moments that rank holds (fp32); "
              "peak RSS includes torch itself, the data and activations."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="model shapes (default: small)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ranks", default="1,2",
                   help="comma-separated process counts (default: 1,2; on CUDA at most the "
                   "number of GPUs: nccl needs one GPU per rank)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak bf16 TFLOP/s of one GPU for MFU (default: 989, H100 SXM dense)")
    p.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tinylm-bench-distributed-"))
    data = _prepare(work, PRESETS[args.preset]["context_length"], args.preset == "gpt2")
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = [_launch(args, data, work / f"{s}-{r}", s, r) for r in ranks for s in STRATEGIES]
    table = _table(rows, args)
    print(table)
    if args.write:
        gpu = args.device.startswith("cuda")
        write_section("distributed-gpu" if gpu else "distributed",
                      "Distributed training on a GPU (ddp, zero1, fsdp)" if gpu else
                      "Distributed training: ddp, zero1, fsdp (gloo, CPU)", table)


if __name__ == "__main__":
    main()
