"""``prepare()``: documents -> tokenizer + token shards, a prepared folder
(:mod:`tinylm.data.format`).

``prepare()`` turns files (text, JSONL, Parquet, a ``datasets`` folder; see
:mod:`tinylm.data.readers`), folders and globs of them, standard input or a built-in corpus
into a folder holding tokenizer.json, ``train-NNNNN.bin`` and ``val-NNNNN.bin`` shards and
meta.json. Each record (or text file) is one document; documents are joined with a
separator, by default the tokenizer's end-of-text token, so a window can tell where one
ends. Validation takes whole documents (every k-th, evenly along the input, or the
documents of ``val_files``); with a single document it falls back to the last fraction
of the tokens. Its options are :class:`tinylm.data.options.PrepareOptions`.

``prepare`` runs in phases, each a function below over a small typed state: **plan**
(the options checked: :func:`tinylm.data.plan.make_plan`), **scan** (pass 1: hash the
inputs, count documents and bad records, find duplicates, build the char alphabet or
train BPE on a bounded sample: :mod:`tinylm.data.scan`), **encode** (pass 2: documents
cut into pieces where tokenization cannot look across the cut
(:func:`tinylm.data.encoding.safe_split`), encoded in order by worker processes
(:mod:`tinylm.data.pool`), written to shards), **split** and **commit** (outputs staged
in a temporary folder, moved in at the end, meta.json last: a folder with meta.json is
complete). Memory stays flat in the corpus size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.core.errors import DataError
from tinylm.data.corpora import load_corpus
from tinylm.data.encoding import (
    PIECE_CHARS,
    Route,
    Tasks,
    make_encoder,
    route_of,
    separator_ids,
)
from tinylm.data.format import (
    FORMAT,
    FORMAT_VERSION,
    PreparedData,
    dtype_for_vocab,
    is_output,
    load_prepared,
)
from tinylm.data.options import PrepareOptions
from tinylm.data.plan import Plan, make_plan
from tinylm.data.pool import UnitJob, digest_tasks, encode_task, encode_unit, mapped, take
from tinylm.data.readers import Source, Unit, display_path, iter_documents, resolve_inputs
from tinylm.data.scan import Bar, Scan, scan_inputs, workers_for
from tinylm.data.shards import ShardWriter, move_tail
from tinylm.data.tokenizers import CharTokenizer

log = logging.getLogger(__name__)


# --- the output folder -----------------------------------------------------------------------


def _stage_name(out: Path) -> Path:
    return out / f".prepare.tmp-{os.getpid()}"


def _remove_stale_temps(out: Path) -> None:
    """Delete temporary files and folders left by prepare runs that were killed."""
    for p in out.glob(".*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        except PermissionError:
            pass


def _check_out(plan: Plan) -> dict[str, Any] | None:
    """Refuse an output folder that holds something else; return its old meta, if any."""
    out, settings, force = plan.out, plan.settings, plan.opts.force
    if out.exists() and not out.is_dir():
        raise DataError(f"output {display_path(out)} is a file, not a folder; pass a folder "
                        f"path to --out")
    if not out.is_dir():
        return None
    old = None
    meta_path = out / "meta.json"
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            old = {}
        if not force and (not isinstance(old, dict) or old.get("format") != FORMAT):
            raise DataError(f"output folder {display_path(out)} has a meta.json that tinylm did "
                            f"not write; choose another --out, or pass --force to replace it")
        if not force and old.get("settings") != settings:
            raise DataError(
                f"output folder {display_path(out)} already holds a different dataset "
                f"({_describe_settings(old.get('settings') or {})}; this run: "
                f"{_describe_settings(settings)}); choose another --out, "
                f"or pass --force to overwrite it"
            )
    elif not force:
        foreign = sorted(p.name for p in out.iterdir()
                         if not is_output(p.name) and ".tmp-" not in p.name)
        if foreign:
            raise DataError(f"output folder {display_path(out)} is not empty (has "
                            f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                            f"choose an empty or new --out, or pass --force to write there "
                            f"anyway")
    return old if isinstance(old, dict) else None


def _describe_settings(s: dict[str, Any]) -> str:
    tok = s.get("tokenizer", {}) if isinstance(s.get("tokenizer"), dict) else {}
    return (f"source {s.get('source', '?')}, tokenizer {tok.get('kind', '?')}"
            + (f" vocab {tok['vocab_size']}" if tok.get("vocab_size") else "")
            + f", val fraction {s.get('val_fraction', '?')}"
            + (", allow_special" if s.get("allow_special") else ""))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(out: Path, stage: Path, names: Sequence[str]) -> None:
    """Move the staged files into ``out``: old outputs go, meta.json comes in last."""
    for name in names:
        _fsync(stage / name)
    (out / "meta.json").unlink(missing_ok=True)  # the completeness marker goes first
    for p in out.iterdir():
        if is_output(p.name) and p.name not in names:
            p.unlink()
    for name in sorted(names, key=lambda n: n == "meta.json"):
        os.replace(stage / name, out / name)
    try:
        dir_fd = os.open(out, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
    except OSError:  # not every platform can fsync a directory
        pass


# --- the phases -----------------------------------------------------------------------------


def _sources(plan: Plan, stage: Path) -> tuple[list[Source], list[bool]]:
    """The inputs in reading order, and for each whether it belongs to val (--val-files)."""
    o = plan.opts
    if o.corpus:
        data = load_corpus(o.corpus).encode("utf-8")
        return [Source(f"corpus {o.corpus}", data=data)], [False]
    train = resolve_inputs(plan.inputs, o.glob, plan.out)
    val = resolve_inputs(o.val_files, o.glob, plan.out) if o.val_files else []
    sources = train + val
    if any(s.name == "<stdin>" for s in sources):
        # Standard input can be read once; spool it so both passes can read it.
        with open(stage / "stdin", "wb") as f:
            shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
        sources = [Source("<stdin>", path=stage / "stdin") if s.name == "<stdin>" else s
                   for s in sources]
    return sources, [False] * len(train) + [True] * len(val)


def _task_stream(o: PrepareOptions, sources: Sequence[Source], val_source: Sequence[bool],
                 scan: Scan, route: Route, docs: list[int], bar: Bar
                 ) -> Iterator[tuple[list[str], bytes, bytes]]:
    """Pass 2's reading: the documents again, routed to splits, cut into tasks."""
    tasks = Tasks(bpe=not isinstance(scan.tokenizer, CharTokenizer))
    started = [False, False]
    doc = rank = -1
    open_doc = False
    for text, start, k in iter_documents(sources, text_field=o.text_field, errors=o.errors,
                                         chunk_bytes=o.chunk_bytes, on_bytes=bar,
                                         max_record_bytes=o.max_record_bytes):
        if start:
            if open_doc:
                tasks.end()
            doc += 1
            open_doc = scan.keep is None or bool(scan.keep[doc])
            if not open_doc:
                continue
            rank += 1
            split = route.split_of(rank, val_source[k])
            docs[split] += 1
            tasks.start(split, started[split])
            started[split] = True
        if open_doc:
            tasks.add(text)
            if tasks.full():
                yield tasks.take()
    if open_doc:
        tasks.end()
    if tasks.pieces:
        yield tasks.take()


