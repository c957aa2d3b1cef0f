"""Training: the loop, its run folder and log, distributed strategies, fine-tuning.

The room's modules: :mod:`~tinylm.training.loop` (``train``: the phases),
:mod:`~tinylm.training.state` (the run's typed parts), :mod:`~tinylm.training.setup`
(building and restoring), :mod:`~tinylm.training.saving` (OUT/latest),
:mod:`~tinylm.training.optim` (AdamW groups, Muon, the lr schedule),
:mod:`~tinylm.training.runlog` (metrics.jsonl, progress, plots),
:mod:`~tinylm.training.runfolder` (preflight, the resume decision, config layering),
:mod:`~tinylm.training.batches` (the data and its batches),
:mod:`~tinylm.training.threads`, :mod:`~tinylm.training.distributed` and
:mod:`~tinylm.training.finetune`. The names below are the ones outside code uses.
"""

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

__all__ = ["UNSET", "MuonAdamW", "NonFiniteLossError", "TrainData", "TrainResult",
           "build_optimizer", "command_threads", "decay_groups", "layer_configs", "lr_at",
           "newton_schulz", "optimizer_recipe", "plot_losses", "plot_runs", "preflight",
           "read_metrics", "resume_mode", "set_lr", "train", "train_run", "using_threads"]
