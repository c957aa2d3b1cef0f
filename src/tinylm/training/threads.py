"""torch's intra-op threads for a block or a whole ``tinylm`` command."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tinylm.core.config import default_threads


@contextlib.contextmanager
def using_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block (None: left as they are)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)


def command_threads(n: int | None) -> contextlib.AbstractContextManager[None]:
    """What a ``tinylm`` command runs under: ``n`` threads, or
    :func:`tinylm.core.config.default_threads` (the free cores) when ``n`` is None."""
    return using_threads(n if n is not None else default_threads())

