"""The real model, side by side: SmolLM2-135M-Instruct (GGUF, Q4_1) in tinylm and others.

One run measures, on the same GGUF file, each engine in a fresh subprocess (so the peak
resident memory, ru_maxrss, is that engine's own: its load included):

- tinylm fp32     ``--model FILE.gguf`` (dequantized once into the GGUF cache)
- tinylm int8     ``tinylm quantize --bits 8`` of it (per-channel int8 Linears)
- tinylm kept     ``tinylm convert --from-gguf --keep-quantized`` (the Q4_1 blocks as
                  they are, tinylm.layers.blocks), when it converts
- llama.cpp       ``llama_cpp.Llama`` on the file, ``--threads`` threads
- transformers    ``from_pretrained(folder, gguf_file=...)`` (dequantized to fp32)

Per engine: decoding tokens/s at batch 1 (greedy, ``--new-tokens`` after the France chat
prompt, eos ignored; median over ``--repeats``), prompt processing tokens/s (a
``--prompt-tokens`` prompt of English prose: the time to its first new token), the load
time, peak RSS, and the greedy answer to "What is the capital of France?". Then a short
LoRA fine-tune (``tinylm finetune --lora-rank 8`` on the built-in python-qa set prepared
with the model's template) and its held-out loss before and after (finetune's final
``val_loss`` from metrics.jsonl; "before" is the same windows scored on the base).

Writes the tables into BENCHMARKS.md between ``<!-- bench:models -->`` markers::

    python benchmarks/models.py                 # a few minutes on 2 cores
    python benchmarks/models.py --no-write --engines tinylm-fp32,llama.cpp --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))

from report import write_section  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache/tinylm/models/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("tinylm-fp32", "tinylm-int8", "tinylm-kept", "llama.cpp", "transformers")
FRANCE = "What is the capital of France?"


def _prompts(tok) -> tuple[list[int], list[int]]:
    """(the France chat prompt's ids, the first ``P`` ids of README.md's prose)."""
    from tinylm.data.chat import render_chat

    chat = render_chat(tok, [{"role": "user", "content": FRANCE}])
    prose = tok.encode((ROOT / "README.md").read_text())
    return chat, prose


def _answer(tok, ids: list[int]) -> str:
    eos = tok.eos_id
    return tok.decode(ids[:ids.index(eos)] if eos in ids else ids)


def _timed_stream(stream, n: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, seconds per later token, the n tokens) of an
    iterator of new token ids."""
    t0 = time.perf_counter()
    ids, first = [], None
    for tok in stream:
        ids.append(int(tok))
        if first is None:
            first = time.perf_counter()
        if len(ids) == n:
            break
    end = time.perf_counter()
    return first - t0, (end - first) / max(1, n - 1), ids


def _tinylm_engine(folder: str):
    import torch

    from tinylm.io.checkpoint import load_model
    from tinylm.use.sampling import generate_stream

    model = load_model(folder)

    def decode(prompt: list[int], k: int):
        return _timed_stream((t[0] for t in generate_stream(model, torch.tensor([prompt]), k,
                                                            temperature=0)), k)
    return decode


def _llama_cpp(gguf: str, threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def decode(prompt: list[int], k: int):
        stream = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True)
        return _timed_stream(stream, k)
    return decode


def _transformers(gguf: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode past eos, as the other engines do

    class Clock:  # a streamer: generate() calls put() with the prompt, then each token
        def __init__(self):
            self.times, self.ids = [], []

        def put(self, value):
            self.times.append(time.perf_counter())
            self.ids.append(value.reshape(-1).tolist())

        def end(self):
            pass

    def decode(prompt: list[int], k: int):
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=k, do_sample=False,
                           streamer=clock, pad_token_id=2)
        new = [i[0] for i in clock.ids[1:]]
        return (clock.times[1] - t0, (clock.times[-1] - clock.times[1]) / max(1, k - 1), new)
    return decode


