"""The run folder: creating and checking it, finding the run a call continues, and the
configuration layering of ``tinylm train``.

:func:`preflight` fails before training when OUT cannot hold the checkpoints;
:func:`find_run` makes the restore decision once (what an earlier run left, whether
this call continues it, and that the model config matches the saved one);
:func:`layer_configs` layers defaults, an architecture preset, the saved run, a TOML
file and flags. The lock itself is :class:`tinylm.io.files.FolderLock`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tinylm.core.config import ModelConfig, TrainConfig, read_toml, resolve_arch
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.io.checkpoint import load_train_state, read_config
from tinylm.io.checkpoint_files import (
    CONFIG_FILE,
    RUN_BEST,
    RUN_LATEST,
    STATE_JSON_FILE,
    is_complete,
    recover_checkpoint,
)
from tinylm.training import distributed
from tinylm.training.runlog import METRICS_FILE, PLOT_FILE

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run.toml"


def prepare_out(out: Path) -> None:
    """Create the run folder; a file in its place or an unwritable parent is one line."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a folder; choose a folder name "
                              f"for the run (nothing was written)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"output folder {out} is not writable ({exc.strerror or exc}); "
                              f"choose another --out") from exc


def preflight(out: Path, n_params: int) -> None:
    """Fail before training when ``out`` cannot hold the run's checkpoints.

    Checks that the folder can be created and written, and that the free space covers
    latest/ (weights + two AdamW moments), best/ and one temporary copy during a save.
    """
    prepare_out(out)
    try:
        probe = out / f".write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"output folder {out} is not writable ({exc.strerror or exc}); "
                              f"choose another --out") from exc
    need = n_params * 4 * (3 + 1 + 3) + (16 << 20)
    free = shutil.disk_usage(out).free
    if free < need:
        raise CheckpointError(f"only {free / 2**20:,.0f} MiB free in {out}, but the run's "
                              f"checkpoints need about {need / 2**20:,.0f} MiB; free disk "
                              f"space or choose another --out")


