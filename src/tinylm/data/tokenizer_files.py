"""Tokenizer files: a ``tokenizer.json`` of any kind (char, byte-level or SentencePiece-style
BPE, GPT-2's vocab.json + merges.txt) read into a :class:`~tinylm.data.tokenizers.Tokenizer`
with its settings (chat template, special-token roles) beside it, and the tokenizer file of
a checkpoint or run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data.templates import read_settings
from tinylm.data.tokenizers import (
    UNK,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    _first_line,
    _require_hf_tokenizers,
)

#: The largest tokenizer file read (tokenizer.json, or vocab.json + merges.txt together):
#: real ones are far smaller (GPT-2's 1.4 MB, Llama 3's 9 MB, Gemma 3's 262k tokens 33 MB),
#: and loading one takes about 3x its size in memory. config.json's cap is 16 MiB.
MAX_TOKENIZER_BYTES = 64 << 20


def _too_big(path: Path, size: int) -> DataError:
    return DataError(f"tokenizer file {display_name(path)} is {size:,} bytes, more than the "
                     f"{MAX_TOKENIZER_BYTES:,} (64 MiB) tinylm reads from a tokenizer file; it "
                     f"is not a tokenizer, pass another file")


def _check_size(*paths: Path) -> None:
    """Refuse tokenizer files over MAX_TOKENIZER_BYTES together, before reading them."""
    try:
        size = sum(p.stat().st_size for p in paths)
    except OSError as exc:
        raise DataError(f"cannot read tokenizer file {display_name(paths[0])}: "
                        f"{exc.strerror or exc}") from None
    if size > MAX_TOKENIZER_BYTES:
        raise _too_big(paths[0], size)


def _read_text(path: Path) -> str:
    """A tokenizer file's text, read no further than the cap (a file that grows meanwhile)."""
    _check_size(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            raise _too_big(path, len(data))
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read tokenizer file {display_name(path)}: "
                        f"{_first_line(exc)}") from None


def _kind_of(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    model = model if isinstance(model, dict) else {}
    decoder = doc.get("decoder")
    decoder = decoder if isinstance(decoder, dict) else {}
    pre = doc.get("pre_tokenizer")
    if (model.get("type") == "BPE" and not model.get("merges") and pre is None
            and decoder.get("type") == "Fuse"):
        return "char"
    pre = pre if isinstance(pre, dict) else {}
    if pre.get("type") == "ByteLevel" and model.get("type") == "BPE":
        vocab = model.get("vocab")
        vocab = vocab if isinstance(vocab, dict) else {}
        return "gpt2" if len(vocab) == 50257 and vocab.get("<|endoftext|>") == 50256 else "bpe"
    return "file"


def _bad_file(path: Path, what: str) -> DataError:
    return DataError(f"tokenizer file {display_name(path)} is malformed: {what}; re-run tinylm "
                     f"prepare or pass a tokenizer.json written by tinylm or Hugging Face "
                     f"tokenizers")


def _char_from_hf(doc: dict[str, Any], path: Path) -> CharTokenizer:
    """A char tokenizer from its JSON, every field checked (a DataError names the bad one)."""
    model = doc["model"]
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise _bad_file(path, "model.vocab is not an object of token -> id")
    for token, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31:
            raise _bad_file(path, f"model.vocab[{token!r}] is {i!r}, not a token id")
    added = doc.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str)
            and isinstance(t.get("id"), int) and not isinstance(t.get("id"), bool)
            for t in added):
        raise _bad_file(path, "added_tokens must be a list of {\"id\": int, \"content\": str}")
    specials = [t["content"] for t in sorted(added, key=lambda t: t["id"])]
    unknown = "replace" if model.get("unk_token") == UNK else "error"
    chars = [s for s in vocab if s not in specials]
    if any(len(c) != 1 for c in chars):
        bad = next(c for c in chars if len(c) != 1)
        raise _bad_file(path, f"char vocabulary entry {bad[:20]!r} is not one character "
                              f"and not in added_tokens")
    tok = CharTokenizer(chars, unknown=unknown, special_tokens=specials)
    if tok._stoi != vocab:
        raise DataError(f"char tokenizer {display_name(path)} has ids that are not in code-point "
                        f"order; it was not written by tinylm, re-run tinylm prepare")
    return tok


