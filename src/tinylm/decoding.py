"""The reference decoder: prefill a prompt, then one token per row through the KV cache.

:class:`Decoder` is what :mod:`tinylm.sampling` runs: ``prefill(ids)`` puts a prompt
(B, T) through the model in one pass, filling the cache, and ``step(ids)`` feeds one
token per row; both return the last position's logits (B, V). It only calls the model's
own forward and changes nothing in the model. The decoding plans of
:mod:`tinylm.native.decoding` (a fused native step, or a native cache) are subclasses
with the same interface, chosen by ``tinylm.native.plan(model).decoder(B)``, and are
proven equal to this one in the tests.
"""

from __future__ import annotations

from torch import Tensor, nn

from tinylm.attention import KVCache


class Decoder:
    """Prefill and one-token steps of ``model`` for ``batch_size`` rows, through a
    :class:`KVCache` sized for its context (or the given ``cache``)."""

    path = "torch"

    def __init__(self, model: nn.Module, batch_size: int, cache: KVCache | None = None) -> None:
        self.model = model
        self.cache = cache if cache is not None else KVCache.for_model(model, batch_size)

    def prefill(self, ids: Tensor) -> Tensor:
        """Restart the cache on ids (B, T), T <= context length; logits of the last
        position, (B, V). Only the last row goes through the LM head."""
        self.cache.reset()
        h = self.model.hidden_states(ids, self.cache)  # (B, T, E)
        return self.model.lm_head(h[:, -1])  # (B, E) -> (B, V)

    def step(self, ids: Tensor) -> Tensor:
        """Next token of every row, ids (B,) -> logits (B, V); the cache must have room."""
        self.cache.check_room(1)
        return self.model(ids.unsqueeze(1), self.cache)[:, -1]  # (B, 1) -> (B, V)

    def argmax(self, logits: Tensor) -> Tensor:
        """Greedy choice over logits (B, V) -> (B,): the first index of each row's maximum."""
        return logits.argmax(-1)

    def close(self) -> None:
        """Release the plan's resources (the reference decoder holds none but its cache)."""

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
