"""Full fine-tuning vs LoRA on the built-in instruction set (python-qa).

One base model (``--base DIR``, e.g. the ``make demo`` run; without it a small base is
pretrained on python-docs for ``--base-seconds``), the python-qa conversations prepared
with its tokenizer, then two fine-tuning runs of the same number of steps, each in its
own process (so peak memory is each run's own): full fine-tuning and LoRA (rank
``--rank``). Reported per mode: held-out assistant-token loss before and after (every
validation row, only the tokens the loss mask counts), trainable parameters, the memory
their gradients and AdamW moments take (12 bytes per trainable parameter in fp32), peak
resident memory of the process (ru_maxrss: torch, data and activations included, which
dominate for small models), the peak of the C heap in use during the run (glibc's
``mallinfo2``, sampled every millisecond: live tensors only, where RSS also keeps what
the allocator holds after a free and moves by ±15 MB between identical runs) and
optimizer steps per second.

The table is printed and, with ``--write``, put in BENCHMARKS.md between
``<!-- bench:finetune -->`` markers. Quiet-machine command (the numbers in the table)::

    python benchmarks/finetune.py --base runs/demo --steps 300 --write

A quick check that the script works (numbers meaningless on a busy machine)::

    python benchmarks/finetune.py --base-seconds 20 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))

from report import write_section  # noqa: E402

BASE_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "context_length": 128,
              "dropout": 0.0}


def held_out_loss(model_dir: Path, data_dir: Path) -> float:
    """Mean loss over the assistant tokens of every validation row."""
    import numpy as np

    from tinylm.data.chatdata import load_chat_data
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.use.evaluation import estimate_loss

    data = load_chat_data(data_dir)
    model, _ = load_checkpoint(model_dir)
    starts = np.arange(0, len(data.val), data.row_length)
    return estimate_loss(model, data.val, starts, context_length=data.row_length - 1,
                         loss_mask=data.val_mask).loss


def _base(out: Path, seconds: float) -> Path:
    from tinylm.core.config import ModelConfig, TrainConfig
    from tinylm.data import prepare
    from tinylm.training import train

    data = prepare(out / "pretrain-data", corpus="python-docs", tokenizer="bpe",
                   vocab_size=1024, context_length=128, progress=False)
    train(ModelConfig(**BASE_MODEL), TrainConfig(batch_size=16, lr=3e-3, optimizer="muon",
                                                 warmup_steps=20, max_steps=100000,
                                                 time_budget=seconds, eval_every=10**6,
                                                 save_every=10**6, device="cpu"),
          data, out / "base", progress=False)
    return out / "base"


class HeapPeak:
    """The peak of glibc's heap in use (``mallinfo2``: arena bytes in use + mmap'd
    blocks), sampled every millisecond in a thread; None where the C library lacks it."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        try:
            self._fn = ctypes.CDLL("libc.so.6").mallinfo2
            self._fn.restype = Info
        except (OSError, AttributeError):
            self._fn = None
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            info = self._fn()
            self.peak = max(self.peak, info.uordblks + info.hblkhd)

    def __enter__(self) -> HeapPeak:
        if self._fn is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._fn is not None:
            self._thread.join()

    @property
    def mb(self) -> float | None:
        return self.peak / 2**20 if self._fn is not None else None


def run_mode(args: argparse.Namespace) -> None:
    """Child process: one fine-tuning run; prints a JSON line with its figures."""
    from tinylm.training.finetune import finetune

    overrides = {"max_steps": args.steps, "batch_size": 16, "eval_every": 10**6,
                 "save_every": 10**6, "log_every": 10**6, "device": "cpu", "seed": 0,
                 "min_lr_ratio": 0.1}
    t0 = time.perf_counter()
    with HeapPeak() as heap:
        result, info = finetune(args.base, args.data, args.out, progress=False,
                                lora_rank=args.rank if args.mode == "lora" else None,
                                overrides=overrides)
    seconds = time.perf_counter() - t0
    print(json.dumps({"mode": args.mode, "steps": result.steps, "trainable": info["trainable"],
                      "parameters": info["parameters"], "seconds": seconds,
                      "steps_per_s": result.steps / max(result.elapsed, 1e-9),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_heap_mb": heap.mb,
                      "checkpoint": str(result.checkpoint)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, help="base checkpoint/run (default: pretrain one)")
    p.add_argument("--base-seconds", type=float, default=120,
                   help="pretraining time when --base is not given (default 120)")
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per mode")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    p.add_argument("--mode", choices=("full", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.mode:
        return run_mode(args)
    from tinylm.data.chatdata import prepare_chat

    work = Path(tempfile.mkdtemp(prefix="tinylm-bench-finetune-"))
    base = args.base or _base(work, args.base_seconds)
    data = prepare_chat(work / "chat", ["python-qa"], tokenizer=base, context_length=128,
                        skip_bad=True)
    before = held_out_loss(base, data.dir)
    rows = []
    for mode in ("full", "lora"):
        proc = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--base", str(base), "--data",
             str(data.dir), "--out", str(work / mode), "--steps", str(args.steps), "--rank",
             str(args.rank), "--threads", str(args.threads)],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        if proc.returncode:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["after"] = held_out_loss(Path(r["checkpoint"]), data.dir)
        rows.append(r)
    full = rows[0]
    lines = [f"python-qa: {data.meta['chat']['conversations']['train']:,} train / "
             f"{data.meta['chat']['conversations']['val']:,} held-out conversations; "
             f"base {base}; {args.steps} steps of batch 16 x 128 tokens, dropout 0 "
             f"(finetune's default); "
             f"{args.threads} threads, {os.cpu_count()} CPUs.", "",
             "| mode | held-out loss before | after | vs full | trainable params | "
             "grads + AdamW state | peak RSS | peak heap in use | steps/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = "full" if r["mode"] == "full" else f"LoRA r={args.rank}"
        lines.append(f"| {name} | {before:.3f} | {r['after']:.3f} | "
                     f"{100 * (r['after'] / full['after'] - 1):+.1f} % | {r['trainable']:,} "
                     f"({100 * r['trainable'] / r['parameters']:.1f} %) | "
                     f"{r['trainable'] * 12 / 2**20:.1f} MB | "
                     f"{r['peak_rss_mb']:.0f} MB | "
                     + (f"{r['peak_heap_mb']:.0f} MB" if r["peak_heap_mb"] else "n/a")
                     + f" | {r['steps_per_s']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section("finetune", "Fine-tuning: full vs LoRA", table)


if __name__ == "__main__":
    main()
