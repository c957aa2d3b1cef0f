"""torch.compile through tinylm's native kernels (issue 35): every custom op passes
``torch.library.opcheck``; a training step and a forward of every architecture preset
trace with no graph break and tinylm's ops in the graph; the compiled training equals the
eager one; ``--compile`` is decided by the plan, logs its warm-up and caches in tinylm's
folder. Compiles are few and tiny (``dynamic=False`` shapes, one model), as they cost
tens of seconds each on a CPU."""

from __future__ import annotations

import importlib
import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from tinylm.core.config import ModelConfig, TrainConfig, resolve_arch
from tinylm.core.model import GPT
from tinylm.data import load_prepared
from tinylm.training import read_metrics, train

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import build, customops  # noqa: E402

native_plan = importlib.import_module("tinylm.native.plan")  # native.plan is a function

V, C = 17, 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lib():
    library = native.load()
    assert library is not None  # this machine has a C compiler: the kernels must be live
    return library


def _model(arch: str, **changes) -> GPT:
    torch.manual_seed(0)
    fields = dict(context_length=C, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    if arch == "llama":
        fields["n_kv_head"] = 1  # grouped-query attention too
    return GPT(ModelConfig(vocab_size=V, **resolve_arch(arch, {**fields, **changes})))


def _batch(B: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (B, C + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _leaf(t: torch.Tensor | None, grad: bool = True) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_(grad)


def _x(E: int = 32, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, C, E, generator=g).requires_grad_(grad)


# --- every op: torch.library.opcheck -------------------------------------------------------


def _block_args(bias: bool) -> tuple:
    b = _model("gpt2", bias=bias).blocks[0]
    a, f = b.attn, b.ffn
    return (_x(), a.n_head, b.ln1.eps, b.ln2.eps, *(_leaf(t) for t in (
        b.ln1.weight, b.ln1.bias, a.qkv.weight, a.qkv.bias, a.out.weight, a.out.bias,
        b.ln2.weight, b.ln2.bias, f.up.weight, f.up.bias, f.down.weight, f.down.bias)))


def _variant_args(arch: str, grad: bool = True) -> tuple:
    model = _model(arch)
    x = _x(grad=grad)
    layout, tensors = native_plan._variant_args(model.blocks[0], x)
    leaves = [t if t is None or name in ("cos", "sin") else _leaf(t, grad)
              for name, t in zip(native.variants.TENSORS, tensors, strict=True)]
    return (x, *customops.layout_args(layout), customops.block_tensors(x, leaves))


def _attention_args() -> tuple:
    a = _model("gpt2").blocks[0].attn
    return (_x(), _leaf(a.qkv.weight), _leaf(a.qkv.bias), _leaf(a.out.weight),
            _leaf(a.out.bias), a.n_head)


def _ffn_args() -> tuple:
    f = _model("gpt2").blocks[0].ffn
    return (_x(), _leaf(f.up.weight), _leaf(f.up.bias), _leaf(f.down.weight),
            _leaf(f.down.bias))


def _backward_args(op: str, args: tuple) -> tuple:
    """The backward op's arguments after a forward of ``op`` on ``args``."""
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else
                     [t.detach() if t is not None else None for t in a] if isinstance(a, list)
                     else a for a in args)
    out = getattr(customops, op)(*detached)
    grad_y = torch.randn_like(out[0])
    if op == "block":
        x, n_head, _e1, _e2, ln1_w, _b1, w_qkv, b_qkv, w_out, b_out, ln2_w, _b2, w_up, \
            b_up, w_down, b_down = detached
        need = [True] + [a is not None for a in detached[4:]]
        return (grad_y, x, list(out[1:]), ln1_w, w_qkv, w_out, ln2_w, w_up, w_down, n_head,
                [t is not None for t in (b_qkv, b_out, b_up, b_down)], need)
    if op == "variant_block":
        x, *layout, tensors = detached
        need = [True] + [t.numel() > 0 and name not in ("cos", "sin")
                         for name, t in zip(native.variants.TENSORS, tensors, strict=True)]
        return (grad_y, x, list(out[1:]), tensors, *layout, need)
    if op == "attention":
        x, w_qkv, _b, w_out, _bo, n_head = detached
        return (grad_y, x, w_qkv, *out[1:], w_out, n_head, [True] * 5)
    x, w_up, _b, w_down, _bd = detached  # ffn
    return (grad_y, x, out[1], w_up, w_down, [True] * 5)


CASES = {
    "block": lambda: _block_args(True),
    "block-nobias": lambda: _block_args(False),
    "variant_block-llama": lambda: _variant_args("llama"),
    "variant_block-modern": lambda: _variant_args("modern"),
    "variant_block-gpt2": lambda: _variant_args("gpt2"),
    "attention": _attention_args,
    "ffn": _ffn_args,
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_op_and_its_backward_pass_opcheck(lib, case: str) -> None:
    op = case.split("-")[0]
    args = CASES[case]()
    torch.library.opcheck(getattr(customops, op), args)  # schema, fake, autograd, AOT
    backward = customops.OPS[op]
    torch.library.opcheck(backward, _backward_args(op, args))


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_block_inference_passes_opcheck(lib, arch: str) -> None:
    torch.library.opcheck(customops.block_inference, _variant_args(arch, grad=False))


def test_every_op_is_checked() -> None:
    assert {case.split("-")[0] for case in CASES} | {"block_inference"} == set(customops.OPS)


def test_the_ops_compute_the_autograd_functions_numbers(lib) -> None:
    """The custom op and the eager autograd Function are the same function: outputs and
    every gradient equal (bitwise: the same kernels in the same order)."""
    model = _model("gpt2")
    native.accelerate(model, "cpu")
    x, y = _batch()
    eager = model.loss(x, y)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with _compiling():
        op_loss = model.loss(x, y)
    op_loss.backward()
    assert torch.equal(op_loss, eager)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


class _compiling:
    """torch.compiler.is_compiling() True: the accelerated modules take the custom ops."""

    def __enter__(self):
        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(torch.compiler, "is_compiling", lambda: True)

    def __exit__(self, *exc):
        self.patch.undo()


# --- no graph breaks, tinylm's ops in the graph ---------------------------------------------


@pytest.mark.parametrize("arch, op", [("gpt2", "block"), ("llama", "variant_block"),
                                      ("modern", "variant_block")])
def test_every_preset_traces_with_no_graph_break(lib, arch: str, op: str) -> None:
    model = _model(arch)
    native.accelerate(model, "cpu")
    x, y = _batch()
    step = torch._dynamo.explain(model.loss)(x, y)  # a training step's forward, with grads
    assert step.graph_break_count == 0 and step.graph_count == 1, step.break_reasons
    assert step.graphs[0].code.count(f"torch.ops.tinylm.{op}.default(") == 2  # per block
    with torch.no_grad():  # evaluation
        forward = torch._dynamo.explain(model)(x)
    assert forward.graph_break_count == 0 and forward.graph_count == 1, forward.break_reasons
    assert forward.graphs[0].code.count("torch.ops.tinylm.block_inference.default(") == 2


def test_the_attention_and_ffn_paths_trace_with_no_graph_break(lib) -> None:
    model = _model("gpt2")
    assert native.plan(model, "cpu").apply(only=("attention", "ffn")).paths
    explained = torch._dynamo.explain(model.loss)(*_batch())
    assert explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    assert code.count("torch.ops.tinylm.attention.default(") == 2
    assert code.count("torch.ops.tinylm.ffn.default(") == 2


# --- the compiled step equals the eager one; --compile through train() ----------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus

    root = tmp_path_factory.mktemp("compile-data")
    text = root / "text.txt"
    text.write_text(load_corpus("python-docs")[:20_000], encoding="utf-8")
    prepare(root / "prepared", [text], tokenizer="char", context_length=C, progress=False)
    return root / "prepared"


MODEL = dict(n_layer=2, n_head=2, n_embd=32, context_length=C, dropout=0.0)
TRAIN = dict(batch_size=4, lr=1e-3, warmup_steps=0, max_steps=4, eval_every=1000,
             eval_windows=2, save_every=1000, log_every=1, seed=3, device="cpu")


def test_compiled_training_equals_eager(lib, data_dir, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tinylm")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    user_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if user_cache == default_cache_dir():  # torch's own, written back by torch
        user_cache = None
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        train(ModelConfig(**MODEL), TrainConfig(**TRAIN, compile=compiled), data_dir, out,
              progress=False)
        runs[compiled] = [r["train_loss"] for r in read_metrics(out) if "train_loss" in r]
    assert len(runs[True]) == TRAIN["max_steps"]
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)
    assert "torch.compile is not usable" not in caplog.text
    assert "--compile: native custom ops in the graph; warm-up" in caplog.text
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == (
        user_cache or str(build.compile_cache_root()))

    # one step through the same compiled graph (the FX cache has it): loss and gradients
    vocab = load_prepared(data_dir).tokenizer.vocab_size
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=vocab, **MODEL))  # train()'s model: the same graph
    native.accelerate(model, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (4, C + 1),
                        generator=torch.Generator().manual_seed(5))
    x, y = ids[:, :-1], ids[:, 1:]
    eager = model.loss(x, y)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    step = torch.compile(model.loss, dynamic=False)
    loss = step(x, y)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_compile_cache_is_a_private_tinylm_folder(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = tmp_path / "cache" / "tinylm" / "inductor"
    monkeypatch.setattr(build, "compile_cache_root", lambda: folder)
    assert native_plan.use_compile_cache() == str(folder)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's wins
    assert native_plan.use_compile_cache() == str(tmp_path / "mine")
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as torch sets it
    assert native_plan.use_compile_cache() == str(folder)
    assert cache_dir() == str(folder)  # where inductor now writes
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    folder.chmod(0o777)  # writable by others: not used, torch's default stays
    assert native_plan.use_compile_cache() is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "writable by group or others" in caplog.text


def test_the_plan_says_what_the_graph_holds(lib) -> None:
    assert native.accelerate(_model("gpt2"), "cpu").compiled_path == "native custom ops"
    with native.disabled():
        assert native.accelerate(_model("gpt2"), "cpu").compiled_path == "reference"
    assert native.accelerate(_model("gpt2").double(), "cpu").compiled_path == "reference"


def test_off_the_native_kernels_the_reference_model_is_traced(lib) -> None:
    """Where the native kernels do not run (here float64; on CUDA likewise) the
    accelerated FFN runs its reference forward inside the graph: no tinylm op, no break."""
    model = _model("gpt2").double()
    plan = native.accelerate(model, "cpu")
    assert plan.paths == {"ffn"} and plan.compiled_path == "reference"
    explained = torch._dynamo.explain(model.loss)(*_batch())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "torch.ops.tinylm" not in explained.graphs[0].code