def _existing_step(latest: Path) -> int | None:
    try:
        return int(json.loads((latest / STATE_JSON_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_model_config(given: ModelConfig, saved: ModelConfig, where: Path) -> None:
    a, b = given.to_dict(), saved.to_dict()
    diff = [k for k in a if a[k] != b[k]]
    if diff:
        pairs = ", ".join(f"{k}={a[k]!r} (saved {b[k]!r})" for k in diff)
        raise ConfigError(f"--resume: the model config differs from the run in {where}: "
                          f"{pairs}; drop those flags or start a new --out")


def resume_mode(resume: bool | str | None) -> bool | str:
    """True, False or "auto"; None means "auto" when torchrun reports a restart
    (TORCHELASTIC_RESTART_COUNT > 0), else False."""
    if resume is None:
        try:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        except ValueError:
            restarts = 0
        return "auto" if restarts > 0 else False
    if resume in (True, False, "auto"):
        return resume
    raise ConfigError(f"resume must be True, False or 'auto', got {resume!r}")


@dataclass(frozen=True)
class Found:
    """What an earlier run left in the run folder (decided once, before building)."""

    resuming: bool
    step: int | None = None
    meta: dict[str, Any] | None = None


def _earlier_traces(out: Path) -> list[str]:
    names = [METRICS_FILE, RUN_CONFIG_FILE, RUN_BEST]
    return [n for n in names if (out / n).exists()]


def find_run(out: Path, resume: bool | str, ctx: distributed.DistContext,
             model_config: ModelConfig) -> Found:
    """The restore decision: what is in ``out`` and whether this call continues it. A
    run to continue must have ``model_config`` (vocab_size aside: the data sets it), the
    one check of the config against the saved run."""
    latest = out / RUN_LATEST
    if ctx.is_main:
        recover_checkpoint(latest)  # an interrupted save's complete copy wins
        recover_checkpoint(out / RUN_BEST)
        _remove_stale_files(out)
    distributed.barrier(ctx)
    step = _existing_step(latest) if latest.is_dir() else None
    if latest.is_dir() and step is None:
        raise CheckpointError(f"{latest} has no readable {STATE_JSON_FILE}; it cannot be "
                              f"resumed — move it away or choose another --out")
    if step is not None and not resume:
        raise CheckpointError(f"{out} already holds a training run (latest checkpoint at "
                              f"step {step}); pass --resume to continue it or choose a new "
                              f"--out")
    traces = _earlier_traces(out)
    if step is None and is_complete(out / RUN_BEST):  # never overwrite an earlier best/
        raise CheckpointError(f"{out} holds best/ of an earlier run but no latest/ checkpoint "
                              f"to resume, and a new run would overwrite best/; use "
                              f"{out / RUN_BEST} where a model is wanted, or choose a new "
                              f"--out")
    if step is None and resume is True:
        found = f"; it holds {', '.join(traces)} of a run stopped before its first save" \
            if traces else ""
        raise CheckpointError(f"--resume: no checkpoint in {out} (looked for {latest}/"
                              f"{STATE_JSON_FILE} and interrupted saves .{RUN_LATEST}.tmp-*/"
                              f".{RUN_LATEST}.old-*){found}; check --out, or drop --resume "
                              f"(or use --resume auto) to start a new run")
    if step is None:
        if traces and ctx.is_main:
            log.info("%s holds %s but no checkpoint (the earlier run stopped before its "
                     "first save); starting a new run", out, ", ".join(traces))
        return Found(False)
    _tensors, meta = load_train_state(latest)
    saved = ModelConfig.from_dict(read_config(latest)["model"])
    _check_model_config(model_config.replace(vocab_size=saved.vocab_size), saved, latest)
    return Found(True, step, meta)


def _remove_stale_files(out: Path) -> None:
    """Temporaries of small writes a killed run left (we hold the lock: none is live)."""
    names = (f".{METRICS_FILE}.tmp-", f".{RUN_CONFIG_FILE}.tmp-", f".{PLOT_FILE}.tmp-",
             ".write-test-")
    for p in out.iterdir():
        if p.name.startswith(names) and p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()


def is_finished(found: Found, cfg: TrainConfig) -> bool:
    """Whether the run being resumed already reached its end under ``cfg``."""
    meta = found.meta or {}
    if found.step is None or meta.get("stop_reason") not in ("max_steps", "time_budget"):
        return False
    if found.step >= cfg.max_steps:
        return True
    return (meta.get("stop_reason") == "time_budget" and cfg.time_budget is not None
            and float(meta.get("elapsed", 0.0)) >= cfg.time_budget)


def layer_configs(out_dir: str | os.PathLike, *, config_file: str | os.PathLike | None = None,
                  overrides: dict[str, Any] | None = None,
                  resume: bool | str | None = False, arch: str | None = None
                  ) -> tuple[ModelConfig, TrainConfig]:
    """The configuration layering rule of ``tinylm train``: defaults, then the ``arch``
    preset (``tinylm.core.config.ARCH_PRESETS``), then the saved run
    (when resuming and OUT/latest exists), then the ``config_file`` TOML, then
    ``overrides`` (flags; a value of None there means "not given"; :data:`UNSET` means
    "switch off", e.g. ``--time-budget 0``). vocab_size always comes from the data."""
    model_kw: dict[str, Any] = resolve_arch(arch, {})  # every later layer overrides it
    train_kw: dict[str, Any] = {}
    latest = Path(out_dir) / RUN_LATEST
    if resume_mode(resume) and Path(out_dir).is_dir():
        recover_checkpoint(latest)
        if (latest / CONFIG_FILE).is_file():
            saved = read_config(latest)
            model_kw.update(saved["model"])
            train_kw.update(saved.get("train", {}))
    if config_file:
        m, t = read_toml(config_file)
        model_kw.update(m)
        train_kw.update(t)
    names = {"model": {f.name for f in fields(ModelConfig)},
             "train": {f.name for f in fields(TrainConfig)}}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        kw = model_kw if key in names["model"] else train_kw
        kw[key] = None if value is UNSET else value
    model_kw.pop("vocab_size", None)
    return ModelConfig.from_dict(model_kw), TrainConfig.from_dict(train_kw)


#: An override meaning "switch this optional setting off" (``--time-budget 0`` / ``none``).
UNSET = object()
