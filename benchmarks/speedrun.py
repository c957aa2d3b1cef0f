"""Time to quality: wall-clock seconds until the validation loss first reaches a target,
per architecture preset (``tinylm train --arch``), side by side in one run.

    python benchmarks/speedrun.py --input /path/to/tinyshakespeare/input.txt \\
        [--arch gpt2,llama,modern] [--compile off|on|both] [--target 1.886] [--runs 3]
        [--no-write]

Every preset gets the same data, shapes (``MODEL``), optimizer and schedule; runs are
interleaved (seed 0 of each preset, then seed 1, ...) so a change in machine load
affects all presets alike. The table gives each preset's median and its speed-up over
``gpt2`` (issue 13's target: ``modern`` at least 1.2x faster than ``gpt2``).

The text is prepared with the char tokenizer, the last 10 % as validation (as nanoGPT's
shakespeare_char baseline). The clock starts before the model is built and stops when an
evaluation first reports a validation loss <= target; it includes every evaluation.
Each evaluation is exact: the mean next-token loss over the WHOLE validation split in
non-overlapping windows of C tokens (``tinylm.use.evaluation.evaluate``). Evaluations start
once the smoothed training loss is below the target + 0.1 (the val/train gap here is
~0.1), every ``--eval-every`` steps, and every half of that once a val loss is within
0.03 of the target.

The loop is tinylm's pieces, not ``tinylm.training.loop.train``: the model with the fast
paths ``train()`` applies (``tinylm.acceleration.accelerate``: the fused native block
where the layout has one), ``get_batch``, the optimizer builder (``optimizer="muon"``),
the warm-up + cosine ``lr_at`` and ``evaluate``. ``train()`` has no stop-at-target and
writes checkpoints, metrics and a plot at every evaluation, which would be timed here;
the step itself is the same. With ``--compile on`` (or ``both``: each preset eager and
compiled, interleaved) the training step's loss function is ``torch.compile``d through the
plan (``Plan.compile``: what ``tinylm train --compile`` uses, the native kernels as custom
ops inside the graph); the clock includes the compile warm-up (the first step, also
reported apart), evaluations stay eager.
Prints a table, writes benchmarks/speedrun.png and the BENCHMARKS.md section
between ``<!-- bench:speedrun -->`` markers (with ``--compile on|both``: the section
``<!-- bench:speedrun-compile -->``, no plot); median over ``--runs`` (seeds 0, 1, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402
from tinylm import acceleration  # noqa: E402
from tinylm.core.config import ARCH_PRESETS, ModelConfig, TrainConfig, resolve_arch  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402
from tinylm.data import get_batch, load_prepared, prepare  # noqa: E402
from tinylm.training import build_optimizer, lr_at, set_lr  # noqa: E402
from tinylm.use.evaluation import evaluate  # noqa: E402

HERE = Path(__file__).resolve().parent
# The best settings found for this 2-core CPU (see BENCHMARKS.md for the search).
MODEL = dict(n_layer=4, n_head=4, n_embd=128, context_length=64, dropout=0.0)
# embedding_lr_ratio only moves an untied token embedding (llama, modern): gpt2's is its
# head and keeps the lr (BENCHMARKS.md has the probe of both).
TRAIN = dict(optimizer="muon", lr=3e-3, batch_size=12, warmup_steps=100, max_steps=800,
             min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
             embedding_lr_ratio=10.0)


def run_once(data, target: float, seed: int, eval_every: int, threads: int,
             arch: str = "gpt2", compiled: bool = False) -> dict:
    """One timed run of preset ``arch`` (``compiled``: its loss under torch.compile);
    returns the time to target, the first step's time and the loss history."""
    torch.set_num_threads(threads)
    cfg = TrainConfig(**TRAIN, seed=seed)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=data.vocab_size, **resolve_arch(arch, MODEL))).train()
    plan = acceleration.accelerate(model, "cpu")  # the fast paths train() takes (tinylm.native)
    loss_fn = plan.compile(model.loss) if compiled else model.loss
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(seed)
    B, C = cfg.batch_size, model.config.context_length
    ema, last_val, eval_s, first = None, float("inf"), 0.0, None
    train_curve, val_curve, reached = [], [], None
    for step in range(cfg.max_steps):
        lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                   total_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)
        set_lr(optimizer, lr)
        t_step = time.perf_counter()
        x, y = get_batch(data.train, B, C, gen)  # (B, C), (B, C)
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        first = first if first is not None else time.perf_counter() - t_step
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        train_curve.append((step + 1, time.perf_counter() - t0, value))
        every = eval_every // 2 if last_val < target + 0.03 else eval_every
        if ema < target + 0.1 and (step + 1) % every == 0:
            te = time.perf_counter()
            last_val = evaluate(model, data.val, context_length=C, batch_size=64).loss
            eval_s += time.perf_counter() - te
            val_curve.append((step + 1, time.perf_counter() - t0, last_val))
            if last_val <= target:
                reached = time.perf_counter() - t0
                break
    return {"arch": arch, "compiled": compiled, "seed": seed, "seconds": reached,
            "steps": step + 1, "val_loss": last_val, "first_step_s": first,
            "load": os.getloadavg()[0],
            "eval_seconds": eval_s, "evaluations": len(val_curve),
            "train": train_curve, "val": val_curve}


