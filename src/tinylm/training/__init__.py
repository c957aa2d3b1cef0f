"""Training: the loop, its run folder and log, distributed strategies, fine-tuning.

The room's modules: :mod:`~tinylm.training.loop` (``train``: the phases),
:mod:`~tinylm.training.state` (the run's typed parts), :mod:`~tinylm.training.setup`
(building and restoring), :mod:`~tinylm.training.saving` (OUT/latest),
:mod:`~tinylm.training.optim` (AdamW groups, Muon, the lr schedule),
:mod:`~tinylm.training.runlog` (metrics.jsonl, progress, plots),
:mod:`~tinylm.training.runfolder` (preflight, the resume decision, config layering),
:mod:`~tinylm.training.batches` (the data and its batches),
:mod:`~tinylm.training.threads`, :mod:`~tinylm.training.distributed`,
:mod:`~tinylm.training.finetune` and :mod:`~tinylm.training.defaults` (fine-tuning's
defaults, which the command line reads without torch). The names below are the ones
outside code uses, each imported on first use, so importing a torch-free module of the
room (``defaults``) does not load the loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The exported names -> the module of this room that defines them.
_EXPORTS = {
    "TrainData": "batches",
    "NonFiniteLossError": "loop", "TrainResult": "loop", "train": "loop", "train_run": "loop",
    "MuonAdamW": "optim", "build_optimizer": "optim", "decay_groups": "optim",
    "lr_at": "optim", "newton_schulz": "optim", "optimizer_recipe": "optim",
    "set_lr": "optim",
    "UNSET": "runfolder", "layer_configs": "runfolder", "preflight": "runfolder",
    "resume_mode": "runfolder",
    "plot_losses": "runlog", "plot_runs": "runlog", "read_metrics": "runlog",
    "command_threads": "threads", "using_threads": "threads",
}

if TYPE_CHECKING:  # the names for type checkers and editors; never run
    from tinylm.training.batches import TrainData
    from tinylm.training.loop import NonFiniteLossError, TrainResult, train, train_run
    from tinylm.training.optim import (
        MuonAdamW,
        build_optimizer,
        decay_groups,
        lr_at,
        newton_schulz,
        optimizer_recipe,
        set_lr,
    )
    from tinylm.training.runfolder import UNSET, layer_configs, preflight, resume_mode
    from tinylm.training.runlog import plot_losses, plot_runs, read_metrics
    from tinylm.training.threads import command_threads, using_threads


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["UNSET", "MuonAdamW", "NonFiniteLossError", "TrainData", "TrainResult",
           "build_optimizer", "command_threads", "decay_groups", "layer_configs", "lr_at",
           "newton_schulz", "optimizer_recipe", "plot_losses", "plot_runs", "preflight",
           "read_metrics", "resume_mode", "set_lr", "train", "train_run", "using_threads"]
