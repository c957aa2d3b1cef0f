"""tinylm.layers.blocks and csrc/blocks.c: GGUF's Q4_0 / Q4_1 / Q8_0 blocks as a layer and
as a native decoding kernel.

The oracles: the ``gguf`` package (llama.cpp's format library) for the bytes a
quantization writes and for the float32 weight of any bytes (bit for bit); for the
kernel, the reference layer's product x·Wᵀ within the closed-form bound of the
activations' rounding (Σ_blocks dx/2 · Σ|w|), and :func:`kernel_product` (the same
integer arithmetic in torch, float64) to float rounding; each of the kernel's three
builds (AVX-512 VNNI, AVX2, portable C) compiled here and held to the same; end to end,
the fused decoding steps against the reference decoder whose block layers compute the
kernel's arithmetic (every step's logits within 1e-4, the same greedy tokens).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from tinylm import GPT, ModelConfig
from tinylm.cli import main
from tinylm.commands.quantize import quantize
from tinylm.core.decoding import Decoder
from tinylm.data import prepare
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.blocks import (
    TYPES,
    BlockLinear,
    dequantize_blocks,
    kernel_product,
    quantize_activations,
    quantize_blocks,
)

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import build, ops  # noqa: E402

NATIVE = os.environ.get("TINYLM_NATIVE") != "0"
torch.set_num_threads(1)


def hard_weights(O: int, I: int, seed: int = 0) -> torch.Tensor:
    """Random rows of different magnitudes, with an all-zero block, a block whose largest
    magnitude is tied (±3), and a block small enough for fp16 subnormal scales."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(O, I, generator=g) * torch.rand(O, 1, generator=g) * 3
    W[0, :32] = 0
    if O > 1 and I > 6:
        W[1, 5], W[1, 6] = -3.0, 3.0
    if O > 2:
        W[2] *= 1e-6
    return W


# --- the bytes: gguf's own quantization and dequantization ----------------------------------


