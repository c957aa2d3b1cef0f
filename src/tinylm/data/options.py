"""prepare's options, given once: :class:`PrepareOptions`, a frozen dataclass whose
fields are :func:`tinylm.data.pipeline.prepare`'s keyword arguments and whose metadata
declares the ``tinylm prepare`` flag that sets each (``PrepareOptions.flags()``).

Light on purpose (the standard library only): the command line builds its parser from
it on every run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinylm.data.tokenizers import Tokenizer

CHUNK_BYTES = 1 << 20  # bytes read per step of a text file
SHARD_TOKENS = 100_000_000  # default --shard-tokens
#: default --max-record-bytes: a JSONL line (a record) longer than this is a bad record,
#: read in bounded memory and dropped; real records (a book, a long web page) are far
#: smaller, and a line this long takes ~20x its size to parse and tokenize.
MAX_RECORD_BYTES = 16 << 20


def mb_or_all(value: str) -> float | None:
    """``--bpe-train-mb``'s value: a number of MB, or "all" (None: the whole input)."""
    if value == "all":
        return None
    try:
        return float(value)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(
            f"expected a number of MB or 'all', got {value!r}") from None


def _option(default: Any, help: str | None, *flags: str, **argparse_kw: Any) -> Any:
    """A field: its default, the help of its flag (``flags``; none: library only) and the
    rest of ``add_argument``'s keywords."""
    return field(default=default, metadata={"help": help, "flags": flags, "argparse": argparse_kw})


_APPEND = {"action": "append"}
_SWITCH = {"action": "store_true"}


