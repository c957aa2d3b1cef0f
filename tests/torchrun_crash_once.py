"""``tinylm`` under torchrun, where rank 1 of the first attempt dies (``os._exit``, no
cleanup) as soon as OUT/latest holds step >= $CRASH_AFTER: a worker lost mid-run, for
tests/test_training.py's torchrun --max-restarts test. Not a test module itself."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from tinylm.checkpoint import load_train_state
from tinylm.cli import main


def _die_when_saved(out: Path, step: int) -> None:
    while True:
        try:
            if load_train_state(out / "latest")[1]["step"] >= step:
                os._exit(17)
        except Exception:  # not written yet, or being replaced
            pass
        time.sleep(0.002)


if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])
    threading.Thread(target=_die_when_saved, args=(out_dir, int(os.environ["CRASH_AFTER"])),
                     daemon=True).start()
sys.exit(main(sys.argv[1:]))