@pytest.mark.parametrize("block_type", list(TYPES))
@pytest.mark.parametrize("O, I", [(7, 96), (5, 45), (1, 1), (3, 33)])
def test_quantize_writes_the_bytes_gguf_writes(block_type, O, I) -> None:
    W = hard_weights(O, I)
    padded = F.pad(W, (0, -I % 32)).numpy()  # GGUF rows are whole blocks
    ours = quantize_blocks(W, block_type)
    assert ours.dtype == torch.uint8 and ours.shape == (O, -(-I // 32) * TYPES[block_type][1])
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(padded, Q[block_type]))


@pytest.mark.parametrize("block_type", list(TYPES))
def test_the_layer_weight_is_gguf_dequantization_of_any_bytes(block_type) -> None:
    """Random bytes (every code, Q8_0's −128, negative and subnormal fp16 scales and
    minimums; no inf/NaN) -> the weight equals gguf.quants.dequantize bit for bit."""
    g = np.random.default_rng(0)
    O, nb, size = 6, 3, TYPES[block_type][1]
    raw = g.integers(0, 256, (O, nb, size), dtype=np.uint8)
    for at in (0, 2) if block_type == "Q4_1" else (0,):
        half = g.standard_normal((O, nb)).astype(np.float16)
        half[0, 0] = np.float16(3e-6)  # subnormal
        raw[:, :, at:at + 2] = half.view(np.uint8).reshape(O, nb, 2)
    raw = raw.reshape(O, nb * size)
    want = gguf.quants.dequantize(raw, Q[block_type])
    layer = BlockLinear(nb * 32, O, block_type, bias=False)
    layer.blocks.copy_(torch.from_numpy(raw))
    assert torch.equal(layer.weight, torch.from_numpy(want))
    assert torch.equal(dequantize_blocks(torch.from_numpy(raw), block_type, 70),
                       torch.from_numpy(want)[:, :70])


def test_block_linear_is_dequantize_then_linear_and_packs_two_weights_per_byte() -> None:
    dense = torch.nn.Linear(96, 10)
    for block_type, per_block in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        layer = BlockLinear.from_linear(dense, block_type)
        assert layer.blocks.numel() == 10 * 3 * per_block  # Q4_0: 0.5625 bytes per weight
        x = torch.randn(4, 96)
        assert torch.equal(layer(x), F.linear(x, layer.weight, dense.bias))
        assert torch.equal(layer.to_linear().weight, layer.weight)


# --- the kernel -----------------------------------------------------------------------------


def activation_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """(M, O): Σ_b (dx[m, b] / 2)·Σ_{i in b} |W[o, i]|, the most the activations'
    rounding (|x − dx·qx| <= dx/2) can move x·Wᵀ."""
    _, dx = quantize_activations(x)
    O, I = W.shape
    absw = F.pad(W.abs(), (0, -I % 32)).view(O, -1, 32).sum(2)  # (O, nb)
    return (dx.double() / 2) @ absw.double().T


def check_kernel(run, block_type: str, O: int, I: int, M: int, seed: int) -> None:
    """``run(x, blocks, type, bias, act, res)`` against both oracles."""
    g = torch.Generator().manual_seed(seed)
    blocks = quantize_blocks(hard_weights(O, I, seed), block_type)
    W = dequantize_blocks(blocks, block_type, I)
    x, b = torch.randn(M, I, generator=g), torch.randn(O, generator=g)
    res = torch.randn(M, O, generator=g)
    got = run(x, blocks, block_type, b, 0, None)
    same = kernel_product(x, blocks, block_type) + b
    scale = (x.abs() @ W.abs().T).max().item() + 1
    torch.testing.assert_close(got, same, rtol=0, atol=2e-6 * scale)
    gap = (got.double() - F.linear(x, W, b).double()).abs()
    assert (gap <= activation_bound(x, W) * (1 + 1e-5) + 2e-6 * scale).all()
    torch.testing.assert_close(run(x, blocks, block_type, b, 1, None),  # vector-free GELU
                               F.gelu(same, approximate="tanh"), rtol=0, atol=4e-6 * scale)
    torch.testing.assert_close(run(x, blocks, block_type, b, 0, res), same + res,
                               rtol=0, atol=4e-6 * scale)


@pytest.fixture(scope="module")
def lib() -> ops.Library:
    library = native.load()
    assert library is not None
    return library


@pytest.mark.parametrize("block_type", list(TYPES))
@pytest.mark.parametrize("O, I", [(1, 1), (45, 129), (7, 521), (33, 300), (19, 32), (9, 13)])
def test_kernel_equals_the_reference_within_the_activation_bound(lib, block_type, O, I
                                                                 ) -> None:
    for M in (1, 3, 4, 5, 16):  # tiles of 4 rows and their remainders
        check_kernel(lib.linear_blocks, block_type, O, I, M, seed=O + I + M)


def test_a_non_finite_activation_stays_non_finite(lib) -> None:
    """NaN or inf in a row of x: that row's outputs are NaN (the reference layer's are
    NaN or infinite), never a finite value the checks downstream would let through."""
    blocks = quantize_blocks(torch.randn(20, 70), "Q4_0")
    x = torch.randn(3, 70)
    x[0, 40], x[2, 3] = float("nan"), float("inf")
    y = lib.linear_blocks(x, blocks, "Q4_0", None)
    ref = F.linear(x, dequantize_blocks(blocks, "Q4_0", 70))
    assert not ref[0].isfinite().any() and not ref[2].isfinite().any()
    assert y[0].isnan().all() and y[2].isnan().all() and y[1].isfinite().all()


def test_kernel_checks_its_arguments(lib) -> None:
    blocks = quantize_blocks(torch.randn(8, 64), "Q4_0")
    with pytest.raises(ops.OpError, match="blocks must have shape"):
        lib.linear_blocks(torch.randn(1, 96), blocks, "Q4_0", None)
    with pytest.raises(ops.OpError, match="torch.uint8"):
        lib.linear_blocks(torch.randn(1, 64), blocks.to(torch.int8), "Q4_0", None)
    with pytest.raises(KeyError):
        lib.linear_blocks(torch.randn(1, 64), blocks, "Q5_0", None)


# Each build of csrc/blocks.c: the macros that pick its path, then the kernel itself.
TARGETS = {"native": "__AVX512VNNI__", "x86-64-v3": "__AVX2__", "x86-64": None}


def _macros(flags: list[str]) -> set[str]:
    out = subprocess.run([build.find_compiler(), *flags, "-dM", "-E", "-x", "c",
                          "/dev/null"], capture_output=True, text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define")}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86 targets")
@pytest.mark.parametrize("march", list(TARGETS))
def test_every_build_of_the_kernel_computes_the_same(tmp_path, march) -> None:
    flags = [f"-march={march}"]
    runs_here = True  # a CPU without AVX-512 VNNI: its path is built (-Werror), not run
    if march == "native" and "__AVX512VNNI__" not in _macros(flags):
        flags, runs_here = ["-march=x86-64-v4", "-mavx512vnni"], False
    macros = _macros(flags)
    assert (march == "native") == ("__AVX512VNNI__" in macros)
    assert (march == "x86-64") == ("__AVX2__" not in macros)  # the portable C path
    so = tmp_path / f"blocks-{march}.so"
    subprocess.run([build.find_compiler(), "-O3", *flags, "-fopenmp", "-shared",
                    "-fPIC", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
                    str(build.SOURCES / "blocks.c"), "-o", str(so)], check=True,
                   capture_output=True, timeout=300)
    if not runs_here:
        return
    cdll = ctypes.CDLL(str(so))
    sigs = ops.parse_header(ops.HEADER.read_text())
    for name in ("tl_blocks_packed_size", "tl_blocks_pack", "tl_linear_blocks"):
        getattr(cdll, name).restype, getattr(cdll, name).argtypes = sigs[name]

    def run(x, blocks, block_type, b, act, res):
        (M, I), O, type_id = x.shape, blocks.shape[0], TYPES[block_type][0]
        packed = torch.empty(cdll.tl_blocks_packed_size(type_id, O, I), dtype=torch.uint8)
        cdll.tl_blocks_pack(blocks.data_ptr(), type_id, packed.data_ptr(), O, I, 1)
        y = torch.empty(M, O)
        cdll.tl_linear_blocks(x.data_ptr(), I, packed.data_ptr(), type_id, b.data_ptr(),
                              y.data_ptr(), M, I, O, 1, act,
                              None if res is None else res.data_ptr())
        return y

    for block_type in TYPES:  # panels of 16 rows and their remainders, tiles of 4 rows
        for O, I, M in ((45, 129, 5), (7, 521, 1), (1, 1, 4), (9, 13, 16), (33, 64, 3)):
            check_kernel(run, block_type, O, I, M, seed=M)


# --- end to end: the fused decoding steps -----------------------------------------------------


def kernel_forward(self: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """BlockLinear's forward as the native kernel computes it (quantized activations)."""
    y = kernel_product(x.reshape(-1, x.shape[-1]), self.blocks, self.block_type)
    y = y.reshape(*x.shape[:-1], -1)
    return y + self.bias if self.bias is not None else y


LAYOUTS = {"gpt2": dict(n_embd=45, n_head=3),
           "llama-gqa": dict(n_embd=48, n_head=3, n_kv_head=1, norm="rmsnorm", position="rope",
                             mlp="swiglu", bias=False)}


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fused decoding step")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-head-Q8_0"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_decoding_equals_the_reference_with_the_kernels_arithmetic(monkeypatch, layout,
                                                                         tied) -> None:
    torch.manual_seed(3)
    model = GPT(ModelConfig(vocab_size=61, context_length=80, n_layer=2,
                            tie_embeddings=tied, **LAYOUTS[layout])).eval()
    kinds = iter(list(TYPES) * 8)  # every type, head included
    for name, m in list(model.named_modules()):
        if type(m) is torch.nn.Linear and not (tied and name == "lm_head"):
            model.set_submodule(name, BlockLinear.from_linear(m, next(kinds)))
    if tied:  # the tied head as Q8_0 blocks of the embedding (a GGUF import, quantize -4)
        model.lm_head = BlockLinear.from_linear(model.lm_head, "Q8_0")
        assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    plan = native.plan(model, "cpu")
    assert plan.paths == {"decode"}
    monkeypatch.setattr(BlockLinear, "forward", kernel_forward)
    ref, fused = Decoder(model, 2), plan.decoder(2)
    assert fused.path == ("fused" if layout == "gpt2" else "fused-variant")
    prompt = torch.randint(0, 61, (2, 8))
    with torch.inference_mode():
        a, b = ref.prefill(prompt), fused.prefill(prompt)  # prefill through the step
        for _ in range(32):
            if tied:  # the head's product exactly as the kernel's arithmetic, on the
                h = fused._fused.h  # step's own final-norm output
                torch.testing.assert_close(b, kernel_product(h, model.lm_head.blocks, "Q8_0"),
                                           rtol=0, atol=1e-5)
            # the step's hidden state differs from the reference's in the last float bits
            # (summation order), which now and then moves an activation across a rounding
            # boundary of its Q8 code: one code step changes a logit by d·dx·|q| (<= ~1e-3
            # here, with the tied head's larger weights); without that, ~1e-7
            torch.testing.assert_close(b, a, rtol=0, atol=2e-3 if tied else 1e-4)
            nxt = ref.argmax(a)
            assert torch.equal(fused.argmax(b), nxt)
            a, b = ref.step(nxt), fused.step(nxt)


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no fused decoding step")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_long_prompt_is_prefilled_on_the_blocks_kernel(monkeypatch, layout) -> None:
    from tinylm.native.decoding import INT8_PREFILL_ROWS

    torch.manual_seed(4)
    T = INT8_PREFILL_ROWS + 23  # past the step-by-step prefill: the forward runs
    model = GPT(ModelConfig(vocab_size=61, context_length=T + 8, n_layer=2,
                            **LAYOUTS[layout])).eval()
    kinds = iter(list(TYPES) * 8)
    for name, m in list(model.named_modules()):
        if type(m) is torch.nn.Linear and name != "lm_head":
            model.set_submodule(name, BlockLinear.from_linear(m, next(kinds)))
    model.lm_head = BlockLinear.from_linear(model.lm_head, "Q8_0")
    fused = native.plan(model, "cpu").decoder(1)
    prompt = torch.randint(0, 61, (1, T))
    with torch.inference_mode():
        dequantized = Decoder(model, 1).prefill(prompt)  # BlockLinear's own forward
        got = fused.prefill(prompt)
        assert not [m for m in model.modules()  # the classes swapped back
                    if isinstance(m, BlockLinear) and type(m) is not BlockLinear]
        monkeypatch.setattr(BlockLinear, "forward", kernel_forward)
        want = Decoder(model, 1).prefill(prompt)  # the kernel's arithmetic, in torch
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (got - dequantized).abs().max() > 1e-6  # not the dequantized path after all
    assert torch.equal(fused.argmax(got), dequantized.argmax(-1))


# --- the command --------------------------------------------------------------------------------


TEXT = "the quick brown fox jumps over the lazy dog. attention is all you need!\n" * 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(root / "data", [root / "text.txt"], context_length=16, progress=False)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=data.vocab_size, context_length=16, n_layer=2,
                            n_head=2, n_embd=64))
    save_checkpoint(root / "model", model, data.tokenizer)
    return root


