"""tinylm side by side with llama.cpp (issue 30 item 4), one run, same machine, same threads.

Both engines read the same GGUF files:

- SmolLM2-135M-Instruct: its own Q4_1 file (``$TINYLM_SMOLLM2_GGUF``), and F32, Q8_0 and
  Q4_0 files written from its dequantized weights by tinylm's own ``convert --to-gguf``
  (at q4_0 the token embedding / output stay Q8_0, as llama-quantize keeps them);
- a GPT-2-small-shaped model (12 layers x 768, 12 heads, context 1024, random weights,
  SmolLM2's tokenizer) saved by tinylm and exported the same way at f32, q8_0 and q4_0.

tinylm loads each file with ``--keep-quantized``'s import (Q8_0/Q4_0/Q4_1 tensors kept as
stored, the LM head too: ``tinylm.io.gguf``); its int8 row is the Q8_0 file read by the
blocks kernel (``csrc/blocks.c``), its 4-bit rows the Q4_0/Q4_1 files. llama.cpp runs
through ``llama-cpp-python`` with ``n_threads = n_threads_batch`` = tinylm's
``torch.set_num_threads``. Greedy both.

Rows (medians over --repeats rounds; within a round the engines alternate, so a change in
the machine's load hits both alike):

- decoding tokens/s at batch 1 after a --prompt-len token prompt: (n2 − n1) / (t(n2) −
  t(n1)) with n1 = 1, n2 = 1 + --new-tokens, so the prompt's cost cancels;
- prompt processing tokens/s: a --pp-len token prompt to the first token's logits;
- peak memory (VmHWM) of each engine in its own fresh process: the model loaded and one
  decoding run (16-token prompt, --new-tokens);
- perplexity of each precision on the same held-out text (tinyshakespeare's last
  characters when ``--text`` or ../shared/data/tinyshakespeare/input.txt is there, else
  tinylm's built-in python-docs corpus), the same token ids to both engines, windows of
  --ppl-window tokens, every token after the first of a window scored;
- serving (SmolLM2's Q4_1 file): total generated tokens/s and median time to first token
  at 1, 4 and 16 concurrent streaming clients (the official ``openai`` client, greedy
  /v1/completions of --serve-tokens tokens), ``tinylm serve`` vs ``python -m
  llama_cpp.server`` (one sequence at a time), each in its own process.

    python benchmarks/llamacpp.py                          # all rows, 1 thread (~15 min)
    python benchmarks/llamacpp.py --threads 2
    python benchmarks/llamacpp.py --repeats 1 --no-serve --no-gpt2 --no-write   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402
from serve import free_port, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
GPT2_SMALL = dict(context_length=1024, n_layer=12, n_head=12, n_embd=768)
#: (row name, tinylm's precision, the GGUF type both read)
PAIRS = (("fp32", "fp32", "F32"), ("int8", "int8 (Q8_0 blocks)", "Q8_0"),
         ("q4_0", "4-bit Q4_0", "Q4_0"), ("q4_1", "4-bit Q4_1", "Q4_1"))


# --- the files ----------------------------------------------------------------------------


def smollm2_path() -> Path:
    path = os.environ.get("TINYLM_SMOLLM2_GGUF") or \
        Path.home() / ".cache/tinylm/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not Path(path).is_file():
        sys.exit(f"no SmolLM2 GGUF at {path}: set TINYLM_SMOLLM2_GGUF")
    return Path(path)


def make_files(work: Path, gpt2: bool) -> dict[str, dict[str, Path]]:
    """{model: {precision row: GGUF file}}, written by tinylm's convert --to-gguf once."""
    from tinylm import GPT, ModelConfig
    from tinylm.commands.convert import export_gguf, import_model
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.io.checkpoint_files import save_checkpoint

    src = smollm2_path()
    files = {"SmolLM2-135M": {"q4_1": src}}
    dense = work / "smollm2-dense"
    if not (dense / "config.json").exists():
        import_model(src, dense, force=True)
    models = {"SmolLM2-135M": dense}
    if gpt2:
        folder = work / "gpt2-small"
        if not (folder / "config.json").exists():
            _, tok = load_checkpoint(dense)
            torch.manual_seed(0)
            cfg = ModelConfig(vocab_size=tok.vocab_size, **GPT2_SMALL)
            save_checkpoint(folder, GPT(cfg).eval(), tok)
        models["GPT-2-small (random)"], files["GPT-2-small (random)"] = folder, {}
    for name, folder in models.items():
        for row, gtype in (("fp32", "f32"), ("int8", "q8_0"), ("q4_0", "q4_0")):
            out = work / f"{folder.name}-{gtype}.gguf"
            if not out.exists():
                export_gguf(folder, out, type=gtype, force=True)
            files[name][row] = out
    return files


