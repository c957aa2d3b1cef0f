"""int8 weight-only quantization (issue 19): decoding speed and validation loss, side by
side in one run.

Speed, on one model with random weights -- sample.py's GPT-2-small shape (6 layers x 6
heads x E=384, C=512, V=50257) with an untied LM head, so that every matrix a decoding
step reads can be int8 (``quantize(include_head=True)``) -- greedy decoding of
--new-tokens tokens after a --prompt-len token prompt at batch 1 and 8:

- tinylm fp32 and tinylm int8 (``tinylm.layers.quantized``; the fused decoding step reads the
  int8 weights with ``csrc/quant.c``)
- Hugging Face ``GPT2LMHeadModel.generate`` (fp32, the same weights via ``tinylm.io.hf``)
- CTranslate2 ``Generator`` with ``float32`` and ``int8`` weights, converted by
  ``ctranslate2.converters.TransformersConverter`` from tinylm's Hugging Face export
  (a stand-in vocabulary ``t0 .. t{V-1}``: CTranslate2 takes tokens as strings)

Validation loss, on a trained model (default: ``make demo``'s runs/demo and its data
data/python-docs-bpe): tinylm fp32 and int8 (``tinylm.use.evaluation.evaluate``) and
CTranslate2 float32 and int8 (``score_batch``), over the same non-overlapping windows of
the validation split.

    python benchmarks/quantize.py                 # a few minutes on 2 cores
    python benchmarks/quantize.py --demo runs/demo --data data/python-docs-bpe --no-write
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section  # noqa: E402
from sample import hf_greedy, median_seconds  # noqa: E402
from tinylm import GPT, ModelConfig, generate, native  # noqa: E402
from tinylm.commands.quantize import quantize  # noqa: E402
from tinylm.data import load_prepared  # noqa: E402
from tinylm.io.checkpoint import load_checkpoint  # noqa: E402
from tinylm.io.hf import to_hf  # noqa: E402
from tinylm.use.evaluation import evaluate  # noqa: E402


def ct2_folders(model: GPT, root: Path) -> dict[str, Path]:
    """CTranslate2 conversions (float32, int8) of ``model``'s Hugging Face export."""
    import ctranslate2
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    hf_dir = root / "hf"
    to_hf(model).save_pretrained(hf_dir)
    V = model.config.vocab_size
    vocab = {f"t{i}": i for i in range(V)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                   bos_token="t0", eos_token="t0", unk_token="t0")
    fast.save_pretrained(hf_dir)
    out = {}
    for q in ("float32", "int8"):
        out[q] = root / f"ct2-{q}"
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(
            str(out[q]), quantization=q, force=True)
    return out


def ct2_generator(folder: Path, threads: int):
    import ctranslate2

    return ctranslate2.Generator(str(folder), device="cpu", intra_threads=threads,
                                 inter_threads=1)


def ct2_greedy(gen, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """CTranslate2 greedy decoding of exactly ``n`` new tokens per row."""
    tokens = [[f"t{i}" for i in row] for row in prompt.tolist()]
    res = gen.generate_batch(tokens, max_length=n, min_length=n, sampling_topk=1,
                             include_prompt_in_result=False, end_token=[])
    return torch.tensor([r.sequences_ids[0] for r in res])


def speed_rows(args: argparse.Namespace) -> tuple[list[dict], GPT, str]:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50257, context_length=512, n_layer=6, n_head=6,
                         n_embd=384, tie_embeddings=False)
    fp32 = GPT(config).eval()
    int8 = copy.deepcopy(fp32)
    quantize(int8, include_head=True)
    hf = to_hf(fp32)
    with native.plan(int8, "cpu").decoder(1) as decoder:
        path = decoder.path
    n = args.new_tokens
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinylm-bench-quant-") as tmp:
        gens = {q: ct2_generator(f, args.threads) for q, f in ct2_folders(fp32, Path(tmp)).items()}
        for B in args.batches:
            prompt = torch.randint(0, config.vocab_size, (B, args.prompt_len))
            runs = {
                "tinylm fp32": lambda p=prompt: generate(fp32, p, n, temperature=0),
                "tinylm int8": lambda p=prompt: generate(int8, p, n, temperature=0),
                "HF fp32": lambda p=prompt: hf_greedy(hf, p, n),
                "CT2 float32": lambda p=prompt: ct2_greedy(gens["float32"], p, n),
                "CT2 int8": lambda p=prompt: ct2_greedy(gens["int8"], p, n),
            }
            row = {"batch": B}
            for name, fn in runs.items():
                row[name] = B * n / median_seconds(fn, args.repeats)
                print(f"batch {B}: {name} {row[name]:.1f} tok/s", flush=True)
            ref = generate(fp32, prompt, n, temperature=0)[:, args.prompt_len:]
            q = generate(int8, prompt, n, temperature=0)[:, args.prompt_len:]
            row["int8 agrees"] = float((q == ref).float().mean())
            row["ct2 same"] = torch.equal(ct2_greedy(gens["float32"], prompt, n), ref)
            rows.append(row)
    return rows, int8, path


