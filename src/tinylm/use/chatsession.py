"""``tinylm chat``: a conversation with a model, kept within its context, streamed.

:class:`ChatSession` holds the history (an optional system message, then user and
assistant turns), renders it with :func:`tinylm.data.chat.render_chat` (the model's own
chat template when it has one, else tinylm's format), and streams the assistant's answer
until one of the model's stop tokens (:func:`tinylm.data.chat.stop_ids`: ``<|end|>``,
or its eos and end-of-turn tokens such as ``<|im_end|>``). When the rendered history plus
room for an answer no longer fits the context length, the oldest turns are dropped (the
system message stays) and the session says so. :func:`run_terminal` is the interactive loop:
``/reset``, ``/system TEXT``, ``/temperature X``, ``/help``; Ctrl-D (end of input) quits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

from tinylm.core.checks import is_number
from tinylm.core.config import resolve_device
from tinylm.core.errors import ConfigError, TinyLMError
from tinylm.data.chat import render_chat, stop_ids
from tinylm.use.sampling import TextStream, generate_stream

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system "
        "message), /temperature X, /help; Ctrl-D quits")


class ChatSession:
    """A conversation with ``model``; :meth:`reply` streams one answer."""

    def __init__(self, model: Any, tokenizer: Any, *, system: str | None = None,
                 temperature: float = 0.7, top_k: int | None = None,
                 top_p: float | None = 0.9, max_new_tokens: int = 200,
                 seed: int | None = None) -> None:
        if tokenizer.chat_template is None:
            raise ConfigError(f"this model's {tokenizer.kind} tokenizer has no chat tokens "
                              f"(<|user|>, <|assistant|>, <|end|>); fine-tune it with "
                              f"tinylm finetune on chat data first")
        self.model, self.tokenizer = model, tokenizer
        self.system = system
        self.set_temperature(temperature)
        self.top_k, self.top_p = top_k, top_p
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.turns: list[dict[str, str]] = []
        self._stops = stop_ids(tokenizer)

    def set_temperature(self, value: float) -> None:
        if not is_number(value, finite=True) or not 0 <= value <= 100:
            raise ConfigError(f"temperature must be a number in [0, 100] (0 = greedy), "
                              f"got {value!r}")
        self.temperature = float(value)

    def reset(self) -> None:
        self.turns = []

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def _fit(self) -> tuple[list[int], int]:
        """The prompt ids, dropping the oldest turns until an answer has room; returns
        (ids, number of turns dropped)."""
        C = self.model.config.context_length
        room = min(self.max_new_tokens, max(1, C // 4))
        dropped = 0
        while True:
            ids = render_chat(self.tokenizer, self.messages())
            if len(ids) + room <= C or len(self.turns) <= 1:
                return ids, dropped
            self.turns.pop(0)
            dropped += 1

    def reply(self, text: str, note: Callable[[str], None] = lambda _: None) -> Iterator[str]:
        """Add the user's ``text`` and yield the answer's text pieces as they arrive."""
        self.turns.append({"role": "user", "content": text})
        try:
            ids, dropped = self._fit()
        except TinyLMError:
            self.turns.pop()  # e.g. characters a char tokenizer never saw
            raise
        if dropped:
            note(f"(the conversation outgrew the context of "
                 f"{self.model.config.context_length} tokens: dropped the oldest "
                 f"{dropped} turn(s))")
        C = self.model.config.context_length
        budget = max(1, min(self.max_new_tokens, C - len(ids)))
        steps = generate_stream(self.model, torch.tensor(ids), budget,
                                temperature=self.temperature, top_k=self.top_k,
                                top_p=self.top_p if self.temperature > 0 else None,
                                seed=self.seed, stop_ids=self._stops,
                                vocab_size=self.tokenizer.vocab_size)
        stream = TextStream(self.tokenizer)
        try:
            for nxt in steps:
                token = int(nxt[0])
                if token in self._stops:
                    break
                piece = stream.push(token)
                if piece:
                    yield piece
        finally:
            steps.close()
            rest = stream.finish()
            self.turns.append({"role": "assistant", "content": stream.text})
        if rest:
            yield rest


def open_session(model_dir: str, *, device: str = "auto", **settings: Any) -> ChatSession:
    """A :class:`ChatSession` with the model and tokenizer of a checkpoint or run folder
    (``device`` as ``--device``: auto picks cuda > mps > cpu)."""
    from tinylm.io.checkpoint import load_model, require_tokenizer_of

    model = load_model(model_dir, resolve_device(device))
    tokenizer = require_tokenizer_of(model_dir, "chat needs the model's tokenizer")
    return ChatSession(model, tokenizer, **settings)


def run_terminal(session: ChatSession, stdin: TextIO, stdout: TextIO) -> int:
    """The interactive loop on a terminal (or any text streams); returns an exit code."""
    interactive = stdin.isatty()
    if interactive:
        stdout.write(f"chatting with a {session.model.config.n_layer}-layer model "
                     f"(context {session.model.config.context_length} tokens); {HELP}\n")
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line:  # Ctrl-D / end of input
            stdout.write("\n")
            stdout.flush()
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.startswith("/") and _command(session, text, stdout):
            continue
        stdout.write("assistant> ")
        stdout.flush()
        try:
            for piece in session.reply(text, note=lambda s: stdout.write(s + "\n")):
                stdout.write(piece)
                stdout.flush()
        except TinyLMError as exc:
            stdout.write(f"(error: {exc})")
        stdout.write("\n")
        stdout.flush()


def _command(session: ChatSession, text: str, stdout: TextIO) -> bool:
    """Run a /command; False when ``text`` is not one (then it is sent as a message)."""
    name, _, arg = text.partition(" ")
    if name == "/reset":
        session.reset()
        stdout.write("(conversation cleared)\n")
    elif name == "/system":
        session.system = arg.strip() or None
        stdout.write(f"(system message {'set' if session.system else 'removed'})\n")
    elif name == "/temperature":
        try:
            session.set_temperature(float(arg))
            stdout.write(f"(temperature {session.temperature:g})\n")
        except (ValueError, ConfigError):
            stdout.write(f"(temperature must be a number in [0, 100], got {arg.strip()!r})\n")
    elif name == "/help":
        stdout.write(HELP + "\n")
    else:
        return False
    stdout.flush()
    return True


__all__ = ["ChatSession", "open_session", "run_terminal"]
