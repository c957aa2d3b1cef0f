"""Throughput of ``tinylm prepare`` (MB/s of input text) against single-call encoding.

    python benchmarks/prepare.py [--size-mb 100] [--repeats 3] [--input FILE] [--no-write]

Generates a corpus of at least ``--size-mb`` MB (shuffled python-docs paragraphs with
Japanese lines, :func:`tinylm.corpora.write_synthetic`) unless ``--input`` names a
file, then times, each in a fresh subprocess that also reports its peak RSS:

1. char prepare (scan pass for the alphabet + encode pass), median of ``--repeats``;
2. bpe prepare (train byte-level BPE, vocab 4096, on the default 32 MB sample spread
   over the input, + encode pass), median of repeats; once more training on everything;
3. bpe prepare with the tokenizer from 2 (encode pass only), median of repeats;
4. for comparison, the plain single call on the whole text in memory: Hugging Face
   ``tokenizers.Tokenizer.encode(text)`` with the same BPE, and for char both
   ``CharTokenizer.encode(text)`` and a Python dict lookup per character (one run each).

The table is printed and written to BENCHMARKS.md under ``## Prepare throughput``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from tinylm.data import prepare
    out, src, tok, train_mb = sys.argv[1:5]
    train_mb = None if train_mb == "all" else float(train_mb)
    use = resource.getrusage(resource.RUSAGE_SELF)
    base, cpu0 = use.ru_maxrss, use.ru_utime + use.ru_stime
    t0 = time.perf_counter()
    d = prepare(out, [src], tokenizer=tok, force=True, progress=False, bpe_train_mb=train_mb)
    seconds = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    peak, cpu = use.ru_maxrss, use.ru_utime + use.ru_stime - cpu0
    print(json.dumps({"seconds": seconds, "cpu": cpu, "rss_mb": (peak - base) / 1024,
                      "tokens": len(d.train) + len(d.val), "vocab": d.vocab_size}))
""")

SINGLE = textwrap.dedent("""
    import json, resource, sys, time
    from tinylm.tokenizers import load_tokenizer
    src, tok_path, how = sys.argv[1:4]
    text = open(src, encoding="utf-8").read()
    tok = load_tokenizer(tok_path)
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = use.ru_utime + use.ru_stime
    t0 = time.perf_counter()
    if how == "hf":
        n = len(tok.hf.encode(text, add_special_tokens=False).ids)
    elif how == "numpy":
        n = len(tok.encode(text))
    else:
        stoi = {c: i for i, c in enumerate(tok.chars)}
        n = len([stoi[c] for c in text])
    seconds = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu = use.ru_utime + use.ru_stime - cpu0
    print(json.dumps({"seconds": seconds, "cpu": cpu, "rss_mb": use.ru_maxrss / 1024,
                      "tokens": n}))
""")


def child(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=100, help="generated corpus size")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prepare (median)")
    ap.add_argument("--input", help="benchmark this text file instead of a generated one")
    ap.add_argument("--workdir", help="folder for the corpus and outputs (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args()

    from tinylm.corpora import write_synthetic

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tinylm-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.input:
        src = Path(args.input)
    else:
        src = write_synthetic(work / "corpus.txt", int(args.size_mb * 1e6))
    mb = src.stat().st_size / 1e6
    load = os.getloadavg()[0]
    print(f"corpus {src} ({mb:.1f} MB), load average {load:.2f}", flush=True)

    rows = []

    def prepared(label: str, tok: str, out: str, train_mb: str = "32", repeats: int = 0) -> None:
        runs = [child(CHILD, str(work / out), str(src), tok, train_mb)
                for _ in range(repeats or args.repeats)]
        sec = statistics.median(r["seconds"] for r in runs)
        rss = max(r["rss_mb"] for r in runs)
        runs_text = f"median of {len(runs)}" if len(runs) > 1 else "1 run"
        cpu = statistics.median(r["cpu"] for r in runs)
        rows.append((label, runs_text, sec, cpu, runs[0]["tokens"], rss))
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        print(f"{label}: {mb / sec:.2f} MB/s ({sec:.2f} s, runs {each})", flush=True)

    def single(label: str, tok_dir: str, how: str) -> None:
        r = child(SINGLE, str(src), str(work / tok_dir), how)
        rows.append((label, "1 run", r["seconds"], r["cpu"], r["tokens"], r["rss_mb"]))
        print(f"{label}: {mb / r['seconds']:.2f} MB/s ({r['seconds']:.2f} s)", flush=True)

    prepared("char: `tinylm prepare --tokenizer char`", "char", "char")
    prepared("bpe: `tinylm prepare --tokenizer bpe` (train 4096 on a 32 MB sample + encode)",
             "bpe", "bpe")
    prepared("bpe: same with `--bpe-train-mb all` (train on everything + encode)", "bpe",
             "bpe-all", train_mb="all", repeats=1)
    prepared("bpe: `tinylm prepare --tokenizer tokenizer.json` (encode only)",
             str(work / "bpe" / "tokenizer.json"), "bpe-encode")
    single("bpe: HF `Tokenizer.encode(text)`, one call on the whole text", "bpe", "hf")
    single("char: `CharTokenizer.encode(text)`, one call (numpy table)", "char", "numpy")
    single("char: Python dict lookup per character, one call", "char", "dict")

    import tokenizers

    cpu = platform.processor() or platform.machine()
    body = [
        f"Input: {'`' + str(src) + '`' if args.input else 'generated corpus'} of {mb:.1f} MB "
        f"(`tinylm.corpora.write_synthetic`: shuffled python-docs paragraphs, ~5% Japanese "
        f"lines). Machine: {os.cpu_count()} CPU cores ({cpu}), Python "
        f"{platform.python_version()}, tokenizers {tokenizers.__version__}; load average "
        f"{load:.2f} at the start. Prepare rows run the library call `prepare()` in a fresh "
        f"process; peak RSS is the growth over the process after imports (prepare rows) or "
        f"the whole process holding the text (single-call rows). CPU seconds (user + system "
        f"of that process) against wall seconds show how much of the 2 cores it got: other "
        f"jobs shared this machine, so wall-clock MB/s is a lower bound; MB per CPU-second "
        f"does not depend on the load.",
        "",
        "| what | runs | seconds | MB/s | CPU seconds | MB per CPU-second | tokens | "
        "peak RSS MB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, runs, sec, cpu, tokens, rss in rows:
        body.append(f"| {label} | {runs} | {sec:.2f} | **{mb / sec:.2f}** | {cpu:.1f} | "
                    f"{mb / cpu:.2f} | {tokens:,} | {rss:.0f} |")
    body += [
        "",
        f"Command: `python benchmarks/prepare.py --size-mb {args.size_mb:g} "
        f"--repeats {args.repeats}" + (f" --input {args.input}`" if args.input else "`"),
    ]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        path = write_section("prepare", "Prepare throughput", text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
