"""The package as a whole: entry points, public API, and the dependency direction."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tinylm

SRC = Path(tinylm.__file__).parent


def test_public_api() -> None:
    from tinylm import GPT, ModelConfig

    model = GPT(ModelConfig(vocab_size=10, context_length=4, n_layer=1, n_head=1, n_embd=4))
    import torch

    assert model(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3, 10)


def test_help_via_module_and_console_script() -> None:
    out = subprocess.run([sys.executable, "-m", "tinylm", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "usage: tinylm" in out
    script = Path(sys.executable).parent / "tinylm"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "usage: tinylm" in out


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "tinylm":
            names |= {f"tinylm.{a.name}" for a in node.names}  # from tinylm import kernels
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_reference_model_imports_no_acceleration() -> None:
    # tinylm.core.decoding under TYPE_CHECKING only: the KV cache's type, for annotations
    allowed = {"torch", "tinylm.core.config", "tinylm.core.errors", "tinylm.core.attention",
               "tinylm.core.decoding", "math", "typing", "__future__"}
    for name in ("core/attention.py", "core/model.py"):
        bad = {m for m in _imports(SRC / name)
               if not any(m == a or m.startswith(a + ".") for a in allowed)}
        assert not bad, f"{name} imports {bad}"
        tree = ast.parse((SRC / name).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and n.attr == "Function"], f"{name} defines an autograd.Function"
        assert "_forward_hooks" not in (SRC / name).read_text()


def test_only_the_acceleration_door_imports_the_native_package() -> None:
    for path in SRC.rglob("*.py"):
        if "native" in path.relative_to(SRC).parts or path.name == "acceleration.py":
            continue
        assert not any(m.startswith("tinylm.native") for m in _imports(path)), path.name


def test_the_native_package_sits_below_the_uses() -> None:
    # tinylm.layers.quantized and tinylm.layers.lora hold the replaced layers QuantizedLinear and
    # LoRALinear (reference math) at module level and import only torch, errors and the one
    # selection rule there (checked below); tinylm.layers.registry declares them to native.
    allowed = {"tinylm.core", "tinylm.layers.lora", "tinylm.native", "tinylm.layers.quantized",
               "tinylm.layers.registry"}
    stdlib_ = set(sys.stdlib_module_names) | {"__future__"}
    for layer_module in ("layers/quantized.py", "layers/lora.py"):
        top_level = [n for n in ast.parse((SRC / layer_module).read_text()).body
                     if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in top_level:
            names = [node.module] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            for m in names:
                assert m.split(".")[0] in stdlib_ | {"torch"} or m in (
                    "tinylm.core.errors", "tinylm.layers.selection"), m
    stdlib = set(sys.stdlib_module_names) | {"__future__", "_ctypes"}
    for path in (SRC / "native").glob("*.py"):
        for m in _imports(path):
            top = m.split(".")[0]
            # numpy and tokenizers: native/bpe.py's arrays and its oracle's regex engine
            assert top in stdlib or top in ("torch", "numpy", "tokenizers") or any(
                m == a or m.startswith(a + ".") for a in allowed), f"{path.name} imports {m}"
    build = _imports(SRC / "native" / "build.py")
    assert all(m.split(".")[0] in stdlib for m in build), build  # no torch: tests load it alone


# Files whose imports must all be at module level (the dependency graph in plain sight).
MODULE_LEVEL_IMPORTS = ["core/model.py", "core/attention.py", "core/decoding.py",
                        "acceleration.py", "use/sampling.py",
                        *(f"native/{p.name}" for p in (SRC / "native").glob("*.py"))]


def test_no_function_level_imports_in_the_model_and_native_files() -> None:
    for name in MODULE_LEVEL_IMPORTS:
        tree = ast.parse((SRC / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{name}: {node.name} imports inside the function"


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    long = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{rel}:{node.name} ({n} lines)")
    assert not long, long


def test_no_docstring_cites_a_file_outside_the_repository() -> None:
    for name in MODULE_LEVEL_IMPORTS:
        assert "SEED-MATH" not in (SRC / name).read_text(), name


HIDE_NATIVE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tinylm.native" or name.startswith("tinylm.native."):
            raise ImportError(f"{name} is hidden for this test")
sys.meta_path.insert(0, Hide())
import torch
from tinylm import GPT, ModelConfig, acceleration, generate
from tinylm.use.evaluation import evaluate
assert acceleration.native is None
m = GPT(ModelConfig(vocab_size=17, context_length=16, n_layer=1, n_head=2, n_embd=32))
plan = acceleration.accelerate(m, "cpu")
assert plan.paths == frozenset()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
ids = torch.randint(0, 17, (4, 17), generator=torch.Generator().manual_seed(0))
first = m.loss(ids[:, :-1], ids[:, 1:])
for _ in range(5):
    opt.zero_grad()
    m.loss(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
assert m.loss(ids[:, :-1], ids[:, 1:]) < first
print(generate(m, [1, 2], 5, temperature=0).shape, evaluate(m, ids.flatten()).loss > 0)
assert not any(k.startswith("tinylm.native") for k in sys.modules)
"""


def test_tinylm_works_with_the_native_package_deleted() -> None:
    out = subprocess.run([sys.executable, "-c", HIDE_NATIVE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch.Size([1,", "7])", "True"]


def test_torch_distributed_and_transformers_have_one_home() -> None:
    for path in SRC.rglob("*.py"):
        mods = _imports(path)
        if path.name != "distributed.py":
            assert not any(m.startswith("torch.distributed") for m in mods), path.name
        if path.name != "hf.py":
            assert "transformers" not in mods, path.name


def test_no_pickle_loading_in_src() -> None:
    for path in SRC.glob("*.py"):
        text = path.read_text()
        assert "pickle.load" not in text, path.name
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in text, path.name