def held_out_text(path: str | None) -> tuple[str, str]:
    """(text, where from): the last 20 000 characters of tinyshakespeare, or the built-in
    corpus when that file is not there."""
    p = Path(path) if path else SHAKESPEARE
    if p.is_file():
        return p.read_text(encoding="utf-8")[-20000:], f"{p.name} (last 20 000 chars)"
    from tinylm.data.corpora import load_corpus
    return load_corpus("python-docs")[-20000:], "tinylm's python-docs corpus (last 20 000)"


# --- the engines ------------------------------------------------------------------------------


class Tinylm:
    name = "tinylm"

    def __init__(self, path: Path, threads: int) -> None:
        from tinylm.io.gguf import gguf_to_tinylm
        torch.set_num_threads(threads)
        self.model = gguf_to_tinylm(path, keep_quantized=True)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        from tinylm import generate
        out = generate(self.model, torch.tensor([prompt]), n, temperature=0)
        return out[0, len(prompt):].tolist()

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """log p(ids[t] | ids[:t]) for t >= 1 (the reference forward)."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids]))[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()

    def close(self) -> None:
        del self.model


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, logits_all: bool = False) -> None:
        from llama_cpp import Llama
        self.llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                         n_batch=512, logits_all=logits_all, verbose=False)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        llm, out = self.llm, []
        llm.reset()
        llm.eval(prompt)
        vocab = llm.n_vocab()
        for _ in range(n):  # the last position's logits (logits_all=False keeps no scores)
            out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(),
                                                           shape=(vocab,)))))
            if len(out) < n:
                llm.eval([out[-1]])
        return out

    def logprobs(self, ids: list[int]) -> np.ndarray:
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[:len(ids) - 1], dtype=np.float32))
        lp = torch.log_softmax(logits, -1)
        return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()

    def close(self) -> None:
        self.llm.close()


def timed(engine, prompt: list[int], n: int) -> float:
    t = time.perf_counter()
    engine.generate(prompt, n)
    return time.perf_counter() - t


# --- the speed rows ---------------------------------------------------------------------------


def speed_rows(file: Path, args, threads: int, vocab: int) -> dict[str, dict[str, float]]:
    """{engine: {"decode": tok/s, "prompt": tok/s, "same": greedy tokens equal}}, the
    engines alternating within each round."""
    g = torch.Generator().manual_seed(0)
    short = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    long = torch.randint(0, vocab, (args.pp_len,), generator=g).tolist()
    engines = [Tinylm(file, threads), LlamaCpp(file, threads)]
    n1, n2 = 1, 1 + args.new_tokens
    dec = {e.name: [] for e in engines}
    pp = {e.name: [] for e in engines}
    greedy = [e.generate(short, 16) for e in engines]  # warm-up (packing) and tokens
    for e in engines:
        timed(e, long, 1)
    for _ in range(args.repeats):
        for e in engines:
            dec[e.name].append((n2 - n1) / (timed(e, short, n2) - timed(e, short, n1)))
            pp[e.name].append(args.pp_len / timed(e, long, 1))
    for e in engines:
        e.close()
    same = sum(a == b for a, b in zip(*greedy, strict=True))
    return {k: {"decode": statistics.median(dec[k]), "prompt": statistics.median(pp[k]),
                "same": same} for k in dec}


def perplexity(file: Path, ids: list[int], window: int, threads: int) -> dict[str, float]:
    out = {}
    for engine in (Tinylm(file, threads), LlamaCpp(file, threads, logits_all=True)):
        lps = [engine.logprobs(ids[s:s + window]) for s in range(0, len(ids) - window + 1,
                                                                  window)]
        out[engine.name] = math.exp(-float(np.concatenate(lps).mean()))
        engine.close()
    return out


def child_peak(engine: str, file: Path, threads: int, new_tokens: int) -> None:
    """In a fresh process: load, decode once, print VmHWM (kB) as JSON."""
    e = Tinylm(file, threads) if engine == "tinylm" else LlamaCpp(file, threads)
    e.generate(list(range(100, 116)), new_tokens)
    status = Path("/proc/self/status").read_text()
    kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1])
    print(json.dumps({"peak_kb": kb}))


def peak_mb(engine: str, file: Path, threads: int, new_tokens: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, __file__, "--child", engine, str(file), "--threads",
                          str(threads), "--new-tokens", str(new_tokens)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_kb"] / 1024


# --- serving ----------------------------------------------------------------------------------


def start_llama_server(file: Path, threads: int) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(file),
                             "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", "2048", "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL,  # its load log fills a pipe: a file
                            stderr=tempfile.TemporaryFile())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not answer in 120 s")


async def one_stream(client, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(time to first token, tokens) of one streamed greedy completion; tokens are the
    streamed chunks that carry text (both servers send one token per chunk)."""
    start, first, n = time.perf_counter(), None, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            n += 1
            if first is None:
                first = time.perf_counter() - start
    return (first if first is not None else time.perf_counter() - start), n