def worker(args: argparse.Namespace) -> None:
    """One engine in this (fresh) process: print its figures as one JSON line."""
    import torch

    from tinylm.io.checkpoint import load_tokenizer_of

    torch.set_num_threads(args.threads)
    tok = load_tokenizer_of(args.checkpoint)
    chat, prose = _prompts(tok)
    prose = prose[:args.prompt_tokens]
    t = time.perf_counter()
    if args.worker == "llama.cpp":
        decode = _llama_cpp(args.gguf, args.threads)
    elif args.worker == "transformers":
        decode = _transformers(args.gguf)
    else:
        decode = _tinylm_engine(args.folder)
    load = time.perf_counter() - t
    decode(chat, 4)  # warm-up
    steps, prefill, answer = [], [], None
    for _ in range(args.repeats):
        _, per_token, ids = decode(chat, args.new_tokens)
        steps.append(per_token)
        answer = _answer(tok, ids)
        prefill.append(decode(prose, 2)[0])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    print(json.dumps({"engine": args.worker, "load_s": load, "new_tokens": args.new_tokens,
                      "prompt_tokens": len(prose), "repeats": args.repeats,
                      "decode_tps": 1 / statistics.median(steps),
                      "prefill_tps": len(prose) / statistics.median(prefill),
                      "peak_rss_mb": rss, "answer": answer}))


def _run_worker(engine: str, args: argparse.Namespace, checkpoint: Path,
                folder: Path | None) -> dict | None:
    n, p, k = args.new_tokens, args.prompt_tokens, args.repeats
    if engine == "tinylm-kept":  # GGUF blocks decode on no fast path: a short run
        n, p, k = min(n, 8), min(p, 32), 1
    cmd = [sys.executable, __file__, "--worker", engine, "--gguf", str(args.gguf),
           "--checkpoint", str(checkpoint), "--folder", str(folder or checkpoint),
           "--threads", str(args.threads), "--new-tokens", str(n),
           "--prompt-tokens", str(p), "--repeats", str(k)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{engine}: failed ({r.stderr.strip().splitlines()[-1:]})", flush=True)
        return None
    row = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{engine}: {row}", flush=True)
    return row


def _tinylm_cli(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "-q", *cmd], env=env,
                          capture_output=True, text=True)


def _folders(args: argparse.Namespace, tmp: Path, env: dict) -> dict[str, Path | None]:
    """The checkpoint folder each tinylm engine loads (None: it could not be made)."""
    out: dict[str, Path | None] = {}
    from tinylm.io.checkpoint import resolve_checkpoint_dir

    out["tinylm-fp32"] = resolve_checkpoint_dir(args.gguf)
    r = _tinylm_cli(["quantize", "--model", str(args.gguf), "--bits", "8", "--out",
                     str(tmp / "int8")], env)
    out["tinylm-int8"] = tmp / "int8" if r.returncode == 0 else None
    r = _tinylm_cli(["convert", "--from-gguf", str(args.gguf), "--keep-quantized", "--out",
                     str(tmp / "kept")], env)
    out["tinylm-kept"] = tmp / "kept" if r.returncode == 0 else None
    for name, folder in out.items():
        if folder is None:
            print(f"{name}: could not be made", flush=True)
    return out


def finetune_figures(args: argparse.Namespace, tmp: Path, env: dict, checkpoint: Path
                     ) -> dict:
    """Held-out loss before/after a short LoRA fine-tune on python-qa."""
    from tinylm.data.chatdata import load_chat_data
    from tinylm.io.checkpoint import load_model
    from tinylm.use.evaluation import estimate_loss, sample_windows

    data_dir, run = tmp / "qa", tmp / "ft"
    r = _tinylm_cli(["prepare", "--chat", "python-qa", "--tokenizer", str(args.gguf),
                     "--context-length", "128", "--skip-bad", "--out", str(data_dir)], env)
    if r.returncode:
        raise SystemExit(f"prepare --chat failed: {r.stderr}")
    t = time.perf_counter()
    r = _tinylm_cli(["finetune", "--model", str(args.gguf), "--data", str(data_dir), "--out",
                     str(run), "--lora-rank", "8", "--max-steps", str(args.finetune_steps),
                     "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "1000000",
                     "--save-every", "1000000", "--no-progress"], env)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"finetune failed: {r.stderr}")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    final = next(x for x in records if x.get("final"))
    speeds = [x["tokens_per_s"] for x in records if "tokens_per_s" in x]
    data = load_chat_data(data_dir)
    C = data.row_length - 1
    windows = sample_windows(len(data.val), C, None, 1337)  # finetune's final evaluation
    before = estimate_loss(load_model(checkpoint), data.val, windows, context_length=C,
                           loss_mask=data.val_mask).loss
    conv = data.meta["chat"]["conversations"]
    return {"before": before, "after": final["val_loss"], "steps": args.finetune_steps,
            "seconds": seconds, "tokens_per_s": statistics.median(speeds) if speeds else None,
            "train": conv["train"], "val": conv["val"], "C": C}


