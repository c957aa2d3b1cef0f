"""The chat format: conversations -> token ids with a loss mask, and conversation records.

A conversation is a list of OpenAI-style messages ``{"role": ..., "content": ...}``
with roles system, user and assistant. Each turn is rendered as its role token, the
content's ids and the end-of-turn token, with nothing in between::

    <|system|>You answer briefly.<|end|><|user|>What is len?<|end|><|assistant|>...

which is exactly what :data:`tinylm.data.tokenizers.CHAT_TEMPLATE` (Jinja2) renders, so
Hugging Face ``apply_chat_template`` gives the same ids for the same messages. The one
difference is on purpose: here content is encoded with ``allow_special=False``, so a
user who types ``<|assistant|>`` gets the characters, never the role token.

The loss mask marks the tokens a fine-tuned model learns to produce: 1 on an
assistant's content and the ``<|end|>`` after it, 0 on everything else (role tokens,
system and user turns).

A model with its own chat template (a Hugging Face or GGUF import: ChatML, Llama 3's
headers, ...; :attr:`Tokenizer.own_template`) is rendered by that template instead, as
transformers' ``apply_chat_template`` renders it (:mod:`tinylm.data.templates`), and the
rendered text is encoded with its special tokens parsed, no bos added (the template
writes its own), and special-token spellings inside message contents kept as text (as
``sanitize_control_tokens=True`` does). Its loss mask is found by rendering the
conversation growing message by message: an assistant message's text is what the full
conversation has beyond the conversation before it plus the generation prompt, up to
the end of its end-of-turn token (what follows, e.g. ChatML's newline, is not), and the
tokens marked 1 are those whose characters overlap it (transformers' rule for its
``{% generation %}`` masks, with the same token offsets).
Its stop ids are the model's eos and end-of-turn tokens.

Records (one JSON object per line of a ``.jsonl`` file) come in three shapes:
``{"messages": [...]}``, ``{"prompt": ..., "completion": ...}`` and
``{"instruction": ..., "input": ..., "output": ...}`` (``input`` optional).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.core.display import display_name
from tinylm.core.errors import DataError
from tinylm.data.lines import bounded_lines, too_long
from tinylm.data.options import MAX_RECORD_BYTES
from tinylm.data.templates import mark_special, render_template, split_marked
from tinylm.data.tokenizers import END_OF_TURN, ROLE_TOKENS, Tokenizer

ROLES = tuple(ROLE_TOKENS)
Message = Mapping[str, str]


def check_messages(messages: Any, *, allow_empty: bool = True) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or a DataError saying
    which message is wrong and how."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"message {i} is a {type(m).__name__}, not an object with "
                            f"\"role\" and \"content\"")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"message {i} ({role}) has content of type "
                            f"{type(content).__name__}; content must be a string")
        if not allow_empty and not content.strip():
            raise DataError(f"message {i} ({role}) has empty content")
        out.append({"role": role, "content": content})
    return out


def _chat_ids(tokenizer: Tokenizer) -> tuple[dict[str, int], int]:
    roles = {r: tokenizer.special_id(t) for r, t in ROLE_TOKENS.items()}
    return roles, tokenizer.special_id(END_OF_TURN)


def render_with_mask(tokenizer: Tokenizer, messages: Sequence[Message],
                     add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation: mask 1 on assistant content and its end of turn
    (<|end|>, or the model's own template's end-of-turn token)."""
    messages = check_messages(messages)
    if tokenizer.own_template is not None:
        return _template_mask(tokenizer, messages, add_generation_prompt)
    roles, end = _chat_ids(tokenizer)
    contents = tokenizer.encode_batch([m["content"] for m in messages])
    ids: list[int] = []
    mask: list[int] = []
    for m, content in zip(messages, contents, strict=True):
        learn = int(m["role"] == "assistant")
        ids += [roles[m["role"]], *content, end]
        mask += [0] + [learn] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(roles["assistant"])
        mask.append(0)
    return ids, mask


