"""GGUF out: what each ``tinylm convert --to-gguf --type`` costs, measured with llama.cpp.

For each model and each type (f32, f16, q8_0, q4_0) the script writes the GGUF file with
``tinylm convert --to-gguf``, loads it in llama.cpp (``llama-cpp-python``, one thread) and
compares llama.cpp's next-token logits, teacher-forced over a held-out text, with tinylm's
float32 model: the largest and the mean |difference|, the share of positions whose top
token agrees, and the file size; at f32 also whether llama.cpp's greedy tokens equal
tinylm's (64 tokens; decoded one llama.cpp step at a time for the small models, checked
in one batch for SmolLM2). The "own weights" column compares llama.cpp with tinylm
reading the same file back (what llama.cpp's arithmetic adds: 8-bit activations in its
Q8_0/Q4_0 products), the rest with the float32 model (what the type costs).

Models: two trained here with ``tinylm prepare`` + ``tinylm train`` (a char tokenizer on
GPT-2's layout; byte-level BPE on Llama's, grouped-query attention), and
SmolLM2-135M-Instruct (``$TINYLM_SMOLLM2_GGUF`` or ~/.cache/tinylm/models/; its Q4_1 file
dequantized by tinylm, then written at each type) when the file is there.

    python benchmarks/gguf_export.py            # the full run (a few minutes)
    python benchmarks/gguf_export.py --no-smollm2 --steps 40 --no-write
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from report import closing_lines, write_section
from tinylm.cli import main as tinylm
from tinylm.data.chat import render_chat
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.gguf import gguf_to_tinylm
from tinylm.use.sampling import generate

TYPES = ("f32", "f16", "q8_0", "q4_0")
SMOLLM2 = Path.home() / ".cache" / "tinylm" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[1]


def train(root: Path, tokenizer: str, arch: list[str], steps: int) -> Path:
    """A run folder of ``tinylm train`` on docs/architecture.md (held out: its last part)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    (root / "train.txt").write_text(text[:-4000], encoding="utf-8")
    data, run = root / f"data-{tokenizer}", root / f"run-{tokenizer}"
    assert tinylm(["prepare", "--input", str(root / "train.txt"), "--out", str(data),
                   "--tokenizer", tokenizer, "--vocab-size", "512", "--context-length", "128",
                   "--workers", "1", "--no-progress", "-q"]) == 0
    assert tinylm(["train", "--data", str(data), "--out", str(run), *arch, "--n-layer", "4",
                   "--n-embd", "128", "--n-head", "4", "--batch-size", "16", "--max-steps",
                   str(steps), "--warmup-steps", "20", "--lr", "2e-3", "--eval-every", "100000",
                   "--save-every", "100000", "--log-every", "100000", "--device", "cpu",
                   "--threads", "1", "-q"]) == 0
    return run


def held_out(tok, n: int) -> list[int]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")[-4000:]
    ids = tok.encode("".join(c for c in text if tok.kind != "char" or
                             tok.token_to_id(c) is not None))
    return ids[:n]


def logits_of(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy_equal(llm, model, prompt: list[int], stepwise: bool) -> bool:
    ours = generate(model, prompt, 64, temperature=0)[0, len(prompt):].tolist()
    if not stepwise:  # llama.cpp's argmax after each of tinylm's tokens is the next one
        theirs = logits_of(llm, prompt + ours)[len(prompt) - 1:-1]
        return theirs.argmax(-1).tolist() == ours
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(64):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out == ours


def measure(name: str, source: str, model, tok, ids: list[int], prompt: list[int],
            folder: Path, stepwise: bool) -> list[dict]:
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].numpy()
    rows = []
    for type_ in TYPES:
        path = folder / f"{name}-{type_}.gguf"
        assert tinylm(["convert", "--to-gguf", source, "--out", str(path), "--type",
                       type_]) == 0
        llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_threads=1,
                              n_ctx=max(512, len(ids) + 80), n_batch=512, verbose=False)
        try:
            theirs = logits_of(llm, ids)
            greedy = greedy_equal(llm, model, prompt, stepwise) if type_ == "f32" else None
        finally:
            llm.close()
        with torch.no_grad():
            own = gguf_to_tinylm(path)(torch.tensor([ids]))[0].numpy()
        error = np.abs(theirs - ref)
        rows.append(dict(model=name, type=type_, mb=path.stat().st_size / 1e6,
                         max=float(error.max()), mean=float(error.mean()),
                         top1=float((theirs.argmax(-1) == ref.argmax(-1)).mean()),
                         own=float(np.abs(theirs - own).max()), greedy=greedy,
                         n=len(ids), spread=float(ref.std())))
        r = rows[-1]
        print(f"{name:>10} {type_:>5}: {r['mb']:7.1f} MB  max {r['max']:.4f}  mean "
              f"{r['mean']:.4f}  top-1 {r['top1']:.3f}  own {r['own']:.4f}  greedy {greedy}",
              flush=True)
        path.unlink()
    return rows


