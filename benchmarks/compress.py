"""Low-rank compression of a trained model: loss before/after, fine-tuning, and a sweep.

    python benchmarks/compress.py --model runs/demo --data data/python-docs-bpe \
        [--fraction 0.5] [--finetune 200] [--fractions 0.9,0.75,0.5,0.35,0.25] \
        [--png benchmarks/compress_sweep.png] [--out runs/compress-bench] [--no-write]

Runs the real commands, as a user would, and records them with their output:

1. ``tinylm compress --params-fraction P --data DATA`` (loss before and after),
2. the same with ``--finetune STEPS`` (loss after fine-tuning the factorised model), and
   ``--params-fraction 1 --finetune STEPS`` as a control (the uncompressed model trained
   the same number of extra steps),
3. ``tinylm compress --sweep --data DATA --plot PNG`` (loss and forward speed per fraction).

The commands and their output are printed and written to BENCHMARKS.md between
``<!-- bench:compress -->`` markers under ``## Compression``, with the PNG beside this file.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> tuple[str, float]:
    """Run a tinylm command from the repository root; (stdout, seconds). Fails loudly."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tinylm", *cmd], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"tinylm {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    print(f"$ tinylm {shlex.join(cmd)}   # {seconds:.0f} s\n{proc.stdout}", flush=True)
    return proc.stdout, seconds


def loss_line(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    if not match:
        sys.exit(f"could not find {pattern!r} in the output:\n{text}")
    return float(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="runs/demo", help="trained checkpoint or run folder")
    ap.add_argument("--data", default="data/python-docs-bpe",
                    help="prepared data the model was trained on")
    ap.add_argument("--fraction", type=float, default=0.5, help="params fraction to report")
    ap.add_argument("--finetune", type=int, default=200, help="fine-tuning steps")
    ap.add_argument("--lr", type=float, default=None, help="fine-tuning lr (tinylm's default)")
    ap.add_argument("--fractions", default="0.9,0.75,0.5,0.35,0.25", help="sweep fractions")
    ap.add_argument("--png", default="benchmarks/compress_sweep.png", help="sweep plot")
    ap.add_argument("--out", default="runs/compress-bench", help="folder for the checkpoints")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args()

    out = Path(args.out)
    base = ["compress", "--model", args.model, "--data", args.data]
    frac = ["--params-fraction", f"{args.fraction:g}"]
    plain_cmd = [*base, "--out", str(out / f"p{args.fraction:g}"), *frac]
    tuned_cmd = [*base, "--out", str(out / f"p{args.fraction:g}-ft{args.finetune}"), *frac,
                 "--finetune", str(args.finetune)]
    # Control: the uncompressed model (fraction 1 factorises nothing) fine-tuned the same
    # way, to separate what fine-tuning wins back from what extra training alone gives.
    control_cmd = [*base, "--out", str(out / f"p1-ft{args.finetune}"), "--params-fraction",
                   "1", "--finetune", str(args.finetune)]
    if args.lr is not None:
        tuned_cmd += ["--lr", f"{args.lr:g}"]
        control_cmd += ["--lr", f"{args.lr:g}"]
    sweep_cmd = [*base, "--sweep", "--fractions", args.fractions, "--plot", args.png]

    plain, t_plain = run(plain_cmd)
    tuned, t_tuned = run(tuned_cmd)
    control, _ = run(control_cmd)
    sweep, t_sweep = run(sweep_cmd)

    before = loss_line(plain, r"val loss: ([0-9.]+) ->")
    after = loss_line(plain, r"val loss: [0-9.]+ -> ([0-9.]+)")
    tuned_loss = loss_line(tuned, r"after fine-tuning \d+ steps: val loss ([0-9.]+)")
    control_loss = loss_line(control, r"after fine-tuning \d+ steps: val loss ([0-9.]+)")
    table = sweep[sweep.index("| target"):].split("\n\n")[0].strip()
    table = "\n".join(line for line in table.splitlines() if line.startswith("|"))
    png = Path(args.png)

    def pct(loss: float) -> str:
        return f"{100 * (loss / before - 1):+.1f} %"

    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python "
               f"{platform.python_version()}, torch {__import__('torch').__version__}")
    body = f"""\
Model: `{args.model}`, data: `{args.data}` (validation split, all windows). {machine}.
Generated by `python benchmarks/compress.py --model {args.model} --data {args.data}`.

| | val loss | vs uncompressed |
|---|---:|---:|
| uncompressed | {before:.4f} | |
| `--params-fraction {args.fraction:g}` | {after:.4f} | {pct(after)} |
| … then `--finetune {args.finetune}` | {tuned_loss:.4f} | {pct(tuned_loss)} |
| control: uncompressed, same `--finetune {args.finetune}` | {control_loss:.4f} | \
{pct(control_loss)} |

The control (`--params-fraction 1` factorises nothing) shows how much of the fine-tuned
figure is simply more training rather than recovery from the factorisation.

```
$ tinylm {shlex.join(plain_cmd)}
{plain.strip()}
```

```
$ tinylm {shlex.join(tuned_cmd)}
{tuned.strip()}
```

Sweep (`tinylm {shlex.join(sweep_cmd)}`, {t_sweep:.0f} s): validation loss and
forward-pass speed (batch 8 × full context, fp32 CPU; median of 5 rounds of 3 passes,
the models timed in turn within each round) per share of parameters kept; the first row
is the uncompressed model.

{table}

![loss and speed vs parameters kept]({png.as_posix()})
"""
    print(body)
    if not args.no_write:
        print(f"wrote {write_section('compress', 'Compression', body)}")


if __name__ == "__main__":
    main()
