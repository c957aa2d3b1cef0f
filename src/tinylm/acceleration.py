"""Where the uses of a model ask for its fast paths: one door to tinylm.native.

``accelerate(model, device)`` and ``plan(model, device)`` return the native package's
:class:`~tinylm.native.Plan`, or, when that package is absent (deleted, or failing to
import), a :class:`ReferencePlan` with no fast paths: training, sampling and evaluation
then run the reference model, slower and otherwise the same. ``bpe_encoder(tokenizer)``
is the same door for ``prepare``'s byte-level BPE encoding (None: Hugging Face encodes).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from tinylm.core.decoding import Decoder, RaggedDecoder

try:  # the acceleration package is optional by design (see tinylm.native)
    from tinylm import native
except ImportError:  # pragma: no cover - exercised by tests/test_package.py in a subprocess
    native = None

log = logging.getLogger(__name__)


class ReferencePlan:
    """No fast paths: the reference model as it is, and the reference decoder."""

    paths: frozenset[str] = frozenset()

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def apply(self) -> ReferencePlan:
        return self

    def restore(self) -> None:
        pass

    def decoder(self, batch_size: int) -> Decoder:
        return Decoder(self.model, batch_size)

    compiled_path = "reference"

    def compile(self, module: nn.Module) -> nn.Module:
        """``torch.compile(module)``, torch's defaults (its cache folder included)."""
        return torch.compile(module)

    def ragged_decoder(self, batch_size: int) -> RaggedDecoder:
        return RaggedDecoder(self.model, batch_size, "the tinylm.native package is absent")

    def __enter__(self) -> ReferencePlan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def plan(model: nn.Module, device: torch.device | str | None = None):
    """The fast paths ``model`` may take on ``device``, decided, not applied."""
    return native.plan(model, device) if native is not None else ReferencePlan(model)


def accelerate(model: nn.Module, device: torch.device | str | None = None):
    """Decide and apply the fast paths of ``model`` (see :func:`tinylm.native.accelerate`)."""
    return native.accelerate(model, device) if native is not None else ReferencePlan(model)


def bpe_encoder(tokenizer: Any) -> Any:
    """The native encoder of a byte-level BPE tokenizer (:func:`tinylm.native.bpe_encoder`:
    ``encode_lengths(texts) -> (ids, lengths)``, equal to Hugging Face's encoding), or
    None: Hugging Face encodes (ineligible tokenizer, fast paths off, no package)."""
    return native.bpe_encoder(tokenizer) if native is not None else None


def disabled() -> contextlib.AbstractContextManager[None]:
    """Every fast path off within the block (this thread), e.g. for a model whose
    parameters FSDP has sharded (:func:`tinylm.native.disabled`)."""
    return native.disabled() if native is not None else contextlib.nullcontext()
