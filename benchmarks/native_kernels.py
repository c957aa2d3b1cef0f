"""Each native kernel against its torch equivalent, on this machine.

    python benchmarks/native_kernels.py [--repeats 31] [--threads N] [--step] [--only NAME]

The training ops run at the two training shapes of benchmarks/train.py (4x128: E=128,
H=4, C=64, B=12; 6x384: E=384, H=6, C=256, B=8); the decoding ops at E=384 for batch 1
and 8. Each figure is the median over ``--repeats`` timed calls (after warm-up) of the
native op and of what the reference path runs instead (SDPA, F.layer_norm, F.gelu,
F.linear, torch.argmax, ...), in microseconds, the two alternating call by call.
``--step`` also times whole training steps (forward + backward + AdamW) of both shapes
with ``native.accelerate`` and under ``native.disabled()``. Nothing is written: the
figures go to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinylm import native  # noqa: E402
from tinylm.native import ops  # noqa: E402

SHAPES = {"4x128": (128, 4, 64, 12), "6x384": (384, 6, 256, 8)}  # E, H, C, B


def compare(name: str, mine: Callable[[], object], theirs: Callable[[], object],
            repeats: int) -> tuple[str, float, float]:
    """(name, median µs of ``mine``, of ``theirs``), the two calls alternating so that
    machine noise hits both alike."""
    for _ in range(3):
        mine()
        theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((mine, times[0]), (theirs, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return name, statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


def sdpa(qkv: torch.Tensor, H: int) -> torch.Tensor:
    B, C, three_e = qkv.shape
    q, k, v = qkv.view(B, C, 3, H, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, C, three_e // 3)


def training_ops(lib: ops.Library, shape: str, repeats: int) -> list[tuple[str, float, float]]:
    E, H, C, B = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, C, 3 * E, generator=g)
    out, lse = lib.causal_attention(qkv.clone(), H)
    gout = torch.randn(B, C, E, generator=g)
    qkv_t = qkv.clone().requires_grad_()
    y_t = sdpa(qkv_t, H)
    x = torch.randn(B * C, E, generator=g)
    w, b = torch.randn(E, generator=g), torch.randn(E, generator=g)
    y, mean, rstd = lib.layer_norm(x, w, b, 1e-5)
    xt, wt, bt = (t.clone().requires_grad_() for t in (x, w, b))
    yt = F.layer_norm(xt, (E,), wt, bt, 1e-5)
    gy = torch.randn(B * C, E, generator=g)
    h, bias = torch.randn(B * C, 4 * E, generator=g), torch.randn(4 * E, generator=g) * 1e-3
    h_mine, gh = h.clone(), torch.randn(B * C, 4 * E, generator=g)
    return [
        compare(f"attention fwd {shape}", lambda: lib.causal_attention(qkv, H),
                lambda: sdpa(qkv, H), repeats),
        compare(f"attention bwd {shape}",
                lambda: lib.causal_attention_backward(gout, qkv, out, lse, H),
                lambda: torch.autograd.grad(y_t, qkv_t, gout, retain_graph=True), repeats),
        compare(f"layer_norm fwd {shape}", lambda: lib.layer_norm(x, w, b, 1e-5),
                lambda: F.layer_norm(x, (E,), w, b, 1e-5), repeats),
        compare(f"layer_norm bwd {shape}",
                lambda: lib.layer_norm_backward(gy, x, w, mean, rstd, True, True),
                lambda: torch.autograd.grad(yt, (xt, wt, bt), gy, retain_graph=True),
                repeats),
        compare(f"bias+gelu {shape}", lambda: lib.bias_gelu_(h_mine, bias),
                lambda: F.gelu(h + bias, approximate="tanh"), repeats),
        compare(f"gelu bwd+colsum {shape}", lambda: lib.gelu_backward(gh.clone(), h, True),
                lambda: torch.ops.aten.gelu_backward(gh, h, approximate="tanh").sum(0),
                repeats),
    ]


def decode_ops(lib: ops.Library, repeats: int) -> list[tuple[str, float, float]]:
    E, H, D, T = 384, 6, 64, 201
    g = torch.Generator().manual_seed(0)
    rows = []
    for M in (1, 8):
        for O, I in ((3 * E, E), (4 * E, E), (E, 4 * E)):
            W, b = torch.randn(O, I, generator=g) * 0.05, torch.randn(O, generator=g)
            packed, x = lib.pack(W), torch.randn(M, I, generator=g)
            rows.append(compare(f"linear {O}x{I} M={M}", partial(lib.linear, x, packed, b, O),
                                partial(F.linear, x, W, b), repeats))
        W, x = torch.randn(4 * E, E, generator=g), torch.randn(M, E, generator=g)
        q = torch.randint(-127, 128, (4 * E, E), dtype=torch.int8, generator=g)
        s = torch.rand(4 * E, E // 64, generator=g) * 0.01
        rows.append(compare(f"linear_q8 {4 * E}x{E} M={M} (vs fp32)",
                            partial(lib.linear_q8_packed, x, lib.pack_q8(q, s, 64), None),
                            partial(F.linear, x, W), repeats))
        kc, vc = torch.randn(M, H, 256, D, generator=g), torch.randn(M, H, 256, D, generator=g)
        qv, scratch = torch.randn(M, H, 1, D, generator=g), torch.empty(M * H * 256)
        rows.append(compare(f"attend_one T={T} M={M}",
                            partial(lib.attend_one, qv, qv, qv, kc, vc, T - 1, scratch),
                            partial(F.scaled_dot_product_attention, qv, kc[:, :, :T],
                                    vc[:, :, :T]), repeats))
        logits = torch.randn(M, 50257, generator=g)
        rows.append(compare(f"argmax V=50257 M={M}", partial(lib.argmax, logits),
                            partial(torch.argmax, logits, -1), repeats))
    return rows


def step_off(step: Callable[..., object], x: torch.Tensor, y: torch.Tensor) -> None:
    with native.disabled():
        step(x, y)


def train_steps(repeats: int) -> list[tuple[str, float, float]]:
    from train import batch, build, model_config

    rows = []
    for shape, B in (("4x128", 12), ("6x384", 8)):
        config = model_config(shape)
        _, step = build("tinylm", config)
        x, y = batch(config, B)
        n = repeats if shape == "4x128" else max(3, repeats // 4)
        rows.append(compare(f"train step {shape} B={B} (vs off)", partial(step, x, y),
                            partial(step_off, step, x, y), n))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--step", action="store_true", help="also time whole training steps")
    parser.add_argument("--only", default="", help="run only rows whose name has this")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.ops.load()
    if lib is None:
        raise SystemExit("the native library is not available here")
    print(f"{'op':38s} {'native us':>10s} {'torch us':>10s} {'torch/native':>12s}"
          f"   ({torch.get_num_threads()} threads)")
    groups = [partial(training_ops, lib, shape, args.repeats) for shape in SHAPES]
    groups.append(partial(decode_ops, lib, args.repeats))
    if args.step:
        groups.append(partial(train_steps, args.repeats))
    for group in groups:
        for name, mine, theirs in group():
            if args.only in name:
                print(f"{name:38s} {mine:10.1f} {theirs:10.1f} {theirs / mine:11.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
