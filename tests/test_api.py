"""The public API of ``import tinylm``: every name imported on first use (issue 28 item
5: ``train``, ``evaluate`` and ``prepare``; issue 36 item 10: all of them, so ``import
tinylm`` loads no torch), each the real object of its module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tinylm

SRC = Path(tinylm.__file__).resolve().parents[1]


@pytest.mark.parametrize("name, module", [("train", "tinylm.training.loop"),
                                          ("evaluate", "tinylm.use.evaluation"),
                                          ("prepare", "tinylm.data.pipeline")])
def test_lazy_exports_are_the_real_functions(name, module) -> None:
    import importlib

    assert getattr(tinylm, name) is getattr(importlib.import_module(module), name)
    assert name in tinylm.__all__ and name in dir(tinylm)
    namespace: dict[str, object] = {}
    exec(f"from tinylm import {name}", namespace)
    assert namespace[name] is getattr(tinylm, name)


def test_every_lazy_name_is_the_object_of_its_module() -> None:
    import importlib

    for name, module in tinylm._LAZY.items():
        assert getattr(tinylm, name) is getattr(importlib.import_module(module), name), name
    assert set(tinylm.__all__) == {*tinylm._LAZY, "__version__"}


def test_every_exported_name_resolves_and_unknown_names_raise() -> None:
    for name in tinylm.__all__:
        assert getattr(tinylm, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tinylm.no_such_name  # noqa: B018
    assert not hasattr(tinylm, "no_such_name")


def test_import_tinylm_does_not_load_the_training_loop() -> None:
    script = ("import sys, tinylm\n"
              "print('tinylm.training.loop' in sys.modules)\n"
              "tinylm.train\n"
              "print('tinylm.training.loop' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(SRC), "TINYLM_NATIVE": "0"}).stdout
    assert out.split() == ["False", "True"], out
