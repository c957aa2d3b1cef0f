"""``tinylm prepare``: text, JSONL, Parquet or chat records -> tokenizer + token shards."""

from __future__ import annotations

import argparse


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="text/JSONL/Parquet/datasets -> tokenizer.json + token shards + meta.json",
        description="Tokenize files (text, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, a "
        "datasets save_to_disk folder), folders or globs of them, standard input or a "
        "built-in corpus (default: python-docs, no download) into --out: tokenizer.json, "
        "train-NNNNN.bin and val-NNNNN.bin shards (uint16 when the vocabulary fits, else "
        "uint32) and meta.json. Each record or text file is one document; documents are "
        "joined with the end-of-text token. Streams the input in two passes with flat "
        "memory, encodes on every core, and writes atomically, so an interrupted run "
        "leaves the folder as it was.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", action="append", metavar="FILE|DIR|GLOB|-",
                     help="a text, JSONL or Parquet file, a folder of them (or a datasets "
                     "folder), a quoted glob, or - for stdin (repeatable)")
    src.add_argument("--corpus", metavar="NAME",
                     help="a built-in corpus (default: python-docs, when no --input is given)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the records' text field in JSONL/Parquet/datasets inputs; dotted "
                   "for nested fields, e.g. meta.text (default: text)")
    src.add_argument("--chat", action="append", metavar="FILE.jsonl|DIR|python-qa",
                     help="conversation records for 'tinylm finetune' (repeatable): "
                     "{messages}, {prompt, completion} or {instruction, input, output} lines, "
                     "or python-qa (the built-in instruction set); writes token shards plus "
                     "a loss mask. Use --tokenizer MODEL_DIR (default: char from the text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip records whose text field is missing, null or not a string "
                   "(counted and reported) instead of refusing the input; with --chat: bad "
                   "conversation records, named by file and line")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="fraction of the documents held out for validation, whole and "
                   "spread evenly; a single document splits by tokens (default: 0.1)")
    p.add_argument("--val-files", action="append", default=[], metavar="FILE|DIR|GLOB",
                   help="validation documents from these inputs instead (repeatable)")
    p.add_argument("--context-length", type=int, default=256, metavar="C",
                   help="context length the data is for: each split needs at least C + 1 "
                   "tokens (default: 256)")
    p.add_argument("--doc-separator", default=None, metavar="TEXT",
                   help="what goes between documents: a special token, any text, or '' for "
                   "nothing (default: the tokenizer's end-of-text token, a line break if it "
                   "has none)")
    p.add_argument("--dedup", action="store_true",
                   help="drop exact duplicate documents (by hash), counted in meta.json")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="at most N tokens per shard file (default: 100000000)")
    p.add_argument("--workers", "--threads", type=int, default=None, metavar="N",
                   dest="workers",
                   help="CPU cores to use: encoding processes; the output is the same for "
                   "any N (default: the free cores, as for --threads elsewhere, for inputs "
                   "over 16 MB, else 1)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 or binary input: stop (strict), or replace bad bytes "
                   "with U+FFFD and go on (default: strict)")
    p.add_argument("--glob", default="*", metavar="PATTERN",
                   help="files to take from an input folder (default: * = all non-hidden)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--force", action="store_true",
                   help="overwrite an output folder that holds a different dataset")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    _tokenizer_flags(p)
    p.set_defaults(func=_cmd_prepare)


def _tokenizer_flags(p: argparse.ArgumentParser) -> None:
    """prepare's flags for the tokenizer: which, its size, its special tokens."""
    p.add_argument("--tokenizer", default="char", metavar="char|bpe|PATH",
                   help="char (one token per character), bpe (byte-level BPE trained on "
                   "the input), or an existing tokenizer.json / folder with vocab.json + "
                   "merges.txt (default: char)")
    p.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                   help="BPE vocabulary size, at least 256 + special tokens (default: 4096)")
    p.add_argument("--unknown", choices=("error", "replace"), default="error",
                   help="char tokenizer, later text with unseen characters: error, or "
                   "replace them with <unk> (default: error)")
    p.add_argument("--bpe-train-mb", type=_mb_or_all, default=32.0, metavar="MB|all",
                   help="train BPE on at most this many MB taken evenly along the input, "
                   "or all of it; bounds time and memory on huge corpora (default: 32)")
    p.add_argument("--special-token", action="append", default=[], metavar="TOKEN",
                   dest="special_tokens",
                   help="add a special token after the standard ones every char/bpe "
                   "tokenizer gets (<|endoftext|>, <|system|>, <|user|>, <|assistant|>, "
                   "<|end|>) (repeatable)")
    p.add_argument("--allow-special", action="store_true",
                   help="a special token spelled in the text (e.g. <|endoftext|>) becomes "
                   "that token; without it, it is ordinary text like any other")


def _mb_or_all(value: str) -> float | None:
    if value == "all":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of MB or 'all', got {value!r}") from None


def _cmd_prepare(args: argparse.Namespace) -> int:
    import time

    from tinylm.data.prepare import prepare
    from tinylm.data.readers import display_path

    if args.chat:
        return _cmd_prepare_chat(args)
    start = time.perf_counter()
    data = prepare(
        args.out, args.input, corpus=args.corpus, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, val_fraction=args.val_fraction, val_files=args.val_files,
        context_length=args.context_length, unknown=args.unknown, errors=args.errors,
        special_tokens=args.special_tokens, glob=args.glob,
        force=args.force,
        bpe_train_mb=args.bpe_train_mb, progress=False if args.no_progress else None,
        text_field=args.text_field, skip_bad=args.skip_bad, doc_separator=args.doc_separator,
        dedup=args.dedup, shard_tokens=args.shard_tokens, workers=args.workers,
        allow_special=args.allow_special,
    )
    seconds = time.perf_counter() - start
    meta = data.meta
    mb = meta["input_bytes"] / 1e6
    docs = meta["documents"]
    extra = "".join(f", {n:,} {what}" for what, n in (
        ("duplicates removed", docs["duplicates_removed"]),
        ("bad records skipped", docs["skipped_records"])) if n)
    shards = sum(len(v) for v in meta["shards"].values())
    print(f"prepared {display_path(data.dir)}: {meta['train_tokens']:,} train + "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}, {shards} shard(s)) from "
          f"{docs['train']:,} + {docs['val']:,} documents{extra}, {data.tokenizer.kind} "
          f"tokenizer with {data.vocab_size:,} tokens, from {meta['source']} ({mb:.2f} MB) in "
          f"{seconds:.1f} s ({mb / max(seconds, 1e-9):.1f} MB/s, {meta['workers']} worker(s))")
    return 0


def _cmd_prepare_chat(args: argparse.Namespace) -> int:
    from tinylm.data.chatdata import prepare_chat

    data = prepare_chat(args.out, args.chat, tokenizer=args.tokenizer,
                        context_length=args.context_length, val_fraction=args.val_fraction,
                        skip_bad=args.skip_bad, force=args.force)
    chat = data.meta["chat"]
    counted = int(data.train_mask.sum())
    skipped = f", skipped {chat['skipped']} bad record(s)" if chat["skipped"] else ""
    print(f"prepared {data.dir}: {chat['conversations']['train']:,} train + "
          f"{chat['conversations']['val']:,} val conversations in rows of "
          f"{chat['row_length']} tokens, {len(data.train):,} train tokens of which "
          f"{counted:,} count in the loss, {data.tokenizer.kind} tokenizer with "
          f"{data.tokenizer.vocab_size:,} tokens{skipped}")
    return 0
