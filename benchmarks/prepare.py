"""Throughput of ``tinylm prepare`` on JSONL and Parquet corpora, beside plain encoders.

    python benchmarks/prepare.py [--size-mb 500] [--workers 1,all] [--formats jsonl,parquet]
                                 [--tokenizers char,bpe] [--source-text FILE] [--no-write]
                                 [--encoder-mb 100] [--repeats 3]

Generates documents (:func:`tinylm.data.corpora.synthetic_documents`: 8 random paragraphs each
of python-docs, or of ``--source-text`` such as ../shared/data/tinyshakespeare/input.txt,
with some Japanese lines) until ``--size-mb`` MB of text, writes them once as JSONL
(``{"id", "text"}`` per line) and once as Parquet (row groups of 4096 rows), trains one
byte-level BPE (vocab 4096 + ``<|endoftext|>``) on the first 32 MB, and then times, each
in a fresh process that reports wall seconds, CPU seconds (its own and its workers') and
peak memory (the proportional set size of the process and its workers, sampled once a
second: a sample reads every process's smaps, ~25 ms of CPU, which at 4 a second took a
tenth of a core from the rows that use every core; the sampler's CPU is left out):

1. ``prepare()`` for every format x tokenizer (char: alphabet scan + encode; bpe: the
   trained tokenizer.json, encode only) x ``--workers`` (1 and all cores), ``--repeats``
   times with the worker counts interleaved (1, all, 1, all, ...); a row is the median
   run (by seconds), and the all-cores ratio is the median of the interleaved pairs'
   ratios, each of which is printed;
2. for comparison, the same documents already in memory encoded with the same BPE by
   Hugging Face ``tokenizers`` (``encode_batch_fast``, 1 thread and all: RAYON_NUM_THREADS)
   and by ``tiktoken`` (an ``Encoding`` built from tinylm's vocabulary: ranks = ids,
   GPT-2's pattern; ``encode_ordinary_batch``, 1 thread and all), and by tinylm's native
   encoder (tinylm.native.bpe, what prepare's workers run; one thread). Only encoding is
   timed for these: no reading, no JSON, no writing, so they are an upper bound for
   prepare on the same cores (the "workers / threads" column: the cores each row used).

MB/s is of the documents' UTF-8 text for every row, so formats compare fairly. The table
is printed and written to BENCHMARKS.md under ``## Prepare throughput``.
"""

from __future__ import annotations

import argparse
import itertools
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

EOT = "<|endoftext|>"

#: Prints peak memory of this process + its children (PSS, sampled) and CPU seconds.
MONITOR = textwrap.dedent("""
    import json, os, resource, sys, threading, time, psutil
    me = psutil.Process()
    def pss():
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total / 2**20
    peak, done, own = [0.0], threading.Event(), [0.0]
    def watch():  # once a second: a sample reads every process's smaps (~25 ms of CPU)
        while not done.is_set():
            peak[0] = max(peak[0], pss())
            own[0] = time.thread_time()
            done.wait(1.0)
    def cpu():
        a = resource.getrusage(resource.RUSAGE_SELF)
        b = resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
    def measure(run):
        base = pss()
        watcher = threading.Thread(target=watch, daemon=True)
        c0, t0 = cpu(), time.perf_counter()
        watcher.start()
        tokens = run()
        seconds, used = time.perf_counter() - t0, cpu() - c0
        done.set()
        watcher.join()
        used -= own[0]  # the watcher's own CPU is not the row's
        print(json.dumps({"seconds": seconds, "cpu": used, "peak_mb": max(peak[0], pss()),
                          "base_mb": base, "tokens": tokens}))
""")

PREPARE = MONITOR + textwrap.dedent("""
    from tinylm.data import prepare
    out, src, tok, workers = sys.argv[1:5]
    def run():
        d = prepare(out, [src], tokenizer=tok, special_tokens=[EOT] if tok == "char" else (),
                    workers=int(workers), force=True, progress=False)
        return len(d.train) + len(d.val)
    measure(run)
""").replace("EOT", repr(EOT))

