"""``tinylm prepare``: text, JSONL, Parquet or chat records -> tokenizer + token shards."""

from __future__ import annotations

import argparse


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    from tinylm.data.options import PrepareOptions

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
    # The command's own flags (not prepare() options), each listed before the option flag
    # that follows it in --help; the option flags come from PrepareOptions, in its order.
    before = {
        "corpus": (src, "--input", dict(
            action="append", metavar="FILE|DIR|GLOB|-",
            help="a text, JSONL or Parquet file, a folder of them (or a datasets folder), a "
            "quoted glob, or - for stdin (repeatable)")),
        "skip_bad": (src, "--chat", dict(
            action="append", metavar="FILE.jsonl|DIR|python-qa",
            help="conversation records for 'tinylm finetune' (repeatable): {messages}, "
            "{prompt, completion} or {instruction, input, output} lines, or python-qa (the "
            "built-in instruction set); writes token shards plus a loss mask. Use "
            "--tokenizer MODEL_DIR (default: char from the text)")),
        "force": (p, "--out", dict(required=True, metavar="DIR", help="output folder")),
    }
    for name, flags, kw in PrepareOptions.flags():
        if name in before:
            group, flag, own = before[name]
            group.add_argument(flag, **own)
        (src if name == "corpus" else p).add_argument(*flags, **kw)
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args: argparse.Namespace) -> int:
    import time

    from tinylm.data import PrepareOptions, prepare
    from tinylm.data.readers import display_path

    args.tokenizer = _tokenizer_spec(args.tokenizer)
    if args.chat:
        return _cmd_prepare_chat(args)
    start = time.perf_counter()
    data = prepare(args.out, args.input, options=PrepareOptions.from_args(args))
    seconds = time.perf_counter() - start
    meta = data.meta
    mb = meta["input_bytes"] / 1e6
    docs = meta["documents"]
    extra = "".join(f", {_count(n, what)}" for what, n in (
        ("duplicate# removed", docs["duplicates_removed"]),
        ("bad record# skipped", docs["skipped_records"])) if n)
    shards = sum(len(v) for v in meta["shards"].values())
    print(f"prepared {display_path(data.dir)}: {meta['train_tokens']:,} train + "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}, {shards} shard(s)) from "
          f"{_count(docs['train'], 'training document#')} and "
          f"{_count(docs['val'], 'validation document#')}{extra}, {data.tokenizer.kind} "
          f"tokenizer with {data.vocab_size:,} tokens, from {meta['source']} ({mb:.2f} MB) in "
          f"{seconds:.1f} s ({mb / max(seconds, 1e-9):.1f} MB/s, {meta['workers']} worker(s))")
    return 0


def _count(n: int, what: str) -> str:
    """``n`` and ``what`` with its ``#`` made plural unless n is 1: "1 training document"."""
    return f"{n:,} {what.replace('#', '' if n == 1 else 's')}"


def _tokenizer_spec(spec):
    """--tokenizer X.gguf stands for the file's conversion (made once into the GGUF cache,
    as --model X.gguf is), so the data and the model share one tokenizer.json."""
    from pathlib import Path

    if isinstance(spec, str) and spec.lower().endswith(".gguf") and Path(spec).is_file():
        from tinylm.io.checkpoint import resolve_checkpoint_dir

        return str(resolve_checkpoint_dir(spec))
    return spec


def _cmd_prepare_chat(args: argparse.Namespace) -> int:
    from tinylm.data.chatdata import prepare_chat
    from tinylm.data.readers import display_path

    data = prepare_chat(args.out, args.chat, tokenizer=args.tokenizer,
                        context_length=args.context_length, val_fraction=args.val_fraction,
                        skip_bad=args.skip_bad, force=args.force,
                        max_record_bytes=args.max_record_bytes)
    chat = data.meta["chat"]
    counted = int(data.train_mask.sum())
    skipped = f", skipped {chat['skipped']} bad record(s)" if chat["skipped"] else ""
    print(f"prepared {display_path(data.dir)}: {chat['conversations']['train']:,} train + "
          f"{chat['conversations']['val']:,} val conversations in rows of "
          f"{chat['row_length']} tokens, {len(data.train):,} train tokens of which "
          f"{counted:,} count in the loss, {data.tokenizer.kind} tokenizer with "
          f"{data.tokenizer.vocab_size:,} tokens{skipped}")
    return 0
