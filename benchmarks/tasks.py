"""Task accuracy of the real model: SmolLM2-135M-Instruct on the built-in tasks and the
20 common-sense items the tests ship, with seconds per 100 items.

Runs ``tinylm eval --task ... --json`` once (one process, the GGUF file through tinylm's
cache), then writes the table into BENCHMARKS.md between ``<!-- bench:tasks -->``
markers::

    python benchmarks/tasks.py                       # 100 items a task, 0-shot
    python benchmarks/tasks.py --limit 40 --num-fewshot 3 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_section  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache/tinylm/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = ("builtin:copy", "builtin:count", "builtin:brackets", "builtin:add-digits",
         "builtin:add-words", str(ROOT / "tests/data/commonsense20.jsonl"))


def run(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "tinylm", "eval", "--model", str(args.gguf), "--json",
           "--limit", str(args.limit), "--num-fewshot", str(args.num_fewshot),
           "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    for task in args.tasks:
        cmd += ["--task", task]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"tinylm eval failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def table(report: dict, args: argparse.Namespace) -> str:
    rows = ["| task | kind | items | acc | acc_norm | random baseline | centred | s / 100 items |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in report["tasks"].items():
        norm = f"{r['acc_norm']:.3f}" if "acc_norm" in r else "-"
        rows.append(f"| {name} | {r['kind']} | {r['n']} | {r['acc']:.3f} | {norm} | "
                    f"{r['baseline']:.3f} | {r['centered']:.3f} | "
                    f"{100 * r['seconds'] / r['n']:.1f} |")
    load = os.getloadavg()[0]
    head = (f"Model: SmolLM2-135M-Instruct (`{Path(args.gguf).name}`, `--model FILE.gguf`: "
            f"dequantized to float32), greedy, {args.num_fewshot}-shot, the first "
            f"{args.limit} items of each task, batch {args.batch_size}. Machine: "
            f"{os.cpu_count()} CPU cores ({platform.machine()}), {args.threads} threads; "
            f"load average {load:.2f} at the end (a shared machine: the seconds are upper "
            f"bounds). Scored as lm-evaluation-harness scores it (docs/evaluate.md); "
            f"the 20 common-sense items are tests/data/commonsense20.jsonl.")
    cmd = (f"python benchmarks/tasks.py --limit {args.limit} --num-fewshot "
           f"{args.num_fewshot}")
    return "\n".join([head, "", *rows, "", f"Command: `{cmd}`"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--num-fewshot", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = p.parse_args()
    report = run(args)
    body = table(report, args)
    print(body)
    if not args.no_write:
        write_section("tasks", "Task accuracy", body)


if __name__ == "__main__":
    main()
