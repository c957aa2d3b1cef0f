"""The reference decoder: prefill a prompt, then one token per row through the KV cache.

:class:`Decoder` is what :mod:`tinylm.use.sampling` runs: ``prefill(ids)`` puts a prompt
(B, T) through the model in one pass, filling the cache, and ``step(ids)`` feeds one
token per row; both return the last position's logits (B, V). It only calls the model's
own forward and changes nothing in the model. The decoding plans of
:mod:`tinylm.native.decoding` (a fused native step, or a native cache) are subclasses
with the same interface, chosen by ``tinylm.native.plan(model).decoder(B)``, and are
proven equal to this one in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        return self.extend(ids)

    def extend(self, ids: Tensor) -> Tensor:
        """Continue the cache with ids (B, T) after its filled positions (those of a
        reused prefix: the server's prefix cache); logits of the last position, (B, V)."""
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


class RaggedDecoder:
    """One decoding step of a ragged batch (continuous batching): ``step(ids)`` feeds one
    token to each of the ``cache.rows`` rows in use of a :class:`RaggedKVCache`, each at
    its own position, -> logits (rows, V). This one runs the model's own forward; the
    fused native steps of :mod:`tinylm.native.decoding` are subclasses, chosen by
    ``tinylm.acceleration.plan(model).ragged_decoder(B)``. ``reason`` says why the fast
    step is not used (None where it is)."""

    path = "torch"

    def __init__(self, model: nn.Module, batch_size: int, reason: str | None = None) -> None:
        self.model = model
        self.cache = RaggedKVCache.for_model(model, batch_size)
        self.reason = reason

    def step(self, ids: Tensor) -> Tensor:
        """ids (rows,) -> logits (rows, V); every row's cache must have room for one."""
        return self.model(ids.unsqueeze(1), self.cache)[:, -1]  # (rows, 1) -> (rows, V)


# --- the KV cache -----------------------------------------------------------------------


class KVCache:
    """Preallocated keys and values of every layer, for incremental decoding.

    Holds k, v of shape (L, B, H_kv, max_len, D) (H_kv = H but for grouped-query
    attention; keys are stored after RoPE's rotation, as each was at its position).
    ``length`` is how many positions are filled; a forward pass over C new tokens
    writes positions [length, length + C) in each layer (:meth:`update`) and then the
    model calls :meth:`advance`. The cache is
    an object passed into ``GPT.forward`` — the model itself keeps no hidden state.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        # Uninitialised: only positions [0, length) are ever read (update returns them).
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_len: int | None = None,
                  **kwargs) -> KVCache:
        """A cache sized for ``model`` (a GPT); max_len defaults to its context length.
        It holds the model's n_kv_head key/value heads, so grouped-query attention
        shrinks it by n_head / n_kv_head."""
        cfg = model.config
        param = next(model.parameters())
        kwargs.setdefault("device", param.device)
        kwargs.setdefault("dtype", param.dtype)
        return cls(cfg.n_layer, batch_size, cfg.n_kv_head, max_len or cfg.context_length,
                   cfg.head_dim, **kwargs)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H, C, D) at positions [length, length + C) of ``layer``.

        Returns views of all filled keys and values, (B, H, length + C, D).
        """
        self.check_room(k.shape[2])
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def check_room(self, n: int) -> None:
        """Raise ValueError unless n more positions fit after the filled ones."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length + n} positions > max_len "
                             f"{self.max_len}; restart it (reset) on a shorter window")

    def attends(self, C: int) -> bool:
        """Whether :meth:`attend` takes a forward of C new tokens per row; the model
        otherwise writes them with :meth:`update` and masks itself. This cache attends
        one new token (C = 1) only."""
        return C == 1

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One new token (C = 1): store its k, v (B, H_kv, 1, D), attend its q (B, H, 1, D)
        over every cached position, -> (B, H, 1, D). The one new query may see all keys,
        so no mask is needed. Subclasses may fuse the two steps (on CPU,
        tinylm.native.decoding.NativeKVCache does it in one native pass)."""
        k, v = self.update(layer, k, v)  # (B, H_kv, T, D)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (called once per forward, after all layers)."""
        self.length += n

    def positions(self, C: int, device: torch.device | str | None = None) -> Tensor:
        """Absolute positions of the next C tokens, (C,): [length, length + C)."""
        return torch.arange(self.length, self.length + C, device=device)

    def reset(self) -> None:
        self.length = 0


class RaggedKVCache(KVCache):
    """A KV cache whose rows have their own lengths, for continuous batching.

    Row b holds ``lengths[b]`` positions; the first ``rows`` rows are in use, and a
    forward over ids (rows, C) gives row b's tokens the positions ``lengths[b] + i``
    (:meth:`positions`), writes their keys and values there and lets query i see only
    keys j <= lengths[b] + i (:meth:`attend`) — exactly what a cache of that row alone
    would compute, with no padding of the cached part. C = 1 is a decoding step; C > 1
    feeds each row a few tokens at once (a speculative draft to verify, padded to the
    longest: a row then keeps only the positions it accepts, :meth:`truncate`). Rows
    are filled from a one-row :class:`KVCache` after a prompt was prefilled
    (:meth:`put`) and freed by moving the last row in use into their place
    (:meth:`remove`), so the rows in use stay the first ``rows``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Zeros, not torch.empty's garbage: a masked key gets weight 0, but 0·NaN in
        # A·V would still be NaN, and rows read past their own length (up to the longest).
        self.k.zero_()
        self.v.zero_()
        self.lengths = torch.zeros(self.k.shape[1], dtype=torch.long, device=self.k.device)
        self.rows = 0

    @property
    def length(self) -> int:
        """The longest row in use (what the base class's checks read)."""
        return int(self.lengths[:self.rows].max()) if self.rows else 0

    @length.setter
    def length(self, value: int) -> None:  # the base __init__ sets 0; nothing else may
        assert value == 0, "a RaggedKVCache's rows have their own lengths"

    def positions(self, C: int, device: torch.device | str | None = None) -> Tensor:
        """Each row's next C positions, (rows, C): lengths[b] + 0 .. C - 1."""
        self.check_room(C)
        steps = torch.arange(C, device=self.lengths.device)
        return (self.lengths[:self.rows, None] + steps).to(device)  # (rows, C)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise ValueError("RaggedKVCache attends its rows' new tokens itself (attend); "
                         "prefill a prompt in a one-row KVCache and put() it")

    def attends(self, C: int) -> bool:
        return True

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (rows, H, C, D), k, v (rows, H_kv, C, D): write row b's k, v at positions
        lengths[b] + i, let its query i attend over its keys j <= lengths[b] + i;
        -> (rows, H, C, D)."""
        n, C = q.shape[0], q.shape[2]
        assert n == self.rows, f"a step must feed every row in use ({self.rows}), got {n}"
        pos = self.lengths[:n, None] + torch.arange(C, device=self.lengths.device)  # (rows, C)
        idx = torch.arange(n, device=pos.device)[:, None]  # (rows, 1)
        self.k[layer][idx, :, pos] = k.transpose(1, 2)  # (rows, C, H_kv, D) at own positions
        self.v[layer][idx, :, pos] = v.transpose(1, 2)
        T = int(pos.max()) + 1
        keys = torch.arange(T, device=pos.device)  # (T,)
        mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # (rows, 1, C, T)
        return F.scaled_dot_product_attention(q, self.k[layer, :n, :, :T],
                                              self.v[layer, :n, :, :T], attn_mask=mask,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def advance(self, n: int) -> None:
        self.lengths[:self.rows] += n

    def truncate(self, row: int, length: int) -> None:
        """Keep ``row``'s first ``length`` positions (a rejected draft's keys and values
        stay behind its length, masked, until overwritten)."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"row {row} holds {int(self.lengths[row])} positions; cannot "
                             f"keep {length}")
        self.lengths[row] = length

    def put(self, row: int, cache: KVCache) -> None:
        """Fill ``row`` with the one-row ``cache`` (a prefilled prompt)."""
        n = cache.length
        if n > self.max_len:
            raise ValueError(f"{n} cached positions do not fit max_len {self.max_len}")
        self.k[:, row, :, :n] = cache.k[:, 0, :, :n]
        self.v[:, row, :, :n] = cache.v[:, 0, :, :n]
        self.lengths[row] = n

    def remove(self, row: int) -> None:
        """Free ``row``: the last row in use moves into its place (rows shrinks by one)."""
        last = self.rows - 1
        if row != last:
            n = int(self.lengths[last])
            self.k[:, row, :, :n] = self.k[:, last, :, :n]
            self.v[:, row, :, :n] = self.v[:, last, :, :n]
            self.lengths[row] = n
        self.lengths[last] = 0
        self.rows = last

    def reset(self) -> None:
        self.lengths.zero_()
        self.rows = 0