ENCODE = MONITOR + textwrap.dedent("""
    engine, src, tok_path, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    limit = float(sys.argv[6]) * 1e6 if sys.argv[6] != "all" else float("inf")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    docs, size = [], 0
    for line in open(src, encoding="utf-8"):
        docs.append(json.loads(line)["text"])
        size += len(docs[-1].encode("utf-8"))
        if size >= limit:
            break
    print(json.dumps({"mb": size / 1e6}))
    sys.path.insert(0, sys.argv[5])
    from prepare import tiktoken_encoding
    if engine == "native":
        from tinylm.native import bpe_encoder
        from tinylm.data.tokenizer_files import load_tokenizer
        enc = bpe_encoder(load_tokenizer(tok_path))
        assert enc is not None, "the native BPE encoder is unavailable here"
        def run():
            n = 0
            for i in range(0, len(docs), 1024):
                n += len(enc.encode_lengths(docs[i:i + 1024])[0])
            return n
    elif engine == "hf":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        def run():
            n = 0
            for i in range(0, len(docs), 1024):
                n += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i:i + 1024],
                                                                   add_special_tokens=False))
            return n
    else:
        enc = tiktoken_encoding(tok_path)
        def run():
            n = 0
            for i in range(0, len(docs), 1024):
                n += sum(map(len, enc.encode_ordinary_batch(docs[i:i + 1024],
                                                            num_threads=threads)))
            return n
    measure(run)
""")

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tiktoken_encoding(tokenizer_json: str):
    """A ``tiktoken.Encoding`` with tinylm's byte-level BPE: each token's bytes ranked by
    its id (merges were learned in id order) and GPT-2's pre-tokenization pattern."""
    import tiktoken

    from tinylm.data.tokenizer_files import load_tokenizer
    from tinylm.native.bpe import byte_symbols

    tok = load_tokenizer(tokenizer_json)
    decoder = {c: b for b, c in byte_symbols().items()}
    vocab = tok.hf.get_vocab(with_added_tokens=False)
    ranks = {bytes(decoder[c] for c in token): i for token, i in vocab.items()}
    specials = {t: tok.token_to_id(t) for t in tok.special_tokens}
    return tiktoken.Encoding("tinylm-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


def _formats(args: argparse.Namespace) -> list[str]:
    """The --formats to prepare ("none": only the in-memory encoder rows)."""
    return [f for f in args.formats.split(",") if f and f != "none"]


def child(script: str, *args: str) -> dict:
    """The child's last JSON line (its measure), with "mb" from an earlier line if any."""
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed:\n{proc.stderr}")
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    return {k: v for line in lines for k, v in line.items()}


def write_corpus(work: Path, size_mb: float, source_text: str | None) -> tuple[int, int]:
    """docs.jsonl and docs.parquet with the same documents; returns (text bytes, docs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tinylm.data.corpora import synthetic_documents

    text = Path(source_text).read_text(encoding="utf-8") if source_text else None
    docs = synthetic_documents(int(size_mb * 1e6), text=text)
    n_bytes = n_docs = 0
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with open(work / "docs.jsonl", "w", encoding="utf-8") as jf, \
            pq.ParquetWriter(work / "docs.parquet", schema) as pw:
        while batch := list(itertools.islice(docs, 4096)):
            for i, d in enumerate(batch, n_docs):
                jf.write(json.dumps({"id": i, "text": d}, ensure_ascii=False) + "\n")
            pw.write_table(pa.table({"id": range(n_docs, n_docs + len(batch)), "text": batch},
                                    schema=schema))
            n_docs += len(batch)
            n_bytes += sum(len(d.encode("utf-8")) for d in batch)
    return n_bytes, n_docs


def train_bpe(work: Path) -> Path:
    from tinylm.data.tokenizers import BPETokenizer

    def texts():
        seen = 0
        for line in open(work / "docs.jsonl", encoding="utf-8"):
            text = json.loads(line)["text"]
            seen += len(text)
            if seen > 32e6:
                return
            yield text

    path = work / "bpe.json"
    BPETokenizer.train(texts(), 4096, [EOT]).save(path)
    return path


def check_tiktoken(work: Path, tok_path: Path) -> bool:
    """tiktoken with tinylm's vocabulary gives tinylm's ids (on the first 300 documents)."""
    from tinylm.data.tokenizer_files import load_tokenizer

    tok, enc = load_tokenizer(tok_path), tiktoken_encoding(str(tok_path))
    lines = itertools.islice(open(work / "docs.jsonl", encoding="utf-8"), 300)
    return all(tok.encode(t) == enc.encode_ordinary(t)
               for t in (json.loads(line)["text"] for line in lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=500, help="text in the corpus (MB)")
    ap.add_argument("--workers", default="1,all", help="worker counts to time ('all': cores)")
    ap.add_argument("--formats", default="jsonl,parquet",
                    help="inputs to prepare: jsonl,parquet (none: the encoder rows only)")
    ap.add_argument("--tokenizers", default="char,bpe")
    ap.add_argument("--source-text", metavar="FILE",
                    help="take paragraphs from this text (e.g. ../shared/data/"
                    "tinyshakespeare/input.txt) instead of python-docs")
    ap.add_argument("--workdir", help="folder for the corpus and outputs (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    ap.add_argument("--encoder-mb", default="all",
                    help="time the in-memory encoders on the first this many MB of the "
                    "documents (rates compare as MB/s; 'all' for every document)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each prepare row, worker counts interleaved (median)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")

    from tinylm.core.config import available_cpus

    cores = available_cpus()
    counts = [cores if w == "all" else int(w) for w in args.workers.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tinylm-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    n_bytes, n_docs = write_corpus(work, args.size_mb, args.source_text)
    mb = n_bytes / 1e6
    tok_path = train_bpe(work)
    same = check_tiktoken(work, tok_path)
    import tinylm.native  # build the native library here, not inside a timed row

    tinylm.native.load()
    load = os.getloadavg()[0]
    sizes = {f: (work / f"docs.{f}").stat().st_size / 1e6 for f in ("jsonl", "parquet")}
    print(f"{n_docs:,} documents, {mb:.1f} MB of text (jsonl {sizes['jsonl']:.0f} MB, parquet "
          f"{sizes['parquet']:.0f} MB); tiktoken ids == tinylm ids: {same}; load average "
          f"{load:.2f}", flush=True)

    rows: list[tuple[str, str, str, int, dict]] = []
    pairs: dict[str, list[float]] = {}  # "fmt tok" -> each repeat's 1-worker / all ratio

    def row(fmt: str, tok: str, what: str, n: int, r: dict, show: bool = True) -> None:
        m = r.get("mb", mb)  # the encoder rows may time the first --encoder-mb only
        print(f"{fmt} {tok} {what} x{n}: {m / r['seconds']:.2f} MB/s ({r['seconds']:.1f} s, "
              f"{m:.0f} MB, cpu {r['cpu']:.1f} s = {m / r['cpu']:.2f} MB per CPU s, peak "
              f"{r['peak_mb']:.0f} MB)", flush=True)
        if show:
            rows.append((fmt, tok, what, n, r))

    for fmt in _formats(args):
        for tok in args.tokenizers.split(","):
            spec = "char" if tok == "char" else str(tok_path)
            runs: dict[int, list[dict]] = {n: [] for n in counts}
            for _ in range(args.repeats):
                for n in counts:
                    out = work / f"out-{fmt}-{tok}-{n}"
                    r = child(PREPARE, str(out), str(work / f"docs.{fmt}"), spec, str(n))
                    runs[n].append(r)
                    row(fmt, tok, "`tinylm prepare`", n, r, show=False)
                if len(counts) > 1:
                    pairs.setdefault(f"{fmt} {tok}", []).append(
                        runs[counts[0]][-1]["seconds"] / runs[counts[-1]][-1]["seconds"])
            for n in counts:
                rows.append((fmt, tok, "`tinylm prepare`", n, _median_run(runs[n])))
    if "bpe" in args.tokenizers.split(","):
        here = str(Path(__file__).resolve().parent)
        for engine, label in (("hf", "HF `tokenizers` encode_batch_fast"),
                              ("tiktoken", "`tiktoken` encode_ordinary_batch"),
                              ("native", "tinylm's native BPE encoder (one thread)")):
            for n in counts if engine != "native" else [1]:
                what = label if engine == "native" else f"{label}, {n} thread(s)"
                r = child(ENCODE, engine, str(work / "docs.jsonl"), str(tok_path), str(n), here,
                          args.encoder_mb)
                row("in memory", "bpe", what, n, r)
    report(args, rows, pairs, mb, n_docs, cores, load, same)


def _median_run(runs: list[dict]) -> dict:
    """The run of median seconds (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def report(args, rows, pairs, mb, n_docs, cores, load, same) -> None:
    import tokenizers

    body = [
        f"{n_docs:,} generated documents, {mb:.1f} MB of UTF-8 text, as JSONL and as Parquet. "
        f"Machine: {cores} cores ({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, tokenizers {tokenizers.__version__}; load average "
        f"{load:.2f} at the start. Each run is a fresh process; a `tinylm prepare` row is "
        f"the median of {args.repeats} runs (by seconds), the worker counts interleaved; "
        f"peak MB is the proportional "
        f"set size of it and its workers, sampled once a second; CPU seconds include the "
        f"workers, not the sampler. BPE is "
        f"the same trained vocabulary (4096) everywhere; tiktoken ids equal tinylm's: {same}. "
        f"The encoder rows time encoding only (documents already in memory"
        + (f", the first {args.encoder_mb} MB of them" if args.encoder_mb != "all" else "")
        + "); the workers / threads column is the cores each row used.",
        "",
        "| input | tokenizer | what | workers / threads | seconds | MB/s | CPU s | MB per CPU s "
        "| peak MB | tokens |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt, tok, what, n, r in rows:
        m = r.get("mb", mb)
        body.append(f"| {fmt} | {tok} | {what} | {n} | {r['seconds']:.1f} | "
                    f"**{m / r['seconds']:.2f}** | {r['cpu']:.1f} | {m / r['cpu']:.2f} | "
                    f"{r['peak_mb']:.0f} | "
                    f"{r['tokens']:,} |")
    speed = {(f, t, w, n): r.get("mb", mb) / r["seconds"] for f, t, w, n, r in rows}
    top = max(n for *_, n, _ in rows)
    body.append("")
    for fmt in _formats(args):
        one, all_ = speed.get((fmt, "bpe", "`tinylm prepare`", 1)), \
            speed.get((fmt, "bpe", "`tinylm prepare`", top))
        best = max((v for (f, t, w, n), v in speed.items() if f == "in memory" and n == top
                    and "native" not in w), default=None)
        ratios = pairs.get(f"{fmt} bpe", [])
        if one and all_ and top > 1 and ratios:
            body.append(f"- {fmt} BPE: {top} workers are **{statistics.median(ratios):.2f}x** "
                        f"one worker (median of the interleaved runs' ratios "
                        f"{', '.join(f'{r:.2f}' for r in ratios)}; target >= 1.8x)"
                        + (f"; {all_ / best:.2f}x the fastest encoder on {top} threads (HF "
                           f"or tiktoken, target >= 1)" if best else ""))
    body += ["", f"Command: `python benchmarks/prepare.py --size-mb {args.size_mb:g} --workers "
                 f"{args.workers}" + (f" --source-text {args.source_text}" if args.source_text
                                      else "")
             + (f" --formats {args.formats}" if args.formats != "jsonl,parquet" else "")
             + (f" --tokenizers {args.tokenizers}" if args.tokenizers != "char,bpe" else "")
             + (f" --encoder-mb {args.encoder_mb}" if args.encoder_mb != "all" else "")
             + (f" --repeats {args.repeats}" if args.repeats != 3 else "") + "`"]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        print(f"wrote {write_section('prepare', 'Prepare throughput', text)}")


if __name__ == "__main__":
    main()