def _unit_items(scan: Scan, route: Route, val_source: Sequence[bool], docs: list[int],
                bar: Bar) -> Iterator[tuple[Unit, int, tuple[bool, bool]]]:
    """Pass 2's units with the rank of their first document and which splits started
    before them; counts the documents of each split into ``docs``."""
    assert scan.units is not None
    rank = 0
    for unit, n in zip(scan.units, scan.unit_docs, strict=True):
        yield unit, rank, (docs[0] > 0, docs[1] > 0)
        vs = val_source[unit.source]
        val = route.val_before(rank + n, vs) - route.val_before(rank, vs)
        docs[0] += n - val
        docs[1] += val
        rank += n
        bar(unit.size)


def _write_results(results: Iterator[Any], writers: Sequence[ShardWriter], scan: Scan,
                   sources: Sequence[Source]) -> int:
    """Pass 2's parts into the writers, in order (units: their documents checked against
    pass 1's count, their characters counted), then the side tasks' sha256s; the
    largest id."""
    top, k = 0, 0
    try:
        for result in results:
            if isinstance(result, str):
                scan.digests.append(result)
                continue
            top = max(top, take(result, writers))
            if scan.units is not None:
                if result.docs != scan.unit_docs[k]:
                    raise DataError(
                        f"{sources[scan.units[k].source].name}: {result.docs} documents "
                        f"read where the first pass counted {scan.unit_docs[k]} (the file "
                        f"changed, or its Parquet statistics are wrong); run tinylm "
                        f"prepare again when it is not being written, or rewrite the file")
                scan.chars += result.chars
                k += 1
    finally:
        results.close()  # type: ignore[attr-defined]
    return top