def table(rows: list[dict], args: argparse.Namespace, load: float) -> str:
    lines = [
        "llama.cpp (`llama-cpp-python` " + llama_cpp.__version__ + ", one thread) on the "
        "files `tinylm convert --to-gguf --type T` writes, against tinylm's float32 model: "
        "next-token logits teacher-forced over held-out text (max and mean |difference|, "
        "top-1 agreement); \"own weights\": max |difference| from tinylm reading the same "
        "file back (llama.cpp's arithmetic alone: 8-bit activations in Q8_0/Q4_0 products); "
        "greedy: llama.cpp's 64 greedy tokens equal tinylm's. Small models: trained "
        f"{args.steps} steps by `tinylm train` on docs/architecture.md (4 layers, E=128), "
        "held out: its last 4,000 characters. SmolLM2-135M-Instruct: its Q4_1 file "
        "dequantized by tinylm, then written at each type (so q4_0 rounds 4-bit weights a "
        "second time, onto a grid without Q4_1's per-block minimum); held out: the same "
        "text. Machine: "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), load average {load:.2f}.",
        "",
        "| model | type | file MB | max abs | mean abs | top-1 | own weights max | logit std "
        "| greedy 64 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        greedy = "" if r["greedy"] is None else ("equal" if r["greedy"] else "DIFFERS")
        lines.append(f"| {r['model']} ({r['n']} tokens) | {r['type']} | {r['mb']:.1f} | "
                     f"{r['max']:.4f} | {r['mean']:.4f} | {r['top1']:.3f} | {r['own']:.4f} | "
                     f"{r['spread']:.2f} | {greedy} |")
    lines += closing_lines("benchmarks/gguf_export.py")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of the "
                        "small models")
    parser.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, tokenizer, arch in (
                ("char-gpt2", "char", ["--arch", "gpt2"]),
                ("bpe-llama", "bpe", ["--arch", "llama", "--n-kv-head", "2",
                                      "--ffn-hidden", "352"])):
            run = train(root, tokenizer, arch, args.steps)
            model, tok = load_checkpoint(run)
            ids = held_out(tok, 256)
            rows += measure(name, str(run), model, tok, ids, ids[:16], root, stepwise=True)
        smollm2 = Path(os.environ.get("TINYLM_SMOLLM2_GGUF", SMOLLM2))
        if not args.no_smollm2 and smollm2.is_file():
            os.environ["TINYLM_GGUF_CACHE"] = str(root / "cache")  # never the user's cache
            assert tinylm(["convert", "--from-gguf", str(smollm2), "--out",
                           str(root / "smollm2")]) == 0
            model, tok = load_checkpoint(root / "smollm2")
            ids = held_out(tok, 256)
            prompt = render_chat(tok, [{"role": "user",
                                        "content": "What is the capital of France?"}])
            rows += measure("SmolLM2", str(root / "smollm2"), model, tok, ids, prompt, root,
                            stepwise=False)
    text = table(rows, args, load)
    print(text)
    if not args.no_write:
        write_section("gguf_export", "GGUF out: llama.cpp on the files tinylm writes", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
