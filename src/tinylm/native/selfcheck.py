"""Every native op against its torch equivalent on small odd shapes (vector bodies and
scalar tails), and the BPE encoder on a worked example, run once after the library is
loaded: a miscompiled library is never used. :func:`run` raises RuntimeError naming the
op that disagrees."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from tinylm.core.attention import apply_rope, rope_angles
from tinylm.layers.blocks import TYPES as BLOCK_TYPES
from tinylm.layers.blocks import kernel_product, quantize_blocks


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{what} self-check failed")


def _linear_and_argmax(lib: Any, g: torch.Generator) -> None:
    for O, I in ((37, 19), (64, 33)):
        W, b = torch.randn(O, I, generator=g), torch.randn(O, generator=g)
        packed = lib.pack(W)
        for M in (1, 3, 8, 11):
            x = torch.randn(M, I, generator=g)
            for bias in (None, b):
                got = lib.linear(x, packed, bias, O)
                _expect(torch.allclose(got, F.linear(x, W, bias), rtol=1e-4, atol=1e-4),
                        f"linear (O={O} I={I} M={M})")
    for V in (1, 7, 16, 100):
        x = torch.randn(3, V, generator=g)
        x[1] = x[1].round()  # ties: the first index wins
        x[2, V // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
        _expect(torch.equal(lib.argmax(x), x.argmax(-1)), f"argmax (V={V})")


def _matmul(lib: Any, g: torch.Generator) -> None:
    for M, N, K in ((7, 70, 19), (13, 16, 300)):  # partial tiles and panels; two k chunks
        a, w, b = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g),
                   torch.randn(K, N, generator=g))
        at = torch.randn(K, M, generator=g)
        for got, want, form in ((lib.matmul(a, w, b_t=True), a @ w.t(), "x·Wᵀ"),
                                (lib.matmul(a, b), a @ b, "G·W"),
                                (lib.matmul(at, b, a_t=True), at.t() @ b, "Gᵀ·X")):
            _expect(torch.allclose(got, want, rtol=1e-4, atol=1e-3),
                    f"matmul {form} (M={M} N={N} K={K})")


def _linear_q8(lib: Any, g: torch.Generator) -> None:
    for O, I, G in ((37, 19, 19), (21, 33, 8), (3, 1, 1)):
        q = torch.randint(-127, 128, (O, I), generator=g, dtype=torch.int8)
        s = torch.rand(O, -(-I // G), generator=g) / 100
        b = torch.randn(O, generator=g)
        W = q.float() * s.repeat_interleave(G, dim=1)[:, :I]  # the reference dequantization
        for M in (1, 5, 16, 17):
            x, res = torch.randn(M, I, generator=g), torch.randn(M, O, generator=g)
            for bias, act, r in ((None, 0, None), (b, 1, None), (b, 0, res)):
                want = F.linear(x, W, bias)
                want = F.gelu(want, approximate="tanh") if act else want
                want = want + r if r is not None else want
                got = lib.linear_q8(x, q, s, G, bias, act, r)
                _expect(torch.allclose(got, want, rtol=1e-4, atol=1e-4),
                        f"int8 linear (O={O} I={I} G={G} M={M})")


def _linear_blocks(lib: Any, g: torch.Generator) -> None:
    for O, I in ((37, 19), (5, 70)):
        W, b = torch.randn(O, I, generator=g), torch.randn(O, generator=g)
        for block_type in BLOCK_TYPES:
            blocks = quantize_blocks(W, block_type)
            for M in (1, 5):
                x, res = torch.randn(M, I, generator=g), torch.randn(M, O, generator=g)
                want = kernel_product(x, blocks, block_type) + b
                got = lib.linear_blocks(x, blocks, block_type, b, 0, res) - res
                _expect(torch.allclose(got, want, rtol=1e-4, atol=1e-4),
                        f"{block_type} linear (O={O} I={I} M={M})")


def _decode_attention(lib: Any, g: torch.Generator) -> None:
    for B, H, D, T in ((2, 3, 16, 5), (1, 2, 20, 1)):
        q, k, v = torch.randn(B, 1, 3, H, D, generator=g).permute(2, 0, 3, 1, 4).unbind(0)
        kc, vc = torch.randn(2, B, H, T + 2, D, generator=g).unbind(0)
        got = lib.attend_one(q, k, v, kc, vc, T - 1, torch.empty(B * H * T))
        want = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T])
        _expect(torch.equal(kc[:, :, T - 1:T], k) and torch.allclose(got, want, atol=1e-5),
                f"decoding attention (B={B} H={H} D={D} T={T})")
    # a ragged batch (rows at their own positions) with grouped-query attention
    B, H, Hkv, D, L = 3, 6, 2, 20, 9
    pos = torch.tensor([0, 7, 3])
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g)
    kc, vc = torch.randn(2, B, Hkv, L, D, generator=g).unbind(0)
    out, scratch = torch.empty(B, H * D), torch.empty(B * H * L)
    lib.raw.tl_attend_rows(qkv.data_ptr(), qkv.stride(0), kc.data_ptr(), vc.data_ptr(),
                           kc.stride(0), kc.stride(1), B, H, Hkv, D, pos.data_ptr(),
                           D ** -0.5, out.data_ptr(), scratch.data_ptr(), L, 1)
    for b, p in enumerate(pos.tolist()):
        want = F.scaled_dot_product_attention(qkv[b, :H * D].view(H, 1, D), kc[b, :, :p + 1],
                                              vc[b, :, :p + 1], enable_gqa=True)
        _expect(torch.equal(kc[b, :, p], qkv[b, H * D:(H + Hkv) * D].view(Hkv, D))
                and torch.allclose(out[b].view(H, 1, D), want, atol=1e-5),
                f"ragged decoding attention (row {b} at {p})")


def _gelu(lib: Any, g: torch.Generator) -> None:
    h, b = torch.randn(5, 37, generator=g) * 4, torch.randn(37, generator=g)
    want_g = F.gelu(h + b, approximate="tanh")
    grad = torch.randn(5, 37, generator=g)
    want_grad = torch.ops.aten.gelu_backward(grad, h + b, approximate="tanh")
    got_g = lib.bias_gelu_(h, b)  # h += b
    grad_x, recomputed, colsum = lib.gelu_backward(grad, h, True)
    _expect(torch.allclose(got_g, want_g, atol=1e-5)
            and torch.allclose(recomputed, got_g, atol=1e-6)
            and torch.allclose(grad_x, want_grad, atol=1e-4)
            and torch.allclose(colsum, want_grad.sum(0), atol=1e-4), "GELU")


def _training_attention(lib: Any, g: torch.Generator) -> None:
    B, C, H, D = 2, 19, 2, 16
    grad = torch.randn(B, C, H * D, generator=g)
    bias = torch.randn(3 * H * D, generator=g)
    with torch.inference_mode(False), torch.enable_grad():  # load() may run under either
        qkv = torch.randn(B, C, 3 * H * D, generator=g, requires_grad=True)
        q, k, v = (qkv + bias).view(B, C, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        want = want.reshape(B, C, H * D)
        (want_grad,) = torch.autograd.grad(want, qkv, grad)
    qkv = qkv.detach().clone()
    out, lse = lib.causal_attention(qkv, H, bias)  # qkv += bias, in place
    got_grad, got_bias_grad = lib.causal_attention_backward(grad, qkv, out, lse, H,
                                                            bias_grad=True)
    _expect(torch.allclose(out, want, atol=1e-5)
            and torch.allclose(got_grad, want_grad, atol=1e-4)
            and torch.allclose(got_bias_grad, want_grad.sum((0, 1)), atol=1e-4),
            "causal attention")


def _layer_norm(lib: Any, g: torch.Generator) -> None:
    x, w = torch.randn(5, 37, generator=g) * 3 + 1, torch.randn(37, generator=g)
    b, grad = torch.randn(37, generator=g), torch.randn(5, 37, generator=g)
    with torch.inference_mode(False), torch.enable_grad():
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        want = F.layer_norm(xr, (37,), wr, br, 1e-5)
        want_grads = torch.autograd.grad(want, [xr, wr, br], grad)
    y, mean, rstd = lib.layer_norm(x, w, b, 1e-5)
    grads = lib.layer_norm_backward(grad, x, w, mean, rstd, True, True)
    _expect(torch.allclose(y, want, atol=1e-5) and all(
        torch.allclose(got, ref, atol=1e-4) for got, ref in zip(grads, want_grads, strict=True)),
        "LayerNorm")


def _variants(lib: Any, g: torch.Generator) -> None:
    x, w = torch.randn(5, 37, generator=g) * 3, torch.randn(37, generator=g)
    y, rs = lib.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    dx, dw = lib.rms_norm_backward(torch.ones_like(x), x, w, rs, True)
    _expect(torch.allclose(y, want, atol=1e-5) and torch.isfinite(dx).all().item()
            and torch.allclose(dw, (x * rs[:, None]).sum(0), atol=1e-4), "RMSNorm")
    B, C, H, Hkv, D = 1, 3, 2, 1, 18  # grouped-query, a head size with a scalar tail
    qkv = torch.randn(B, C, (H + 2 * Hkv) * D, generator=g)
    out, _ = lib.qk_rope(qkv, H, Hkv, None, None, None, None, 1e-6)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    _expect(torch.equal(out, torch.cat((q, k, k, v, v), dim=-1)), "QK-norm/RoPE layout")
    x, gain = torch.randn(2, 3 * D + 5, generator=g), torch.randn(D, generator=g) + 1
    cos, sin = (t[5] for t in rope_angles(0, 6, D, 10000.0))  # position 5's angles
    heads = x[:, :3 * D].reshape(2, 3, D)
    want = apply_rope(heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * gain,
                      cos, sin)
    half = D // 2
    got = lib.rope_heads(x.clone(), 3, gain, cos, torch.cat((-sin[:half], sin[half:])), 1e-6,
                         torch.empty(D))
    _expect(torch.allclose(got[:, :3 * D].reshape(2, 3, D), want, atol=1e-5)
            and torch.equal(got[:, 3 * D:], x[:, 3 * D:]), "decoding RoPE")
    h = torch.randn(3, 37, generator=g)
    _expect(torch.allclose(lib.relu2(h), F.relu(h).square()), "ReLU²")


def _bpe(lib: Any, g: torch.Generator | None) -> None:
    """Merges by rank, not by id: abc = ab + c, but b c merges first, so "abc" is a, bc."""
    raw = lib.raw
    merges = (ctypes.c_uint * 12)(98, 99, 256, 97, 98, 257, 257, 99, 258, 32, 97, 259)
    byte_ids = (ctypes.c_uint * 256)(*range(256))
    classes = ctypes.create_string_buffer(0x110000)
    for c in range(128):
        classes[c] = 1 if chr(c).isalpha() else 2 if chr(c).isdigit() else \
            3 if chr(c).isspace() else 0
    handle = raw.tl_bpe_new(merges, 4, byte_ids, classes)
    _expect(bool(handle), "BPE (no memory)")
    try:
        text = b"abc abcx1"
        ends, out = (ctypes.c_long * 3)(7, 7, 9), (ctypes.c_uint * 9)()
        lengths = (ctypes.c_long * 3)()
        total = raw.tl_bpe_encode(handle, text, ends, 3, out, lengths)
        _expect(total == 6 and list(out[:6]) == [97, 256, 259, 256, 120, 49]
                and list(lengths) == [4, 0, 2], "BPE")
    finally:
        raw.tl_bpe_free(handle)


def run_bpe(lib: Any) -> None:
    """Check the BPE encoder only (what ``prepare`` loads the library for)."""
    _bpe(lib, None)


def run(lib: Any) -> None:
    """Check every op of ``lib`` (a :class:`tinylm.native.ops.Library`)."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(False), torch.no_grad():
        for part in (_linear_and_argmax, _matmul, _linear_q8, _linear_blocks,
                     _decode_attention, _gelu, _training_attention, _layer_norm, _variants,
                     _bpe):
            part(lib, g)
