"""The training block's matrix products on three CPU GEMMs, side by side: torch's ``mm``
(MKL), oneDNN's fp32 linear and tinylm's own kernel (csrc/gemm.c), as
``tinylm.native.gemm`` calls them, in one run.

    python benchmarks/gemm.py [--repeats 30] [--threads N] [--no-write]

For the block products of the two training shapes of ``benchmarks/train.py`` (4×128 B=12
and 6×384 B=8): x·Wᵀ (the projections), y + x·Wᵀ (the output projections into the
residual), G·W (the input gradients) and Gᵀ·X (the weight gradients). The three alternate
call by call; the figure is the median time. The table says which one tinylm's default
(``"native"``) takes for each product: oneDNN for x·Wᵀ and G·W of at least
``gemm.MIN_WORK`` multiply-adds, its own kernel for the rest. Written to BENCHMARKS.md
between ``<!-- bench:gemm -->`` markers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import closing_lines, write_section  # noqa: E402
from tinylm import native  # noqa: E402
from tinylm.native import gemm  # noqa: E402

BACKENDS = ("torch", "onednn", "native")

# shape name -> (tokens N = B·C, E)
SHAPES = {"4×128 B=12": (12 * 64, 128), "6×384 B=8": (8 * 256, 384)}


def products(N: int, E: int) -> dict[str, tuple]:
    """name -> (a function of the backend, multiply-adds, whether tinylm routes it)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    out = {}
    for name, (I, O) in {"QKV x·Wᵀ": (E, 3 * E), "up x·Wᵀ": (E, 4 * E)}.items():
        x, w = rand(N, I), rand(O, I)
        out[name] = (lambda x=x, w=w: gemm.xwt(x, w), N * I * O, True)
    for name, (I, O) in {"out y + x·Wᵀ": (E, E), "down y + x·Wᵀ": (4 * E, E)}.items():
        x, w, y = rand(N, I), rand(O, I), rand(N, O)
        out[name] = (lambda x=x, w=w, y=y: gemm.xwt_add(y.clone(), x, w), N * I * O, True)
    for name, (I, O) in {"up G·W": (E, 4 * E), "down G·W": (4 * E, E)}.items():
        grad, w = rand(N, O), rand(O, I)
        out[name] = (lambda grad=grad, w=w: gemm.xw(grad, w), N * I * O, True)
    grad, x = rand(N, 4 * E), rand(N, E)
    for name, (I, O) in {"up Gᵀ·X": (E, 4 * E), "down Gᵀ·X": (4 * E, E)}.items():
        grad, x = rand(N, O), rand(N, I)
        out[name] = (lambda grad=grad, x=x: _gtx(grad, x), N * I * O, False)
    return out


def _gtx(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gᵀ·X on the selected library (oneDNN, which tinylm does not use for it: through
    the copy of the transposed operand its linear op needs)."""
    if gemm.selected() == "onednn":
        return torch.ops.mkldnn._linear_pointwise(grad.t(), x.t(), None, "none", [], "")
    return gemm.gtx(grad, x)


def timed(fn, backend: str) -> float:
    """One call of ``fn`` on ``backend``, whatever the product's size (oneDNN: MIN_WORK
    off; tinylm's kernel: no product passed on to oneDNN)."""
    threshold = gemm.MIN_WORK
    gemm.MIN_WORK = 0 if backend == "onednn" else 1 << 62
    try:
        with gemm.using(backend):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
    finally:
        gemm.MIN_WORK = threshold


def measure(repeats: int) -> list[dict]:
    rows = []
    for shape, (N, E) in SHAPES.items():
        for name, (fn, work, routed) in products(N, E).items():
            times = {b: [] for b in BACKENDS}
            for backend in times:
                timed(fn, backend)  # warm-up: oneDNN's primitive, MKL's buffers
            for _ in range(repeats):
                for backend in times:
                    times[backend].append(timed(fn, backend))
            takes = "oneDNN" if routed and work >= gemm.MIN_WORK else "tinylm"
            rows.append({"shape": shape, "product": name, "work": work, "takes": takes,
                         **{b: statistics.median(times[b]) for b in BACKENDS}})
            print(rows[-1], file=sys.stderr)
    return rows


def render(rows: list[dict], threads: int, load: float) -> str:
    lines = [f"{os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}, fp32; "
             f"median of alternated calls. tinylm uses oneDNN for x·Wᵀ and G·W of at least "
             f"{gemm.MIN_WORK:,} multiply-adds (`tinylm.native.gemm.MIN_WORK`), its own "
             "kernel (csrc/gemm.c) for the rest.", "",
             "| shape | product | multiply-adds | torch mm ms | oneDNN ms | tinylm ms | "
             "torch ÷ oneDNN | torch ÷ tinylm | tinylm takes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['product']} | {r['work'] / 1e6:,.0f} M | "
                     f"{r['torch'] * 1e3:.3f} | {r['onednn'] * 1e3:.3f} | "
                     f"{r['native'] * 1e3:.3f} | {r['torch'] / r['onednn']:.2f}× | "
                     f"{r['torch'] / r['native']:.2f}× | {r['takes']} |")
    return "\n".join(lines + closing_lines("benchmarks/gemm.py", load))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="calls per library")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if not gemm._available():
        sys.exit("this torch has no oneDNN linear op: nothing to compare")
    if native.load() is None:
        sys.exit("the native library did not build: nothing to compare")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    table = render(measure(args.repeats), args.threads, load)
    print(table)
    if not args.no_write:
        write_section("gemm", "The block's products: torch mm (MKL), oneDNN and tinylm's "
                      "kernel", table)


if __name__ == "__main__":
    main()