@dataclass(frozen=True)
class _Encoded:
    """What pass 2 wrote: each split's shard index, tokens and documents, the largest id,
    the separator's ids, the split mode (:class:`tinylm.data.encoding.Route`) and the
    number of workers."""

    shards: dict[str, list[dict[str, Any]]]
    tokens: dict[str, int]
    documents: dict[str, int]
    max_id: int
    separator: list[int]
    route: str
    workers: int


def _encode(plan: Plan, sources: Sequence[Source], val_source: Sequence[bool], scan: Scan,
            stage: Path) -> _Encoded:
    """Pass 2: encode every kept document into the train/val shard writers, in order."""
    o, tok = plan.opts, scan.tokenizer
    assert tok is not None
    dtype = dtype_for_vocab(tok.vocab_size)
    sep = separator_ids(o.doc_separator, tok, scan.documents - scan.duplicates)
    route = route_of(scan.documents - scan.duplicates, bool(o.val_files), o.val_fraction)
    total = sum(s.size for s in sources)
    workers = workers_for(o, sources)
    if getattr(tok, "split_safe", True) is False:
        log.warning("the tokenizer is not GPT-2 byte-level BPE; documents over %d characters "
                    "are encoded in pieces cut at spaces and line breaks", PIECE_CHARS)
    writers = [ShardWriter(stage, s, dtype, o.shard_tokens) for s in ("train", "val")]
    docs, top = [0, 0], 0
    bar = Bar(total, f"encode {tok.kind}", o.progress)
    try:
        encoder = make_encoder(tok, sep, dtype, o.allow_special, scan.fast)
        if scan.units is not None:  # the workers read too
            job = UnitJob(list(sources), o.text_field, o.errors, route, list(val_source),
                          encoder, o.max_record_bytes)
            results = mapped(workers, encode_unit,
                             _unit_items(scan, route, val_source, docs, bar), job,
                             side=() if scan.digests else digest_tasks(sources),
                             stage=stage)
        else:
            tasks = _task_stream(o, sources, val_source, scan, route, docs, bar)
            results = mapped(workers, encode_task, tasks, encoder, stage=stage)
        top = _write_results(results, writers, scan, sources)
    finally:
        bar.close()
        entries = [w.close() for w in writers]
    if route.mode == "tokens":
        n = writers[0].tokens
        entries[0] = move_tail(stage, entries[0], n - round(n * o.val_fraction), dtype,
                               writers[1])
        writers[0].tokens = n - writers[1].tokens
        entries[1] = writers[1].close()
    return _Encoded({"train": entries[0], "val": entries[1]},
                    {"train": writers[0].tokens, "val": writers[1].tokens},
                    {"train": docs[0], "val": docs[1]}, top, sep.tolist(), route.mode, workers)


