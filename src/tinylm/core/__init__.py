"""The core: the reference model and what it is made of.

``errors`` (TinyLMError and its kinds) and ``config`` (frozen, validated configs) are the
leaves; ``attention`` and ``model`` are the note's math, top to bottom; ``decoding`` is the
reference decoder and its KV caches. Nothing here imports another room of tinylm.
"""
