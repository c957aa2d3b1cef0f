"""``--help`` is quick and true (issue 36 items 4 and 10): building the parser imports no
torch, and every flag's help-shown default is the default that runs, for every command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(script: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"})
    return out.stdout.split()


def test_help_imports_no_torch() -> None:
    """``tinylm --help`` and every ``tinylm CMD --help`` build the parser without torch
    (importing it took 1-2 s, most of a --help's 2-6 s)."""
    script = (
        "import contextlib, io, sys\n"
        "import tinylm.cli\n"
        "print('torch' in sys.modules)\n"
        "from tinylm.cli import build_parser, main\n"
        "names = sorted(build_parser().commands)\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main(['--help'])] + [main([n, '--help']) for n in names]\n"
        "print('torch' in sys.modules, len(names), set(codes))\n"
    )
    assert _run(script) == ["False", "False", "15", "{0}"]


def test_import_tinylm_is_light_and_its_names_still_resolve() -> None:
    script = ("import sys, tinylm\n"
              "print('torch' in sys.modules)\n"
              "from tinylm import ModelConfig, TinyLMError\n"
              "print('torch' in sys.modules)\n"
              "model = tinylm.GPT(ModelConfig(vocab_size=8, context_length=4, n_layer=1,\n"
              "                               n_head=1, n_embd=8))\n"
              "print('torch' in sys.modules, type(model).__module__)\n")
    assert _run(script) == ["False", "False", "True", "tinylm.core.model"]


def test_python_m_tinylm_help_imports_no_torch() -> None:
    script = ("import runpy, sys\n"
              "sys.argv = ['tinylm', 'finetune', '--help']\n"
              "try:\n"
              "    runpy.run_module('tinylm', run_name='__main__')\n"
              "except SystemExit as exc:\n"
              "    code = exc.code\n"
              "print(code, 'torch' in sys.modules, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"})
    assert "usage: tinylm finetune" in out.stdout
    assert out.stderr.split() == ["0", "False"], out.stderr