def _after_scan(plan: Plan, sources: Sequence[Source], scan: Scan,
                old_meta: dict[str, Any] | None) -> None:
    """Refuse what pass 1 found wrong: nothing to read, bad records, another text (read
    in units, the characters are counted in pass 2: :func:`_check_text` then)."""
    o = plan.opts
    if sum(s.size for s in sources) == 0 or scan.bad.count == 0 and scan.documents == 0:
        raise DataError(f"input is empty ({plan.settings['source']}); pass a file with text in it")
    if scan.units is None:
        _check_text(plan, scan)
    if scan.bad.count:
        counts = ", ".join(f"{n} {why}" for why, n in scan.bad.reasons.items())
        if not o.skip_bad:
            raise DataError(f"{scan.bad.count:,} record(s) have no usable text ({counts}); "
                            f"the first: {scan.bad.first}; fix them, name the text field with "
                            f"--text-field, or pass --skip-bad to leave them out")
        log.warning("skipped %d record(s) without usable text (%s); the first: %s",
                    scan.bad.count, counts, scan.bad.first)
    if scan.documents - scan.duplicates == 0:
        raise DataError(f"no documents with text in {plan.settings['source']}; check "
                        f"--text-field (now {o.text_field!r})")
    if old_meta and not o.force and old_meta.get("sha256") != _combined(scan):
        raise DataError(f"output folder {display_path(plan.out)} already holds a dataset "
                        f"prepared from different input text; choose another --out, or pass "
                        f"--force to overwrite it")


def _check_text(plan: Plan, scan: Scan) -> None:
    if scan.bad.count == 0 and scan.chars == 0:
        raise DataError(f"input is empty ({plan.settings['source']}); pass a file with text in it")


def _combined(scan: Scan) -> str:
    return hashlib.sha256("".join(scan.digests).encode()).hexdigest()


def _check_lengths(o: PrepareOptions, enc: _Encoded) -> None:
    n_train, n_val = enc.tokens["train"], enc.tokens["val"]
    need = o.context_length + 1
    if min(n_train, n_val) < need:
        raise DataError(
            f"input is too short: {n_train + n_val:,} tokens split into {n_train:,} train + "
            f"{n_val:,} val, but each split needs at least context length + 1 = {need:,}; "
            f"give more text, or lower --context-length (now {o.context_length}) or "
            f"adjust --val-fraction (now {o.val_fraction})"
            + (" or --val-files" if o.val_files else "")
        )


