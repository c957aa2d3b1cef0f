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


def test_attention_and_model_import_only_torch_config_errors() -> None:
    # kernels (the native CPU kernels) is a leaf like config/errors: see the next test.
    allowed = {"torch", "tinylm.config", "tinylm.errors", "tinylm.attention",
               "tinylm.kernels", "math", "__future__"}
    for name in ("attention.py", "model.py"):
        bad = {m for m in _imports(SRC / name)
               if not any(m == a or m.startswith(a + ".") for a in allowed)}
        assert not bad, f"{name} imports {bad}"


def test_kernels_is_a_leaf_importing_only_torch_and_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = {m for m in _imports(SRC / "kernels.py")
           if m.split(".")[0] not in stdlib and m.split(".")[0] != "torch"}
    assert not bad, f"kernels.py imports {bad}"


def test_torch_distributed_and_transformers_have_one_home() -> None:
    for path in SRC.glob("*.py"):
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
