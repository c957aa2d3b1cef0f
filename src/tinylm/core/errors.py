"""Errors a user can cause.

Every error that bad input can trigger is a :class:`TinyLMError` whose message says
what happened, the offending value, and how to fix it. ``tinylm.cli.main`` prints
that one line and exits with status 2; ``assert`` is kept for internal invariants.
"""

from __future__ import annotations


class TinyLMError(Exception):
    """Base class: a user-facing problem with a one-line, actionable message."""


class ConfigError(TinyLMError):
    """A configuration value is invalid (names the field and the fix)."""


class DataError(TinyLMError):
    """Input text, a tokenizer or a prepared dataset is missing or unusable."""


class CheckpointError(TinyLMError):
    """A checkpoint folder is missing, incomplete, corrupt or mismatched."""


class NonFiniteError(CheckpointError):
    """A model's outputs are NaN or infinite at run time (weights that overflow float32 or
    were loaded with --allow-nonfinite): the model's fault, not the request's (a server
    answers 500)."""
