"""The layers the commands replace by default, in a module that imports nothing heavy:
the commands run these names and their ``--help`` shows them, both from here."""

from __future__ import annotations

#: The layers ``tinylm compress`` factorises by default (patterns for
#: :func:`tinylm.layers.selection.select_layers`); ffn.gate exists only in a gated
#: (SwiGLU) MLP, and a default kind the model lacks is skipped.
DEFAULT_LAYERS: tuple[str, ...] = ("attn.qkv", "attn.out", "ffn.gate", "ffn.up", "ffn.down")

#: The layers LoRA adapts by default (short names of :data:`tinylm.layers.lora.TARGETS`).
DEFAULT_TARGETS: tuple[str, ...] = ("qkv", "out", "up", "down")