def report(rows: list[dict], ft: dict | None, args: argparse.Namespace) -> str:
    load = os.getloadavg()[0]
    lines = [
        f"Model: SmolLM2-135M-Instruct, `{args.gguf.name}` (llama architecture, 30 layers, "
        f"E=576, 9 query / 3 key-value heads, V=49152; Q4_1 blocks, Q8_0 embedding). Each "
        f"engine in a fresh process; decoding: greedy, {args.new_tokens} tokens after the "
        f"France chat prompt at batch 1, eos ignored; prompt processing: a "
        f"{args.prompt_tokens}-token prompt of English (README.md) to its first new token; "
        f"median of {args.repeats} runs after a warm-up. Machine: {os.cpu_count()} CPU cores "
        f"({platform.machine()}), {args.threads} threads for every engine; load average "
        f"{load:.2f} at the end (the machine was shared: figures are lower bounds).",
        "",
        "| engine | decode tok/s (batch 1) | prompt tok/s | load s | peak RSS MB | "
        "greedy answer to the France question |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        answer = r["answer"].replace("\n", " ").replace("|", "\\|")
        short = "" if r["new_tokens"] == args.new_tokens else \
            f" ({r['new_tokens']} tokens, {r['prompt_tokens']}-token prompt, 1 run)"
        lines.append(f"| {r['engine']}{short} | {r['decode_tps']:.1f} | {r['prefill_tps']:.0f} | "
                     f"{r['load_s']:.1f} | {r['peak_rss_mb']:.0f} | {answer[:70]} |")
    lines += ["", "tinylm fp32 = `--model FILE.gguf` (dequantized to float32); int8 = "
              "`tinylm quantize --bits 8`; kept = `convert --from-gguf --keep-quantized`; "
              "transformers = `from_pretrained(..., gguf_file=...)` (float32)."]
    if ft is not None:
        lines += [
            "",
            f"LoRA fine-tune (`tinylm finetune --model FILE.gguf --lora-rank 8`, "
            f"{ft['steps']} steps of 4 rows × {ft['C']} tokens, lr 2e-3) on the built-in "
            f"python-qa set in SmolLM2's template ({ft['train']} train / {ft['val']} held-out "
            f"conversations): held-out loss on the assistant tokens **{ft['before']:.3f} → "
            f"{ft['after']:.3f}** (perplexity {2.718281828 ** ft['before']:.2f} → "
            f"{2.718281828 ** ft['after']:.2f}); {ft['seconds']:.0f} s in all, median "
            f"{ft['tokens_per_s'] or 0:.0f} training tokens/s.",
        ]
    lines += ["", "Command: `python benchmarks/models.py`"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path,
                        default=Path(os.environ.get("TINYLM_SMOLLM2_GGUF", DEFAULT_GGUF)))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--finetune-steps", type=int, default=12,
                        help="LoRA steps (0: skip the fine-tune)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if not args.gguf.is_file():
        parser.error(f"{args.gguf} does not exist; run 'make smollm2-gguf' or pass --gguf")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    with tempfile.TemporaryDirectory(prefix="tinylm-models-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ["TINYLM_GGUF_CACHE"] = str(tmp / "cache")
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        folders = _folders(args, tmp, env)
        checkpoint = folders["tinylm-fp32"]
        rows = []
        for engine in engines:
            if engine.startswith("tinylm") and folders.get(engine) is None:
                continue
            row = _run_worker(engine, args, checkpoint, folders.get(engine))
            if row is not None:
                rows.append(row)
        ft = finetune_figures(args, tmp, env, checkpoint) if args.finetune_steps else None
    body = report(rows, ft, args)
    print(body)
    if not args.no_write:
        write_section("models", "The real model: SmolLM2-135M-Instruct, engine by engine",
                      body)
        print("wrote BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