@pytest.mark.parametrize("flags, block_type", [([], "Q4_0"), (["--asymmetric"], "Q4_1")])
def test_quantize_bits_4_group_32_writes_packed_blocks(setup, tmp_path, capsys, flags,
                                                       block_type) -> None:
    out = tmp_path / "q4"
    assert main(["quantize", "--model", str(setup / "model"), "--out", str(out), "--bits",
                 "4", "--group-size", "32", "--data", str(setup / "data"), *flags]) == 0
    printed = capsys.readouterr().out
    assert f"quantize ({block_type}: 4-bit" in printed and "val loss:" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["gguf_blocks"]["blocks.0.ffn.up"] == {"type": block_type}
    assert "quantize" not in config
    model, _ = load_checkpoint(out)
    original, _ = load_checkpoint(setup / "model")
    up = model.blocks[1].ffn.up
    assert isinstance(up, BlockLinear) and up.block_type == block_type
    assert torch.equal(up.blocks, quantize_blocks(original.blocks[1].ffn.up.weight, block_type))
    per = TYPES[block_type][1]  # 18 or 20 bytes per 32 weights, before 4 per weight
    assert f"{64 * 256 * 4:>13,} {256 * 2 * per:>12,}" in printed  # ffn.up: 64 -> 256
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["checkpoint"]
    V = model.config.vocab_size  # and the tied LM head, Q8_0 blocks of V x 64
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.block_type == "Q8_0"
    assert info["parameter_kinds"]["quantized"] == 2 * (64 * 192 + 64 * 64 + 2 * 64 * 256) \
        + V * 64
    assert info["quantized"][0]["block_type"] == block_type
    assert main(["sample", "--model", str(out), "--prompt", "the", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--asymmetric"], "--asymmetric is GGUF's Q4_1 and needs --bits 4 --group-size 32"),
    (["--bits", "4", "--group-size", "16", "--asymmetric"], "needs --bits 4 --group-size 32"),
])
def test_asymmetric_needs_bits_4_group_32(setup, tmp_path, capsys, flags, message) -> None:
    code = main(["quantize", "--model", str(setup / "model"), "--out", str(tmp_path / "o"),
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_quantize_in_python_and_the_report_bytes() -> None:
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=40, context_length=16, n_layer=1, n_head=2,
                            n_embd=64)).eval()
    report = quantize(model, 4, 32)
    assert report.block_type == "Q4_0" and report.scheme.startswith("Q4_0: 4-bit symmetric")
    qkv = report.layers[0]
    assert (qkv.name, qkv.groups, qkv.bytes_after) == ("blocks.0.attn.qkv", 2, 192 * 2 * 18)
    # Q4_0 maps a group's signed extreme to code 0 (d = extreme / −8): half a step, d/2 =
    # max/16, everywhere except the other side's end, clipped at code 15: max/8 there
    assert 1 / 16 < qkv.max_rel_error <= (1 / 8) * (1 + 2 ** -10)  # fp16 d
    # the tied LM head becomes Q8_0 blocks (llama-quantize's higher output type); the
    # embedding lookup keeps the float table
    head = report.layers[-1]
    assert head.name == "lm_head" and isinstance(model.lm_head, BlockLinear)
    assert model.lm_head.block_type == "Q8_0" and type(model.tok_emb) is torch.nn.Embedding
    assert torch.equal(model.lm_head.blocks, quantize_blocks(model.tok_emb.weight, "Q8_0"))
    assert 0 < head.max_rel_error <= (1 / 254) * (1 + 2 ** -10)  # half a step of max/127


@pytest.mark.skipif(not NATIVE, reason="TINYLM_NATIVE=0: no decoding plan packs")
def test_the_decoder_repacks_blocks_changed_in_place(lib) -> None:
    from tinylm.native.decoding import packed_blocks

    layer = BlockLinear.from_linear(torch.nn.Linear(64, 20), "Q4_0")
    first = packed_blocks(lib, layer)
    assert packed_blocks(lib, layer) is first  # cached while unchanged
    layer.blocks.copy_(quantize_blocks(torch.randn(20, 64), "Q4_0"))  # in place: repacked
    x = torch.randn(2, 64)
    torch.testing.assert_close(lib.linear_blocks_packed(x, packed_blocks(lib, layer), None),
                               kernel_product(x, layer.blocks, "Q4_0"), rtol=0, atol=1e-4)
