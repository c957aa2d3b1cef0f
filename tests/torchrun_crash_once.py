"""``tinylm`` under torchrun, where rank 1 of the first attempt dies (``os._exit``, no
cleanup; SIGKILL when $CRASH_SIGKILL is set) as soon as OUT/latest holds step >=
$CRASH_AFTER: a worker lost mid-run, for the torchrun --max-restarts tests of
tests/test_training.py and tests/test_distributed.py. Not a test module itself."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from tinylm.cli import main
from tinylm.io.checkpoint import load_train_state


def _die_when_saved(out: Path, step: int) -> None:
    while True:
        try:
            if load_train_state(out / "latest")[1]["step"] >= step:
                if os.environ.get("CRASH_SIGKILL"):
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(17)
        except Exception:  # not written yet, or being replaced
            pass
        time.sleep(0.002)


if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])
    threading.Thread(target=_die_when_saved, args=(out_dir, int(os.environ["CRASH_AFTER"])),
                     daemon=True).start()
sys.exit(main(sys.argv[1:]))