def tokenizer_from_json(text: str, path: str | Path = "<string>") -> Tokenizer:
    """A tokenizer from the text of a tokenizer.json (tinylm's or any HF one).

    Any malformed document is a one-line DataError naming the file, never a raw
    exception from the JSON parser, this module or the Rust ``tokenizers`` library.
    """
    path = Path(path)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TOKENIZER_BYTES:
        raise _too_big(path, size)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"tokenizer file {display_name(path)} is not valid JSON ({exc.msg} at line "
                        f"{exc.lineno}); re-run tinylm prepare or pass another file") from exc
    except RecursionError as exc:
        raise _bad_file(path, "JSON nested too deeply") from exc
    if not isinstance(doc, dict) or "model" not in doc:
        raise DataError(f"{display_name(path)} is not a Hugging Face tokenizer.json (no 'model' "
                        f"entry); pass a tokenizer.json or a folder with vocab.json and merges.txt")
    if not isinstance(doc["model"], dict):
        raise _bad_file(path, "'model' is not an object")
    kind = _kind_of(doc)
    if kind == "char":
        return _char_from_hf(doc, path)
    tk = _require_hf_tokenizers()
    try:
        hf = tk.Tokenizer.from_str(text)
        return BPETokenizer(hf, kind=kind)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # pyo3 panics are BaseExceptions
        raise DataError(f"cannot load tokenizer {display_name(path)}: {_first_line(exc)}; re-run "
                        f"tinylm prepare, or it may need a newer 'tokenizers' package") from exc


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from local files only (never downloads).

    ``path`` is a tokenizer.json (tinylm's or any Hugging Face one), or a folder
    holding tokenizer.json, or GPT-2 style vocab.json + merges.txt. The settings in
    that folder's tokenizer_config.json / chat_template.jinja / special_tokens_map.json
    come with it (:func:`tinylm.data.templates.read_settings`).
    """
    tok, path = _load_vocabulary(path), Path(path)
    if path.is_dir() or path.name in ("tokenizer.json", "vocab.json"):
        settings = read_settings(path if path.is_dir() else path.parent, tok.token_to_id)
        return tok if settings.empty else tok.with_settings(settings)
    return tok


def _load_vocabulary(path: str | Path) -> Tokenizer:
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            _check_size(path / "vocab.json", path / "merges.txt")
            return BPETokenizer.from_gpt2_files(path / "vocab.json", path / "merges.txt")
        else:
            raise DataError(f"no tokenizer in folder {display_name(path)}: expected tokenizer.json "
                            f"or vocab.json + merges.txt; pass a tokenizer file or prepared folder")
    elif not path.exists():
        raise DataError(f"tokenizer {display_name(path)} does not exist; pass a tokenizer.json or "
                        f"a folder with tokenizer.json or vocab.json + merges.txt (never "
                        f"downloaded)")
    if path.name == "vocab.json" and (path.parent / "merges.txt").is_file():
        _check_size(path, path.parent / "merges.txt")
        return BPETokenizer.from_gpt2_files(path, path.parent / "merges.txt")
    return tokenizer_from_json(_read_text(path), path)


def checkpoint_tokenizer_file(folder: str | Path) -> Path | None:
    """The tokenizer.json of a checkpoint folder, or of a training run folder's newest
    checkpoint: ``tinylm train --out RUN`` writes RUN/latest, and a run folder stands for
    it (as :func:`tinylm.io.checkpoint.resolve_checkpoint_dir` decides); None when there
    is none. Only reads: a save interrupted mid-swap is recovered by the checkpoint
    readers of :mod:`tinylm.io.checkpoint`, not here."""
    folder = Path(folder)
    latest = folder / "latest"
    if not (folder / "config.json").is_file() and (latest / "config.json").is_file():
        folder = latest
    path = folder / "tokenizer.json"
    return path if path.is_file() else None