def plot(runs: list[dict], target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for col, (ax, xlabel) in enumerate(zip(axes, (
            "wall-clock seconds (model build, training, evaluations)", "optimizer step"),
            strict=True)):
        x_of = (lambda p: p[1]) if col == 0 else (lambda p: p[0])
        for r in runs:
            v = [p[2] for p in r["train"]]
            k = 25  # running mean over k steps for a readable train curve
            smooth = [sum(v[max(0, i - k + 1):i + 1]) / len(v[max(0, i - k + 1):i + 1])
                      for i in range(len(v))]
            line, = ax.plot([x_of(p) for p in r["train"]], smooth, lw=1, alpha=0.7,
                            label=f"{r['arch']} train (seed {r['seed']})")
            ax.plot([x_of(p) for p in r["val"]], [p[2] for p in r["val"]], "o-",
                    color=line.get_color(), ms=3, label=f"{r['arch']} val (seed {r['seed']})")
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target}")
        ax.set(xlabel=xlabel, ylim=(1.4, 3.0))
    axes[0].set(ylabel="loss")
    axes[1].legend(fontsize=7)
    fig.suptitle("tinylm speedrun: tiny Shakespeare (char)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _label(run: dict) -> str:
    return run["arch"] + (" --compile" if run["compiled"] else "")


def _median(runs: list[dict]) -> float | None:
    times = [r["seconds"] for r in runs]
    return statistics.median(times) if times and all(t is not None for t in times) else None


def render(runs: list[dict], target: float, args: argparse.Namespace, vocab: int,
           n_train: int, n_val: int) -> str:
    m = MODEL
    archs = list(dict.fromkeys(r["arch"] for r in runs))
    lines = [
        f"Char tokenizer (V={vocab}), {n_train:,} train / {n_val:,} val tokens (last 10 %). "
        f"Model {m['n_layer']} layers, {m['n_head']} heads, E={m['n_embd']}, "
        f"C={m['context_length']}; optimizer `{TRAIN['optimizer']}` (Muon for weight "
        f"matrices at 10× the lr, AdamW for the rest; an untied token embedding at "
        f"{TRAIN['embedding_lr_ratio']:g}× the lr), lr {TRAIN['lr']:g}, batch "
        f"{TRAIN['batch_size']}, warm-up {TRAIN['warmup_steps']} + cosine over "
        f"{TRAIN['max_steps']} steps, grad clip {TRAIN['grad_clip']}, fp32, "
        f"{args.threads} threads. Validation: exact mean over the whole split. Presets "
        f"(`tinylm train --arch`): " + "; ".join(
            f"`{a}` = " + ", ".join(f"{k}={v}" for k, v in ARCH_PRESETS[a].items())
            for a in archs) + ".",
        "",
        "| preset | run (seed) | seconds to ≤ target | steps | val loss | evaluations (s) "
        "| first step (s) | load (1 min) at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        sec = f"{r['seconds']:.1f}" if r["seconds"] is not None else "not reached"
        lines.append(f"| {_label(r)} | {r['seed']} | {sec} | {r['steps']} | "
                     f"{r['val_loss']:.4f} | {r['evaluations']} ({r['eval_seconds']:.1f}) | "
                     f"{r['first_step_s']:.1f} | {r['load']:.1f} |")
    lines += ["", f"| preset | median seconds to val loss ≤ {target} | speed-up vs "
              f"{_label(runs[0])} |", "|---|---|---|"]
    labels = list(dict.fromkeys(_label(r) for r in runs))
    base = _median([r for r in runs if _label(r) == labels[0]])
    for label in labels:
        med = _median([r for r in runs if _label(r) == label])
        ratio = f"{base / med:.2f}×" if med and base else "–"
        lines.append(f"| {label} | " + (f"**{med:.1f} s**" if med is not None
                                        else "**not reached**") + f" | {ratio} |")
    lines += ["", "(For scale: nanoGPT's shakespeare_char config trains a model of this "
              "kind for 2000 steps at batch 12; the steps column above is what each preset "
              "needed here.)", "",
              *(["![speedrun loss curves](benchmarks/speedrun.png)", ""]
                if args.compile == "off" else []),
              f"Command: `python benchmarks/speedrun.py --input "
              f"data/tinyshakespeare/input.txt --arch {','.join(archs)} --compile "
              f"{args.compile} --target {target} "
              f"--runs {args.runs}`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="text file, e.g. tiny Shakespeare")
    parser.add_argument("--target", type=float, default=1.886)
    parser.add_argument("--runs", type=int, default=3, help="seeds per preset")
    parser.add_argument("--arch", default="gpt2,llama,modern",
                        help="comma-separated presets to race (tinylm train --arch)")
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off",
                        help="the training step eager, compiled, or both interleaved")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, [args.input], tokenizer="char", val_fraction=0.1,
                context_length=MODEL["context_length"], force=True, progress=False)
        data = load_prepared(tmp)
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        unknown = [a for a in archs if a not in ARCH_PRESETS]
        if unknown:
            parser.error(f"unknown --arch {unknown[0]!r}; choose from {', '.join(ARCH_PRESETS)}")
        modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
        runs = []
        for seed in range(args.runs):  # interleaved: machine noise hits every preset alike
            for arch, compiled in ((a, c) for a in archs for c in modes):
                runs.append(run_once(data, args.target, seed, args.eval_every, args.threads,
                                     arch, compiled))
                r = runs[-1]
                print(json.dumps({k: r[k] for k in ("arch", "compiled", "seed", "seconds",
                                                    "steps", "val_loss", "first_step_s",
                                                    "eval_seconds")}), file=sys.stderr)
        table = render(runs, args.target, args, data.vocab_size, len(data.train),
                       len(data.val))
    print(table)
    if not args.no_write:
        if args.compile == "off":  # the presets' race
            plot(runs, args.target, HERE / "speedrun.png")
            write_section("speedrun", f"Speedrun: tiny Shakespeare to {args.target}", table)
        else:  # compile on and off: a section of its own
            write_section("speedrun-compile", "Speedrun with --compile on and off", table)


if __name__ == "__main__":
    main()