def _meta(plan: Plan, sources: Sequence[Source], scan: Scan, enc: _Encoded) -> dict[str, Any]:
    from tinylm import __version__

    o, tok = plan.opts, scan.tokenizer
    assert tok is not None
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tinylm_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": plan.settings,
        "source": plan.settings["source"],
        "inputs": [{"name": s.name, "format": s.format, "bytes": s.size, "sha256": d}
                   for s, d in zip(sources, scan.digests, strict=True)],
        "sha256": _combined(scan),
        "input_bytes": sum(s.size for s in sources),
        "input_chars": scan.chars,
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                      "special_tokens": list(tok.special_tokens), "eos_id": tok.eos_id,
                      "trained_on_chars": scan.trained_on},
        "vocab_size": tok.vocab_size,
        "dtype": dtype_for_vocab(tok.vocab_size).name,
        "train_tokens": enc.tokens["train"],
        "val_tokens": enc.tokens["val"],
        "max_token_id": enc.max_id,
        "documents": {"read": scan.documents, "train": enc.documents["train"],
                      "val": enc.documents["val"], "duplicates_removed": scan.duplicates,
                      "skipped_records": scan.bad.count, "first_skipped": scan.bad.first},
        "doc_separator": enc.separator,
        "split": enc.route,
        "val_fraction": o.val_fraction,
        "shard_tokens": o.shard_tokens,
        "shards": enc.shards,
        "context_length": o.context_length,
        "errors": o.errors,
        "workers": enc.workers,
        "allow_special": o.allow_special,
    }


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The objects that exist before prepare (torch's modules and the like: ~200k) are
    left out of the garbage collector's passes until it returns (``gc.freeze``): a full
    pass over them costs ~0.2 s, and in a forked worker it would write to every page
    that holds them. Only garbage cycles made before the call wait for its end to go."""
    if gc.get_freeze_count():  # the program manages freezing itself
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _phases(plan: Plan, stage: Path, old_meta: dict[str, Any] | None) -> int:
    """The phases after the plan: scan -> encode (+ split) -> commit, staged in ``stage``
    (the state between them: ``scan``, what pass 1 learnt; ``enc``, what pass 2 wrote);
    returns the input bytes."""
    sources, val_source = _sources(plan, stage)  # what to read
    # pass 1: count, build the tokenizer; hash the inputs now if a dataset is there to compare
    scan = scan_inputs(plan, sources, hash_now=bool(old_meta) and not plan.opts.force)
    _after_scan(plan, sources, scan, old_meta)
    enc = _encode(plan, sources, val_source, scan, stage)  # pass 2: encode, split
    if scan.units is not None:  # read in units, the characters were counted in pass 2
        _check_text(plan, scan)
    if [s.stamp() for s in sources] != scan.stamps:
        raise DataError("an input file changed while it was being prepared; "
                        "run tinylm prepare again when it is not being written")
    _check_lengths(plan.opts, enc)
    meta = _meta(plan, sources, scan, enc)
    scan.tokenizer.save(stage / "tokenizer.json")  # type: ignore[union-attr]
    (stage / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
    names = ["tokenizer.json", "meta.json",
             *(e["file"] for split in enc.shards.values() for e in split)]
    _commit(plan.out, stage, names)  # move in, meta.json last
    return meta["input_bytes"]


def prepare(out_dir: str | Path, inputs: Sequence[str | Path] | None = None, *,
            options: PrepareOptions | None = None, **kw: Any) -> PreparedData:
    """Tokenize documents into ``out_dir`` (tokenizer.json, shards, meta.json).

    inputs   files (text, .jsonl[.gz|.zst], .parquet), folders (every non-hidden file
             matching ``glob``, sorted; a ``datasets`` save_to_disk folder), globs, or "-"
             for standard input; with neither inputs nor ``corpus`` the built-in corpus
             python-docs is used
    options  a :class:`~tinylm.data.options.PrepareOptions` (its fields name and explain
             every option); ``kw``: those fields as keyword arguments, over ``options``
             (``prepare(out, [path], tokenizer="bpe", vocab_size=8192)``)

    Nothing in ``out_dir`` changes unless the whole run succeeds.
    """
    t0 = time.perf_counter()
    with _frozen_heap():
        plan = make_plan(out_dir, inputs, _options_of(options, kw))
        old_meta = _check_out(plan)
        out = plan.out
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(out)
        stage = _stage_name(out)
        stage.mkdir()
        try:
            total = _phases(plan, stage, old_meta)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise
        shutil.rmtree(stage, ignore_errors=True)
        seconds = time.perf_counter() - t0
        log.debug("prepared %s in %.2f s (%.1f MB/s)", display_path(out), seconds,
                  total / 1e6 / max(seconds, 1e-9))
        return load_prepared(out)


def _options_of(options: PrepareOptions | None, kw: dict[str, Any]) -> PrepareOptions:
    """``options`` with the keyword arguments of :func:`prepare` over it."""
    names = {f.name for f in dataclasses.fields(PrepareOptions)}
    for name in kw:
        if name not in names:
            raise TypeError(f"prepare() got an unexpected keyword argument {name!r}")
    return dataclasses.replace(options or PrepareOptions(), **kw)


__all__ = ["PrepareOptions", "prepare"]
