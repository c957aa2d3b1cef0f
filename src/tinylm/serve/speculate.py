"""Prompt-lookup decoding: draft tokens proposed from the sequence's own n-grams.

As Hugging Face's ``prompt_lookup_num_tokens`` and llama.cpp's lookup decoding: when the
last n tokens of a sequence (prompt + output so far; n from ``max_ngram`` = 3 down to 1)
occurred before in it, the tokens that followed that earlier occurrence (the most recent
one) are proposed as the next ones, up to ``k`` of them. The engine feeds a row its last
token and the draft in one forward, keeps the longest prefix of the draft that equals the
model's own greedy choices, plus the model's next token after it — so greedy output is
what plain decoding gives, in fewer forwards when drafts are accepted. Text that quotes
or summarises its prompt (code edits, extraction, retrieval answers) repeats long runs
of it; free text seldom does, and a rejected draft costs the wider forward.

:class:`NgramLookup` keeps, for every n-gram seen, where the tokens after its latest
occurrence start, updated as the sequence grows: a proposal is a dictionary look-up.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3  # the longest n-gram matched, as llama.cpp's and HF's lookups (3, then 2, 1)
DRAFT_TOKENS = 8  # --draft-tokens' default: a few tokens, cheap to verify in one forward


class NgramLookup:
    """Where each n-gram (n <= ``max_ngram``) of a growing sequence was last followed.

    :meth:`sync` reads the tokens added since the last call; :meth:`propose` returns up
    to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying the longest n first.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.seen = 0  # tokens of the sequence indexed so far
        self.follow: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed it

    def sync(self, seq: Sequence[int]) -> None:
        """Index the tokens of ``seq`` from position ``seen`` on: each new token p is
        what followed the n-grams ending at p - 1."""
        for p in range(max(self.seen, 1), len(seq)):
            for n in range(1, min(self.max_ngram, p) + 1):
                self.follow[tuple(seq[p - n:p])] = p
        self.seen = len(seq)

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens after ``seq`` (synced first), [] when none of its last
        n-grams occurred before."""
        self.sync(seq)
        if k <= 0:
            return []
        T = len(seq)
        for n in range(min(self.max_ngram, T - 1), 0, -1):
            start = self.follow.get(tuple(seq[T - n:]))
            if start is not None:
                return list(seq[start:start + k])
        return []