@dataclass(frozen=True)
class PrepareOptions:
    """Every option of :func:`~tinylm.data.pipeline.prepare` (unchecked; prepare checks them).

    corpus          a built-in corpus; with neither inputs nor a corpus, python-docs
    tokenizer       "char" (alphabet from the input), "bpe" (trained, ``vocab_size``),
                    a path to an existing tokenizer (tokenizer.json, a folder, or
                    GPT-2's vocab.json + merges.txt), or a Tokenizer object
    val_fraction    this fraction of the documents (every k-th) goes to val; with a
                    single document, the last fraction of its tokens
    val_files       inputs whose documents form val instead (val_fraction is unused)
    context_length  C the data is meant for: each split must hold at least C + 1 tokens
    unknown         char tokenizer policy for unseen characters later ("replace" adds <unk>)
    errors          "strict" stops at invalid UTF-8 or NUL bytes; "replace" substitutes U+FFFD
    glob            the files to take from an input folder
    force           overwrite a folder that holds a different dataset or other files
    progress        progress bars (None: on a terminal)
    bpe_train_mb    train BPE on at most this many MB, taken evenly along the input
                    (None: all of it)
    chunk_bytes     bytes read per step of a text file
    text_field      the records' text field; dotted for nested fields ("meta.text")
    skip_bad        skip records whose text field is missing, null or not a string, or
                    over max_record_bytes (counted in meta.json) instead of refusing the
                    input
    max_record_bytes  a JSONL line (text or chat record) longer than this many bytes is
                    a bad record, never read whole into memory
    doc_separator   between documents: None = the tokenizer's end-of-text token (a line
                    break if it has none), "" = nothing, a special token, or any text
    dedup           drop exact duplicate documents (by hash; memory grows ~100 B per doc)
    shard_tokens    at most this many tokens per shard file
    workers         encoding processes (None: the free cores for inputs over 16 MB, else 1);
                    the output is the same for any number
    special_tokens  special tokens after the standard ones a char/bpe tokenizer gets
    allow_special   a special token's spelling in the text (e.g. "<|endoftext|>") becomes
                    that special id; by default it is ordinary text, as every user text is

    The fields come in the order ``tinylm prepare --help`` lists their flags.
    """

    corpus: str | None = _option(
        None, "a built-in corpus (default: python-docs, when no --input is given)",
        "--corpus", metavar="NAME")
    text_field: str = _option(
        "text", "the records' text field in JSONL/Parquet/datasets inputs; dotted for nested "
        "fields, e.g. meta.text (default: text)", "--text-field", metavar="NAME")
    skip_bad: bool = _option(
        False, "skip records whose text field is missing, null or not a string, or that are "
        "longer than --max-record-bytes (counted and reported) instead of refusing the input; "
        "with --chat: bad conversation records, named by file and line", "--skip-bad",
        **_SWITCH)
    max_record_bytes: int = _option(
        MAX_RECORD_BYTES, "a JSONL line (a record, or a conversation with --chat) longer than "
        "N bytes is a bad record: read in bounded memory, then refused or, with --skip-bad, "
        f"skipped and counted (default: {MAX_RECORD_BYTES:,} = 16 MiB)", "--max-record-bytes",
        type=int, metavar="N")
    val_fraction: float = _option(
        0.1, "fraction of the documents held out for validation, whole and spread evenly; a "
        "single document splits by tokens (default: 0.1)", "--val-fraction", type=float,
        metavar="F")
    val_files: Sequence[str | Path] = _option(
        (), "validation documents from these inputs instead (repeatable)", "--val-files",
        metavar="FILE|DIR|GLOB", **_APPEND)
    context_length: int = _option(
        256, "context length the data is for: each split needs at least C + 1 tokens "
        "(default: 256)", "--context-length", type=int, metavar="C")
    doc_separator: str | None = _option(
        None, "what goes between documents: a special token, any text, or '' for nothing "
        "(default: the tokenizer's end-of-text token, a line break if it has none)",
        "--doc-separator", metavar="TEXT")
    dedup: bool = _option(
        False, "drop exact duplicate documents (by hash), counted in meta.json", "--dedup",
        **_SWITCH)
    shard_tokens: int = _option(
        SHARD_TOKENS, f"at most N tokens per shard file (default: {SHARD_TOKENS})",
        "--shard-tokens", type=int, metavar="N")
    workers: int | None = _option(
        None, "CPU cores to use: encoding processes; the output is the same for any N "
        "(default: the free cores, as for --threads elsewhere, for inputs over 16 MB, else 1)",
        "--workers", "--threads", type=int, metavar="N")
    errors: str = _option(
        "strict", "invalid UTF-8 or binary input: stop (strict), or replace bad bytes with "
        "U+FFFD and go on (default: strict)", "--errors", choices=("strict", "replace"))
    glob: str = _option(
        "*", "files to take from an input folder (default: * = all non-hidden)", "--glob",
        metavar="PATTERN")
    force: bool = _option(
        False, "overwrite an output folder that holds a different dataset", "--force", **_SWITCH)
    progress: bool | None = _option(
        None, "never show a progress bar", "--no-progress", action="store_const", const=False)
    tokenizer: str | Path | Tokenizer = _option(
        "char", "char (one token per character), bpe (byte-level BPE trained on the input), "
        "or an existing tokenizer.json / folder with vocab.json + merges.txt (default: char)",
        "--tokenizer", metavar="char|bpe|PATH")
    vocab_size: int = _option(
        4096, "BPE vocabulary size, at least 256 + special tokens (default: 4096)",
        "--vocab-size", type=int, metavar="N")
    unknown: str = _option(
        "error", "char tokenizer, later text with unseen characters: error, or replace them "
        "with <unk> (default: error)", "--unknown", choices=("error", "replace"))
    bpe_train_mb: float | None = _option(
        32.0, "train BPE on at most this many MB taken evenly along the input, or all of it; "
        "bounds time and memory on huge corpora (default: 32)", "--bpe-train-mb",
        type=mb_or_all, metavar="MB|all")
    special_tokens: Sequence[str] = _option(
        (), "add a special token after the standard ones every char/bpe tokenizer gets "
        "(<|endoftext|>, <|system|>, <|user|>, <|assistant|>, <|end|>) (repeatable)",
        "--special-token", metavar="TOKEN", **_APPEND)
    allow_special: bool = _option(
        False, "a special token spelled in the text (e.g. <|endoftext|>) becomes that token; "
        "without it, it is ordinary text like any other", "--allow-special", **_SWITCH)
    chunk_bytes: int = _option(CHUNK_BYTES, None)

    @classmethod
    def flags(cls) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
        """``(field, option strings, add_argument keywords)`` for each option a flag of
        ``tinylm prepare`` sets, in field order (the value lands in ``args.<field>``)."""
        out = []
        for f in dataclasses.fields(cls):
            if not f.metadata["flags"]:
                continue
            kw = dict(f.metadata["argparse"], dest=f.name, help=f.metadata["help"])
            kw["default"] = list(f.default) if kw.get("action") == "append" else f.default
            out.append((f.name, f.metadata["flags"], kw))
        return out

    @classmethod
    def from_args(cls, args: Any) -> PrepareOptions:
        """The options the flags of :meth:`flags` parsed into ``args`` (an argparse
        namespace); the library-only ones keep their defaults."""
        return cls(**{name: getattr(args, name) for name, _, _ in cls.flags()})


__all__ = ["CHUNK_BYTES", "MAX_RECORD_BYTES", "SHARD_TOKENS", "PrepareOptions", "mb_or_all"]