def render_chat(tokenizer: Tokenizer, messages: Sequence[Message],
                add_generation_prompt: bool = True) -> list[int]:
    """The ids of ``messages`` in the model's chat format, ending with the assistant's
    header (``<|assistant|>`` in tinylm's) when ``add_generation_prompt`` (what a model
    continues to answer)."""
    if tokenizer.own_template is not None:
        return template_ids(tokenizer, check_messages(messages), add_generation_prompt)
    return render_with_mask(tokenizer, messages, add_generation_prompt)[0]


def render_text(tokenizer: Tokenizer, messages: Sequence[Message],
                add_generation_prompt: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None, *,
                marked: bool = False) -> str:
    """The text the tokenizer's chat template renders for ``messages`` (with
    ``marked``: special-token spellings in the contents wrapped in the markers of
    :func:`tinylm.data.templates.mark_special`)."""
    template = tokenizer.chat_template
    if template is None:
        raise DataError(f"this {tokenizer.kind} tokenizer has no chat template")
    s = tokenizer.settings
    if marked:
        messages = mark_special(list(messages), tokenizer.special_tokens)
        tools = None if tools is None else mark_special(list(tools), tokenizer.special_tokens)
    names = {"bos_token": s.bos_token, "eos_token": s.eos_token, "unk_token": s.unk_token,
             "pad_token": s.pad_token}
    return render_template(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=names, tools=tools)


