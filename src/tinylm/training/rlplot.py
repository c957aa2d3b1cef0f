"""OUT/loss.png of a ``tinylm rl`` run: the reward curve (train mean reward per step,
held-out greedy pass@1 and mean reward at each evaluation) over the policy loss."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinylm.core.errors import TinyLMError
from tinylm.training.runlog import PLOT_FILE
from tinylm.use.plotting import legend_outside, new_figure, save_figure

log = logging.getLogger(__name__)


def _series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def plot_rl(records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Draw OUT/loss.png; a missing matplotlib only costs the picture (said once)."""
    try:
        fig = new_figure(8, 6)
        top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for key, label, style in (("reward_mean", "train reward (mean)", "-"),
                                  ("heldout_pass1", "held-out pass@1 (greedy)", "o-"),
                                  ("heldout_reward", "held-out reward (greedy)", "s--")):
            points = _series(records, key)
            if points:
                top.plot(*zip(*points, strict=True), style, ms=3, lw=1, label=label)
        top.set_ylabel("reward")
        top.grid(True, alpha=0.3)
        legend_outside(top, fontsize=8)
        loss = _series(records, "loss")
        if loss:
            bottom.plot(*zip(*loss, strict=True), lw=1, color="C3", label="policy loss")
        bottom.set_xlabel("step")
        bottom.set_ylabel("loss")
        bottom.grid(True, alpha=0.3)
        return save_figure(fig, out / PLOT_FILE, bbox_inches="tight")
    except TinyLMError as exc:
        log.warning("loss.png not drawn: %s", exc)
        return None
