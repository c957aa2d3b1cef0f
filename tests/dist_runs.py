"""Several ``tinylm.training.loop.train`` runs in one torchrun process group, for
tests/test_distributed.py (one launch instead of one per run: torchrun's start-up is the
slow part on a 2-core machine). Not a test module itself.

    torchrun --nproc_per_node N tests/dist_runs.py SPEC.json

SPEC.json: {"data": DIR, "runs": [{"out": DIR, "model": {...}, "train": {...},
"resume": false, "data": DIR (optional, instead of the top-level one)}, ...]}, run in
order by every rank.
"""

from __future__ import annotations

import json
import sys

from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.training import distributed, train


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    ctx = distributed.init_from_env("cpu")
    try:
        for run in spec["runs"]:
            train(ModelConfig(**run["model"]), TrainConfig(**run["train"]),
                  run.get("data", spec["data"]), run["out"], resume=run.get("resume", False),
                  progress=False)
    finally:
        distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
