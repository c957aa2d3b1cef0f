"""Which layers a command replaces: one rule for ``compress``, ``quantize`` and LoRA.

A *pattern* names a module by its full name (``blocks.0.attn.qkv``: one layer) or by a
suffix after a dot (``ffn.up``: every block's up-projection). The candidates are the
modules whose type is exactly one of ``take`` (a plain ``nn.Linear`` by default; a
subclass is somebody else's replaced layer), never the LM head (usually tied to the
token embedding; ``tinylm quantize --include-head`` adds it itself). The result is in
model order, each layer once.

What differs between the commands is a parameter here, not a second rule:

- ``take``: compress also takes its own ``LowRankLinear`` (a compressed model can be
  compressed again); LoRA takes every module (``take=None``) and refuses a replaced one
  itself, with its own message.
- ``patterns=None`` selects every candidate inside the blocks (quantize's default).
- ``optional``: patterns that may select nothing when several are given -- compress's
  default kinds, since ``ffn.gate`` exists only in a gated (SwiGLU) MLP.
- ``empty``: the end of the error for a model with no candidate at all (compress says
  "the model has no linear layers to compress"); without it the error lists the
  candidates' kinds (none) and an example full name.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from tinylm.core.errors import ConfigError


def _is_head(name: str) -> bool:
    return name.split(".", 1)[0] == "lm_head"


def candidates(model: nn.Module, take: tuple[type, ...] | None = (nn.Linear,)
               ) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module whose type is one of ``take`` (None: any module),
    the LM head excepted, in model order."""
    return [(n, m) for n, m in model.named_modules()
            if n and not _is_head(n) and (take is None or type(m) in take)]


def matches(name: str, pattern: str) -> bool:
    """True when ``pattern`` names the module ``name``: its full name or a dotted suffix."""
    return bool(pattern) and (name == pattern or name.endswith("." + pattern))


def _unknown(pattern: str, linear: list[tuple[str, nn.Module]], empty: str | None
             ) -> ConfigError:
    if not linear and empty is not None:
        return ConfigError(f"unknown layer name {pattern!r}: {empty}")
    kinds = sorted({n.split(".", 2)[-1] for n, _ in linear})
    example = linear[0][0] if linear else "blocks.0.attn.qkv"
    return ConfigError(f"unknown layer name {pattern!r}; choose from {', '.join(kinds)} "
                       f"(or a full name like {example})")


def select_layers(model: nn.Module, patterns: str | Sequence[str] | None = None, *,
                  take: tuple[type, ...] | None = (nn.Linear,),
                  optional: Collection[str] = (), empty: str | None = None
                  ) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``patterns`` select, in model order, each once (see the
    module docstring for the rule and its parameters). A pattern that selects nothing is
    a :class:`~tinylm.core.errors.ConfigError` naming the kinds there are."""
    found = candidates(model, take)
    if patterns is None:
        return [(n, m) for n, m in found if n.startswith("blocks.")]
    if isinstance(patterns, str):
        patterns = [patterns]
    names: set[str] = set()
    for pattern in (p.strip() for p in patterns):
        hits = [n for n, _ in found if matches(n, pattern)]
        if not hits and pattern in optional and len(patterns) > 1:
            continue  # a kind this architecture lacks (ffn.gate without SwiGLU)
        if not hits:
            raise _unknown(pattern, found, empty)
        names.update(hits)
    return [(n, m) for n, m in found if n in names]


__all__ = ["candidates", "matches", "select_layers"]
