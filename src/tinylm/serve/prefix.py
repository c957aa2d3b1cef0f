"""Prefix reuse: the keys and values of prompt prefixes, kept by blocks of tokens.

As vLLM's automatic prefix caching: a prompt is cut into blocks of ``block`` tokens
(16); block i's key is a hash chain — the digest of block i - 1's key and block i's
token ids — so a block is found only after the very same whole prefix (at the same
positions: keys are cached after their position's rotation or embedding). Its value is
that block's keys and values in every layer, (L, H_kv, block, D) each, cloned out of a
prefilled one-row :class:`~tinylm.core.decoding.KVCache`.

:meth:`PrefixCache.prefill` is what the engine calls instead of a plain prefill: the
longest run of cached whole blocks that is shorter than the prompt (one token at least
must still go through the model, for the logits of the last position) is copied into
the one-row cache, the rest of the prompt runs through the model's own forward after
those cached positions, and the prompt's whole blocks not yet held are added. Memory is
bounded by ``budget`` bytes: the least recently used blocks go first. A chain is
touched last block first, so within a prefix its tail is evicted before its head (a
head is never dropped while its tail, unreachable without it, stays).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinylm.core.decoding import Decoder, KVCache

BLOCK = 16  # tokens per block, as vLLM's default


@dataclass
class _Block:
    """One cached block: its own token ids (checked on a hit) and keys, values
    (L, H_kv, block, D)."""

    tokens: tuple[int, ...]
    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def chain_keys(tokens: Sequence[int], block: int) -> list[bytes]:
    """The hash-chain key of each whole block of ``tokens``: key_i = blake2b(key_{i-1}
    + block i's ids as 8-byte integers), key_{-1} empty."""
    keys, prev = [], b""
    for start in range(0, len(tokens) - block + 1, block):
        ids = tokens[start:start + block]
        data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Blocks of prompt keys and values under a byte ``budget``, least recently used
    evicted first. Counters: ``hits`` (prefills that reused at least one block),
    ``misses``, ``tokens_reused``, and ``nbytes`` held."""

    def __init__(self, budget: int, block: int = BLOCK) -> None:
        if budget <= 0 or block <= 0:
            raise ValueError(f"a prefix cache needs a positive budget and block, got "
                             f"{budget} bytes and {block} tokens")
        self.budget, self.block = budget, block
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, tokens: Sequence[int]) -> list[_Block]:
        """The cached blocks of the longest run of whole blocks of ``tokens`` that is
        shorter than ``tokens`` (at least one token is left to prefill)."""
        keys = chain_keys(tokens[:len(tokens) - 1], self.block)
        found = []
        for i, key in enumerate(keys):
            entry = self.blocks.get(key)
            start = i * self.block
            if entry is None or entry.tokens != tuple(tokens[start:start + self.block]):
                break
            found.append(entry)
        self._touch(keys[:len(found)])
        return found

    def insert(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Add the whole blocks of ``tokens`` not yet held, from ``cache`` (one row whose
        positions [0, len(tokens)) are these tokens'), then evict down to the budget."""
        keys = chain_keys(tokens, self.block)
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            span = slice(i * self.block, (i + 1) * self.block)
            entry = _Block(tuple(int(t) for t in tokens[span]),
                           cache.k[:, 0, :, span].clone(), cache.v[:, 0, :, span].clone())
            self.blocks[key] = entry
            self.nbytes += entry.nbytes
        self._touch(keys)
        while self.nbytes > self.budget and self.blocks:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes

    def _touch(self, keys: list[bytes]) -> None:
        """Mark a chain's blocks most recently used, its first block most of all."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def prefill(self, model: nn.Module, tokens: Sequence[int], max_len: int,
                decoder: Decoder | None = None) -> tuple[Tensor, KVCache]:
        """``tokens`` (T,) through ``model`` in a one-row cache of ``max_len``, their
        cached prefix copied rather than computed: (logits of the last position (V,),
        the filled cache). ``decoder`` (a one-row decoding plan, its cache of ``max_len``)
        runs the rest as ``tinylm.generate``'s prefill would (``Decoder.extend``); by
        default the model's own forward."""
        if decoder is None:
            decoder = Decoder(model, 1, KVCache.for_model(model, 1, max_len))
        cache = decoder.cache
        cache.reset()
        found = self.lookup(tokens)
        for i, entry in enumerate(found):
            span = slice(i * self.block, (i + 1) * self.block)
            cache.k[:, 0, :, span] = entry.k
            cache.v[:, 0, :, span] = entry.v
        n = len(found) * self.block
        cache.advance(n)
        self.hits += bool(found)
        self.misses += not found
        self.tokens_reused += n
        ids = torch.tensor([list(tokens[n:])], dtype=torch.long)  # (1, T - n)
        logits = decoder.extend(ids)[0]  # (V,), after the n cached positions
        self.insert(tokens, cache)
        return logits, cache