def ct2_loss(gen, windows: np.ndarray) -> float:
    """Mean next-token NLL of CTranslate2 over the windows (B, C + 1)."""
    res = gen.score_batch([[f"t{i}" for i in w] for w in windows.tolist()])
    return -float(np.mean([lp for r in res for lp in r.log_probs]))


def loss_rows(args: argparse.Namespace) -> tuple[dict[str, float], ModelConfig, int]:
    model, _tok = load_checkpoint(args.demo, "cpu")
    model.eval()
    data = load_prepared(args.data)
    C = model.config.context_length
    val = np.asarray(data.val[: args.windows * C + 1]).astype(np.int64)
    n_win = (len(val) - 1) // C
    windows = np.stack([val[i * C: i * C + C + 1] for i in range(n_win)])
    int8 = copy.deepcopy(model)
    quantize(int8, include_head=not model.config.tie_embeddings)
    out = {"tinylm fp32": evaluate(model, val[: n_win * C + 1]).loss,
           "tinylm int8": evaluate(int8, val[: n_win * C + 1]).loss}
    with tempfile.TemporaryDirectory(prefix="tinylm-bench-quant-") as tmp:
        for q, folder in ct2_folders(model, Path(tmp)).items():
            out[f"CT2 {q}"] = ct2_loss(ct2_generator(folder, args.threads), windows)
    return out, model.config, n_win * C


def report(args, rows, path, losses, demo_cfg, scored, load) -> str:
    names = ["tinylm fp32", "tinylm int8", "HF fp32", "CT2 float32", "CT2 int8"]
    lines = [
        "Speed model: random weights, 6 layers x 6 heads x E=384, C=512, V=50257, untied LM "
        "head (30.1 M weights read per step, all int8 in the int8 rows: blocks and head, "
        "`quantize(include_head=True)`, one scale per output channel). Greedy decoding of "
        f"{args.new_tokens} new tokens after a {args.prompt_len}-token prompt; median of "
        f"{args.repeats} runs. tinylm's int8 decoding path: {path}. CTranslate2 "
        f"{__import__('ctranslate2').__version__} converted from tinylm's Hugging Face "
        f"export, `intra_threads={args.threads}`. Machine: {os.cpu_count()} CPU cores "
        f"({platform.machine()}), torch {torch.__version__}, {args.threads} threads; load "
        f"average {load:.2f} at the start.",
        "",
        "| batch | " + " | ".join(f"{n} tok/s" for n in names)
        + " | int8 / fp32 | int8 / CT2 int8 | int8 tokens = fp32's | CT2 fp32 tokens = tinylm's |",
        "| ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r[n]:.1f}" for n in names)
                     + f" | **{r['tinylm int8'] / r['tinylm fp32']:.2f}x** | "
                     f"**{r['tinylm int8'] / r['CT2 int8']:.2f}x** | "
                     f"{100 * r['int8 agrees']:.0f} % | {'yes' if r['ct2 same'] else 'no'} |")
    fp = losses["tinylm fp32"]
    lines += [
        "",
        f"Validation loss of the trained model {args.demo} ({demo_cfg.n_layer} layers x "
        f"E={demo_cfg.n_embd}, V={demo_cfg.vocab_size}, tied head: blocks in int8) over the "
        f"first {scored:,} targets of {args.data}'s validation split (non-overlapping "
        "windows of its context):",
        "",
        "| | " + " | ".join(losses) + " |",
        "| --- | " + " | ".join("---:" for _ in losses) + " |",
        "| val loss | " + " | ".join(f"{v:.4f}" for v in losses.values()) + " |",
        "| vs tinylm fp32 | " + " | ".join(f"{100 * (v / fp - 1):+.2f} %"
                                          for v in losses.values()) + " |",
        "",
        "Command: `python benchmarks/quantize.py`",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--demo", type=Path, default=Path("runs/demo"),
                        help="trained checkpoint for the loss table (make demo's)")
    parser.add_argument("--data", type=Path, default=Path("data/python-docs-bpe"),
                        help="its prepared data folder")
    parser.add_argument("--windows", type=int, default=64, help="validation windows scored")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    losses, demo_cfg, scored = loss_rows(args)
    print(losses, flush=True)
    rows, _int8, path = speed_rows(args)
    body = report(args, rows, path, losses, demo_cfg, scored, load)
    print(body)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if not args.no_write:
        write_section("quantize", "Quantization: int8 decoding", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
