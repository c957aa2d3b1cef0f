"""Configuration as frozen, validated dataclasses.

Configs are checked on construction so a bad value fails early with a message that
names the field and the fix. They travel as JSON inside checkpoints (never pickle)
and can be read from TOML files by the CLI.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

from tinylm.errors import ConfigError


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_fraction(name: str, value: Any, *, low: float = 0.0, high: float = 1.0,
                    high_open: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bracket = ")" if high_open else "]"
        raise ConfigError(f"{name} must be a number in [{low}, {high}{bracket}, got {value!r}")


class _JSONMixin:
    """to_dict/from_dict/JSON for frozen dataclasses, rejecting unknown keys."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} field(s) {', '.join(unknown)}; "
                f"known fields are {', '.join(sorted(known))}"
            )
        return cls(**data)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ModelConfig(_JSONMixin):
    """Shape of a GPT model, in the seed's letters.

    vocab_size      V, rows of the token embedding and columns of the LM head
    context_length  C, the longest sequence the positional embedding covers
    n_layer         number of stacked Attention+FFN blocks
    n_head          H, attention heads per block
    n_embd          E, the embedding (residual stream) width
    head_dim        D, query/key/value width per head; defaults to E // H
    dropout         dropout probability used in training
    bias            biases in Linear layers and LayerNorms (GPT-2 has them)
    tie_embeddings  the LM head shares the token embedding matrix (GPT-2 does)
    layer_norm_eps  LayerNorm epsilon (GPT-2 uses 1e-5)
    """

    vocab_size: int = 50257
    context_length: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    head_dim: int | None = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size)
        _check_int("context_length", self.context_length)
        _check_int("n_layer", self.n_layer)
        _check_int("n_head", self.n_head)
        _check_int("n_embd", self.n_embd)
        if self.head_dim is None:
            if self.n_embd % self.n_head != 0:
                raise ConfigError(
                    f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}, so the "
                    f"default head_dim (n_embd // n_head) does not fit; choose n_head dividing "
                    f"n_embd or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        else:
            _check_int("head_dim", self.head_dim)
        _check_fraction("dropout", self.dropout)
        if not isinstance(self.bias, bool):
            raise ConfigError(f"bias must be true or false, got {self.bias!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ConfigError(
                f"layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}"
            )

    @property
    def inner_dim(self) -> int:
        """H·D, the width of the concatenated heads."""
        return self.n_head * self.head_dim  # type: ignore[operator]

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the feed-forward network (4·E, as in GPT-2)."""
        return 4 * self.n_embd


def resolve_device(name: str | None = "auto"):
    """The torch device for ``name``: "auto" picks cuda > mps > cpu; others are checked."""
    import torch

    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {name!r} requested but MPS is not available; use --device cpu")
    return device
