"""One ``prepare`` run decided before anything is read: :class:`Plan`.

:func:`make_plan` checks :class:`~tinylm.data.options.PrepareOptions` (one-line
``DataError`` for each bad value), completes them (the default corpus, the standard
special tokens), opens a given tokenizer, and writes down the settings a later run into
the same folder must match (meta.json keeps them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.core.errors import DataError
from tinylm.data.corpora import corpus_names
from tinylm.data.options import MAX_RECORD_BYTES, SHARD_TOKENS, PrepareOptions
from tinylm.data.readers import display_path
from tinylm.data.tokenizer_files import load_tokenizer
from tinylm.data.tokenizers import Tokenizer, standard_special_tokens

DEFAULT_CORPUS = "python-docs"  # with neither inputs nor a corpus


@dataclass(frozen=True)
class Plan:
    """A run: the output folder, the inputs, the options (checked; the corpus and the
    special tokens completed), the tokenizer to build ("char", "bpe") or use (``given``),
    and ``settings``: what a re-run into ``out`` must match."""

    out: Path
    inputs: list[str | Path]
    opts: PrepareOptions
    tok_spec: str  # "char", "bpe", "given" (a Tokenizer object) or the path it came from
    given: Tokenizer | None
    settings: dict[str, Any]

    @property
    def builds_tokenizer(self) -> bool:
        """Whether pass 1 builds the tokenizer from the input (char, bpe)."""
        return self.tok_spec in ("char", "bpe")


def make_plan(out_dir: str | Path, inputs: Sequence[str | Path] | None,
              opts: PrepareOptions) -> Plan:
    """The run ``prepare(out_dir, inputs, **opts)`` asks for, checked."""
    inputs = list(inputs or [])
    given = opts.tokenizer if isinstance(opts.tokenizer, Tokenizer) else None
    opts = dataclasses.replace(
        opts, val_files=list(opts.val_files or []),
        corpus=opts.corpus or (None if inputs else DEFAULT_CORPUS),
        special_tokens=standard_special_tokens(opts.special_tokens))
    tok_spec = "given" if given is not None else str(opts.tokenizer)
    _check(opts, inputs, tok_spec)
    if tok_spec not in ("char", "bpe") and given is None:
        given = load_tokenizer(tok_spec)
    settings = {
        "source": f"corpus:{opts.corpus}" if opts.corpus else _describe(inputs),
        "tokenizer": _tokenizer_settings(opts, tok_spec, given), "val_fraction": opts.val_fraction,
        "errors": opts.errors, "text_field": opts.text_field, "skip_bad": opts.skip_bad,
        "doc_separator": opts.doc_separator, "dedup": opts.dedup,
        "shard_tokens": opts.shard_tokens,
        "val_files": _describe(opts.val_files) if opts.val_files else None,
        **({"allow_special": True} if opts.allow_special else {}),
        # another cap skips other records; the default is left out, so folders prepared
        # before the cap existed still match
        **({"max_record_bytes": opts.max_record_bytes}
           if opts.max_record_bytes != MAX_RECORD_BYTES else {}),
    }
    return Plan(Path(out_dir), inputs, opts, tok_spec, given, settings)


def _tokenizer_settings(o: PrepareOptions, tok_spec: str, given: Tokenizer | None
                        ) -> dict[str, Any]:
    if tok_spec == "char":
        return {"kind": "char", "unknown": o.unknown, "special_tokens": o.special_tokens}
    if tok_spec == "bpe":
        return {"kind": "bpe", "vocab_size": o.vocab_size, "special_tokens": o.special_tokens,
                "train_mb": o.bpe_train_mb}
    assert given is not None
    where = "object" if tok_spec == "given" else display_path(Path(tok_spec).resolve())
    digest = hashlib.sha256(json.dumps(given.to_hf_json(), sort_keys=True).encode())
    return {"kind": given.kind, "path": where, "sha256": digest.hexdigest()}


def _describe(inputs: Sequence[str | Path]) -> str:
    return ", ".join(display_path(Path(x).resolve()) if str(x) != "-" else "-" for x in inputs)


def _positive_int(value: Any, what: str, hint: str) -> None:
    # Not tinylm.core.checks.check_int: its "must be an integer >= 1" would change these
    # messages, which tests and users read as "must be a positive integer".
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{what} must be a positive integer, got {value!r}; {hint}")


def _check(o: PrepareOptions, inputs: list[str | Path], tok_spec: str) -> None:
    if not isinstance(o.val_fraction, (int, float)) or not 0 < o.val_fraction < 1:
        raise DataError(f"val fraction must be between 0 and 1 (exclusive), got "
                        f"{o.val_fraction!r}; the default is 0.1")
    _positive_int(o.context_length, "context length", "the default is 256")
    _positive_int(o.shard_tokens, "--shard-tokens", f"the default is {SHARD_TOKENS:,}")
    _positive_int(o.max_record_bytes, "--max-record-bytes",
                  f"the default is {MAX_RECORD_BYTES:,}")
    if o.workers is not None:
        _positive_int(o.workers, "--workers", "omit it to use every core")
    if o.unknown not in ("error", "replace"):
        raise DataError(f"--unknown must be error or replace, got {o.unknown!r}")
    if o.errors not in ("strict", "replace"):
        raise DataError(f"--errors must be strict or replace, got {o.errors!r}")
    if tok_spec == "bpe":
        _check_bpe_vocab(o.vocab_size, len(o.special_tokens))
    if o.bpe_train_mb is not None and not (isinstance(o.bpe_train_mb, (int, float))
                                           and o.bpe_train_mb > 0):
        raise DataError(f"BPE training size must be a positive number of MB, got "
                        f"{o.bpe_train_mb!r}")
    if inputs and o.corpus:
        raise DataError("pass either inputs or a corpus, not both")
    if o.val_files and not inputs:
        raise DataError("--val-files needs --input for the training documents")
    if not inputs and o.corpus not in corpus_names():
        raise DataError(f"unknown corpus {o.corpus!r}; built-in corpora: "
                        f"{', '.join(corpus_names())}")


def _check_bpe_vocab(vocab_size: Any, specials: int) -> None:
    minimum = 256 + specials
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise DataError(
            f"vocab size {vocab_size!r} is too small for byte-level BPE: it needs the "
            f"256 byte tokens plus {specials} special token(s), so at least "
            f"{minimum}; use --vocab-size {max(minimum, 512)} or more (default 4096)"
        )


__all__ = ["Plan", "make_plan"]