async def drive(url: str, clients: int, prompts: list[str], max_tokens: int) -> dict:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0)
    model = (await client.models.list()).data[0].id
    start = time.perf_counter()
    res = await asyncio.gather(*(one_stream(client, model, prompts[c % len(prompts)],
                                            max_tokens) for c in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return {"tps": sum(n for _, n in res) / wall,
            "ttft": statistics.median(t for t, _ in res), "tokens": sum(n for _, n in res)}


def serving_rows(file: Path, work: Path, args, threads: int, text: str) -> list[dict]:
    from tinylm.commands.convert import import_model
    kept = work / "smollm2-kept"
    if not (kept / "config.json").exists():
        import_model(file, kept, keep_quantized=True, force=True)
    words = text.split()
    prompts = [" ".join(words[i * 40:i * 40 + 12]) for i in range(max(args.clients))]
    rows = []
    for name, start in (("tinylm serve", lambda: start_server(
            kept, max(args.clients), threads)), ("llama_cpp.server", lambda: start_llama_server(
            file, threads))):
        proc, url = start()
        try:
            asyncio.run(drive(url, 1, prompts, 4))  # warm-up
            for c in args.clients:
                rows.append({"server": name, "clients": c,
                             **asyncio.run(drive(url, c, prompts, args.serve_tokens))})
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    return rows


# --- the run ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pp-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", help="held-out text file (default: tinyshakespeare if present)")
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--serve-tokens", type=int, default=32)
    ap.add_argument("--work", help="folder for the GGUF files (default: a cache folder)")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-gpt2", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    return ap.parse_args()


def speed_table(files, args, vocab: int) -> tuple[list[str], dict]:
    lines = ["| model | tinylm | GGUF | decode tinylm | decode llama.cpp | ratio | "
             f"prompt {args.pp_len} tinylm | prompt llama.cpp | ratio | greedy equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    got = {}
    for model, rows in files.items():
        for row, ours, gtype in PAIRS:
            if row not in rows:
                continue
            r = speed_rows(rows[row], args, args.threads, vocab)
            got[(model, row)] = r
            t, ll = r["tinylm"], r["llama.cpp"]
            lines.append(f"| {model} | {ours} | {gtype} | {t['decode']:.1f} | "
                         f"{ll['decode']:.1f} | {t['decode'] / ll['decode']:.2f}× | "
                         f"{t['prompt']:.1f} | {ll['prompt']:.1f} | "
                         f"{t['prompt'] / ll['prompt']:.2f}× | {t['same']}/16 |")
            print(lines[-1], flush=True)
    return lines, got


def memory_table(files, args, ids: list[int] | None) -> tuple[list[str], dict]:
    lines = ["| model | GGUF | peak MB tinylm | peak MB llama.cpp | perplexity tinylm | "
             "perplexity llama.cpp |", "|---|---|---|---|---|---|"]
    ppl = {}
    for model, rows in files.items():
        for row, _, gtype in PAIRS:
            if row not in rows:
                continue
            mem = [peak_mb(e, rows[row], args.threads, args.new_tokens)
                   for e in ("tinylm", "llama.cpp")]
            p = perplexity(rows[row], ids, args.ppl_window, args.threads) \
                if ids and model.startswith("SmolLM2") else None
            ppl[(model, row)] = p
            cells = [f"{p['tinylm']:.3f}", f"{p['llama.cpp']:.3f}"] if p else ["–", "–"]
            lines.append(f"| {model} | {gtype} | {mem[0]:.0f} | {mem[1]:.0f} | "
                         f"{' | '.join(cells)} |")
            print(lines[-1], flush=True)
    return lines, ppl


def targets(speed: dict, ppl: dict) -> list[str]:
    out = []
    for model in sorted({m for m, _ in speed}):
        int8 = speed.get((model, "int8"))
        for row in ("q4_0", "q4_1"):
            r = speed.get((model, row))
            if r and int8:
                out.append(f"- {model}: tinylm {row} decoding / tinylm int8 (Q8_0) = "
                           f"{r['tinylm']['decode'] / int8['tinylm']['decode']:.2f}× "
                           f"(target ≥ 1.5×)")
    base = ppl.get(("SmolLM2-135M", "fp32"))
    for row in ("int8", "q4_0", "q4_1"):
        p = ppl.get(("SmolLM2-135M", row))
        if base and p:
            out.append(f"- SmolLM2 {row} perplexity vs fp32 (tinylm): "
                       f"{100 * (p['tinylm'] / base['tinylm'] - 1):+.2f} % (target within 5 %)")
    return out


def main() -> int:
    args = parse_args()
    if args.child:
        child_peak(args.child[0], Path(args.child[1]), args.threads, args.new_tokens)
        return 0
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "tinylm-llamacpp"
    work.mkdir(parents=True, exist_ok=True)
    files = make_files(work, not args.no_gpt2)
    from tinylm.io.gguf import read_gguf
    from tinylm.io.gguf_checkpoint import gguf_tokenizer
    gm = read_gguf(files["SmolLM2-135M"]["q4_1"])
    tok, vocab = gguf_tokenizer(gm), gm.config.vocab_size
    text, source = held_out_text(args.text)
    ids = tok.encode(text)[:args.ppl_window * args.ppl_windows]
    load = os.getloadavg()
    speed_lines, speed = speed_table(files, args, vocab)
    mem_lines, ppl = memory_table(files, args, ids)
    serve_lines = []
    if not args.no_serve:
        rows = serving_rows(files["SmolLM2-135M"]["q4_1"], work, args, args.threads, text)
        serve_lines = ["| clients | server | total tok/s | TTFT p50 s | vs llama_cpp.server |",
                       "|---|---|---|---|---|"]
        ref = {r["clients"]: r["tps"] for r in rows if r["server"] == "llama_cpp.server"}
        serve_lines += [f"| {r['clients']} | {r['server']} | {r['tps']:.1f} | {r['ttft']:.3f} "
                        f"| {r['tps'] / ref[r['clients']]:.2f}× |" for r in rows]
    load_after = os.getloadavg()
    cmd = "python benchmarks/llamacpp.py" + (f" --threads {args.threads}"
                                             if args.threads != 1 else "")
    body = "\n".join([
        f"`{cmd}` ({args.repeats} rounds, engines alternating; {args.threads} thread(s) "
        f"each; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"average {load[0]:.2f} before / {load_after[0]:.2f} after, shared machine). "
        f"Decoding: batch 1, {args.new_tokens} tokens after a {args.prompt_len}-token "
        f"prompt; prompt: {args.pp_len} tokens to the first logits. tok/s, medians.", "",
        *speed_lines, "",
        f"Peak memory (VmHWM, each engine in a fresh process: load + one decoding run) and "
        f"perplexity on {source}, {len(ids)} tokens in windows of {args.ppl_window}:", "",
        *mem_lines, "", "Targets:", "", *targets(speed, ppl),
        *(["", f"Serving SmolLM2's Q4_1 file: {args.serve_tokens}-token greedy streamed "
           f"completions (openai client), one per client, all at once:", "", *serve_lines]
          if serve_lines else []),
    ])
    print(body)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if not args.no_write:
        name = "llamacpp" + (f"-t{args.threads}" if args.threads != 1 else "")
        write_section(name, f"Side by side with llama.cpp ({args.threads} thread(s))", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