def template_ids(tokenizer: Tokenizer, messages: Sequence[Message],
                 add_generation_prompt: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The ids of the model's template rendering of ``messages``: the text encoded with
    special tokens parsed and nothing added, except that a special token's spelling
    inside a message (or a tool) is encoded as ordinary text."""
    text = render_text(tokenizer, messages, add_generation_prompt, tools, marked=True)
    return _encode_rendered(tokenizer, text)[0]


def _encode_rendered(tokenizer: Tokenizer, marked: str
                     ) -> tuple[list[int], list[tuple[int, int]], str]:
    """(ids, each token's character span, the text) of a rendering with marked user
    spellings of special tokens: the pieces between markers are encoded with special
    tokens parsed, the marked ones as text; spans and text are without the markers."""
    pieces = split_marked(marked, tokenizer.special_tokens)
    ids, offsets = tokenizer.encode_offsets(pieces[0], allow_special=True)
    pos = len(pieces[0])
    newline = tokenizer.encode("\n", allow_special=True) if len(pieces) > 1 else []
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:  # odd places: a user's special-token spelling, as text
            more, spans = _encode_piece(tokenizer, piece, i % 2 == 0, newline)
            ids += more
            offsets += [(a + pos, b + pos) for a, b in spans]
            pos += len(piece)
    return ids, offsets, "".join(pieces)


def _encode_piece(tokenizer: Tokenizer, piece: str, special: bool, newline: list[int]
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """A piece from inside a rendered chat, encoded after a newline that is then
    removed (so a tokenizer that treats a text's start differently does not)."""
    ids, spans = tokenizer.encode_offsets("\n" + piece, allow_special=special)
    if ids[:len(newline)] == newline:
        n = len(newline)
        return ids[n:], [(max(a - 1, 0), max(b - 1, 0)) for a, b in spans[n:]]
    return tokenizer.encode_offsets(piece, allow_special=special)


def _template_mask(tokenizer: Tokenizer, messages: list[dict[str, str]],
                   add_generation_prompt: bool) -> tuple[list[int], list[int]]:
    """(ids, mask) with 1 on every token that overlaps an assistant message's text up
    to the end of its end-of-turn token (transformers' rule for its assistant masks)."""
    ids, offsets, text = _encode_rendered(
        tokenizer, render_text(tokenizer, messages, add_generation_prompt, marked=True))
    stops = set(tokenizer.end_of_turn_ids)
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prefix_length(tokenizer, messages[:k], True, text, k)
        end = _prefix_length(tokenizer, messages[:k + 1], False, text, k)
        ends = [b for i, (a, b) in zip(ids, offsets, strict=True)
                if i in stops and start <= a and b <= end]
        end = max(ends, default=end)
        for j, (a, b) in enumerate(offsets):
            if b > start and a < end:
                mask[j] = 1
    return ids, mask


def _prefix_length(tokenizer: Tokenizer, messages: list[dict[str, str]], prompt: bool,
                   text: str, k: int) -> int:
    """The length of the text ``messages`` render to, which must begin ``text``."""
    part = "".join(split_marked(render_text(tokenizer, messages, prompt, marked=True),
                                tokenizer.special_tokens))
    if not text.startswith(part):
        raise DataError(f"the model's chat template does not render this conversation turn "
                        f"by turn (the text before message {k} changes when it is added), so "
                        f"the assistant's tokens cannot be marked for the loss")
    return len(part)


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end an assistant's answer: the model's eos and end-of-turn tokens
    for its own template; <|end|> and end-of-text if present for tinylm's format."""
    if tokenizer.own_template is not None:
        return tokenizer.end_of_turn_ids
    ids = [tokenizer.special_id(END_OF_TURN)]
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids


# --- records ---------------------------------------------------------------------------------


def messages_of_record(record: Any) -> list[dict[str, str]]:
    """The conversation in one record (any of the three shapes), checked: valid roles,
    string non-empty contents, and at least one assistant message to learn from."""
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record or "completion" in record:
        messages = [{"role": "user", "content": record.get("prompt")},
                    {"role": "assistant", "content": record.get("completion")}]
    elif "instruction" in record or "output" in record:
        instruction, extra = record.get("instruction"), record.get("input", "")
        if not isinstance(extra, str):
            raise DataError(f"\"input\" must be a string, got {type(extra).__name__}")
        if isinstance(instruction, str) and extra.strip():
            instruction = f"{instruction}\n\n{extra}"
        messages = [{"role": "user", "content": instruction},
                    {"role": "assistant", "content": record.get("output")}]
    else:
        raise DataError("record has none of \"messages\", \"prompt\"/\"completion\", "
                        "\"instruction\"/\"output\"; see docs/finetune.md for the shapes")
    messages = check_messages(messages, allow_empty=False)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("conversation has no assistant message, so nothing to learn from")
    return messages


@dataclass(frozen=True)
class BadRecord:
    """Where a record was refused and why (``file:line: reason``)."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def chat_files(path: str | Path) -> list[Path]:
    """The ``.jsonl`` files of ``path`` (a file, or a folder searched recursively)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if files:
            return files
        raise DataError(f"folder {display_name(path)} has no .jsonl files; pass conversation "
                        f"records as JSON Lines")
    raise DataError(f"chat data {display_name(path)} does not exist; pass a .jsonl file or a "
                    f"folder of them")


def read_records(paths: Sequence[str | Path], max_record_bytes: int = MAX_RECORD_BYTES
                 ) -> Iterator[tuple[str, int, list[dict[str, str]] | BadRecord]]:
    """(file, line, conversation or BadRecord) for every non-blank line of ``paths``; a
    line over ``max_record_bytes`` bytes is a BadRecord, read in bounded memory and
    dropped, never held whole."""
    for path in paths:
        for file in chat_files(path):
            name = display_name(file)
            try:
                handle = file.open("rb")
            except OSError as exc:
                raise DataError(f"cannot read {name}: {exc.strerror}") from None
            with handle:
                try:
                    for n, line in enumerate(bounded_lines(handle, max_record_bytes), 1):
                        if isinstance(line, int):
                            yield name, n, BadRecord(name, n, too_long(line, max_record_bytes))
                        elif line.strip():
                            yield name, n, _parse_line(name, n, line)
                except OSError as exc:
                    raise DataError(f"cannot read {name}: {exc.strerror or exc}") from None


def _parse_line(file: str, n: int, raw: bytes) -> list[dict[str, str]] | BadRecord:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{file} is not UTF-8 text ({exc.reason} on line {n}); save it as "
                        f"UTF-8") from None
    try:
        return messages_of_record(json.loads(line))
    except json.JSONDecodeError as exc:
        return BadRecord(file, n, f"not valid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return BadRecord(file, n, "JSON nested too deeply")
    except ValueError as exc:  # an integer of 4,300+ digits
        return BadRecord(file, n, f"not valid JSON ({str(exc).splitlines()[0]})")
    except DataError as exc:
        return BadRecord(file, n, str(exc))


__all__ = [
    "ROLES",
    "BadRecord",
    "chat_files",
    "check_messages",
    "messages_of_record",
    "read_records",
    "render_chat",
    "render_text",
    "render_with_mask",
    "stop_ids",
    "template_ids",
]
