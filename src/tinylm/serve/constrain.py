"""Structured output: replies held to a JSON schema, a regex or a Lark grammar.

A request's ``response_format`` (``json_object``, ``json_schema``), or the extension
fields ``regex`` and ``grammar``, becomes a grammar of `llguidance
<https://github.com/guidance-ai/llguidance>`_ (``pip install 'tinylm[serve]'``), and each
of the request's sequences gets a :class:`Constraint`: an ``LLMatcher`` over the
model's own vocabulary. At every decoding step the engine asks the constraint for the
tokens the grammar allows next (a bitmask llguidance computes with the GIL released, in
a worker thread while the batched forward runs), sets the other tokens' logits to -inf
before sampling or argmax, and feeds it the chosen token; when the grammar can only
end, the sequence ends with ``finish_reason: "stop"``. So a finished reply always
matches: it parses and validates against the schema.

llguidance's tokenizer is built once per tinylm tokenizer (:func:`grammar_engine`,
cached), from each id's bytes (:meth:`tinylm.data.tokenizers.Tokenizer.token_bytes`),
its special ids and the ids that end a reply; grammars are compiled off the event loop,
before the request reaches the engine, so the engine thread never compiles.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tinylm.serve.engine import End
from tinylm.serve.schemas import RequestError

#: JSON as ``json.dumps`` writes it: ", " and ": " between items, no other whitespace
#: (so a reply cannot run on in whitespace, and always ends within a bounded schema).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class OutputSpec:
    """What a reply must match: ``kind`` is "json_schema" (``source`` the schema),
    "regex" or "grammar" (``source`` the text); ``param`` the request field it came from."""

    kind: str
    source: Any
    param: str


def _require_llguidance():
    try:
        import llguidance
    except ImportError as exc:
        raise RequestError("structured output needs the llguidance package on the server "
                           "(pip install 'tinylm[serve]'); send the request without "
                           "response_format, regex or grammar", status=501,
                           code="not_implemented") from exc
    return llguidance


def _response_format(v: Any) -> OutputSpec | None:
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(v, dict) or v.get("type") not in kinds:
        raise RequestError(f"'response_format' must be an object with 'type' one of "
                           f"{', '.join(kinds)}; got {str(v)[:80]}", param="response_format")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return OutputSpec("json_schema", {"type": "object"}, "response_format")
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError("'response_format.json_schema' must be an object with a string "
                           "'name' and a 'schema' object", param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise RequestError(f"'response_format.json_schema.schema' must be a JSON schema "
                           f"object, got {str(schema)[:80]}",
                           param="response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"'response_format.json_schema.strict' must be true or false, got "
                           f"{strict!r}", param="response_format.json_schema.strict")
    return OutputSpec("json_schema", schema, "response_format.json_schema.schema")


def parse_output(body: dict[str, Any]) -> OutputSpec | None:
    """The request's output constraint (``response_format``, or the extensions ``regex``
    and ``grammar``: at most one of them), None without one; a 400 naming the field
    when it is malformed."""
    given = [k for k in ("response_format", "regex", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"send at most one of 'response_format', 'regex' and 'grammar' "
                           f"(got {', '.join(given)})", param=given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(body[name])
    v = body[name]
    if not isinstance(v, str) or not v:
        what = "a regular expression" if name == "regex" else "a Lark grammar (llguidance's)"
        raise RequestError(f"'{name}' must be a non-empty string: {what}", param=name)
    return OutputSpec(name, v, name)


class _Vocab:
    """tinylm's tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes,
    the special ids, an end-of-sequence id, and an encoder of bytes."""

    def __init__(self, tokenizer: Any, end: int) -> None:
        self._tok = tokenizer
        specials = {tokenizer.token_to_id(t) for t in tokenizer.special_tokens}
        self.special_token_ids = sorted(i for i in specials if i is not None)
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        if end == len(self.tokens):  # no end id of its own: a virtual one past the logits
            self.tokens.append(b"<|tinylm-end|>")
            self.special_token_ids.append(end)
        self.eos_token_id = end
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"))


class GrammarEngine:
    """llguidance's tokenizer for one tinylm tokenizer, and the matchers made with it.
    ``ends`` are the ids that end a reply (a grammar allows them once it is complete)."""

    def __init__(self, tokenizer: Any, ends: Sequence[int]) -> None:
        llg = _require_llguidance()
        self.vocab_size = tokenizer.vocab_size
        ends = sorted(set(ends)) or [self.vocab_size]
        vocab = _Vocab(tokenizer, ends[0])
        self.llg = llg
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens),
                                         eos_token=ends)

    def grammar(self, spec: OutputSpec) -> str:
        """The llguidance grammar of ``spec``; a 400 with llguidance's reason when it
        refuses it."""
        M = self.llg.LLMatcher
        try:
            if spec.kind == "json_schema":
                grammar = M.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = M.grammar_from_regex(spec.source)
            else:
                grammar = M.grammar_from_lark(spec.source)
            failed, messages = M.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError) as exc:
            failed, messages = True, [str(exc)]
        if failed:
            reason = " ".join(" ".join(messages).split())[:300]
            raise RequestError(f"'{spec.param}' is not a {_what(spec)} this server can "
                               f"enforce: {reason}", param=spec.param, code="invalid_grammar")
        return grammar

    def constraints(self, spec: OutputSpec, n: int) -> list[Constraint]:
        """``n`` fresh constraints of ``spec`` (one per sequence); compiles, so call it off
        the event loop (``asyncio.to_thread``)."""
        grammar = self.grammar(spec)
        return [Constraint(self.llg.LLMatcher(self.tokenizer, grammar, log_level=0),
                           self.vocab_size, self.tokenizer.vocab_size) for _ in range(n)]


def _what(spec: OutputSpec) -> str:
    return {"json_schema": "JSON schema", "regex": "regular expression"}.get(
        spec.kind, "Lark grammar")


_engines: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], GrammarEngine]] = \
    weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def grammar_engine(tokenizer: Any, ends: Sequence[int]) -> GrammarEngine:
    """The one :class:`GrammarEngine` of ``tokenizer`` with end ids ``ends``, built on first
    use (about a second for a 50k vocabulary; call it off the event loop) and kept as
    long as the tokenizer."""
    key = tuple(sorted(set(ends)))
    with _engines_lock:
        found = _engines.setdefault(tokenizer, {})
        if key not in found:
            found[key] = GrammarEngine(tokenizer, key)
        return found[key]


class Constraint:
    """One sequence's grammar state, used by the engine's thread (and its mask worker):
    :meth:`fill` computes the allowed tokens, :meth:`apply` masks a row of logits,
    :meth:`advance` takes the chosen token. ``mask_seconds`` records each mask's time."""

    def __init__(self, matcher: Any, vocab_size: int, mask_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's ids (mask_size: llguidance's, >=)
        self.words = np.zeros(((mask_size + 31) // 32,), dtype=np.int32)
        self._filled = False
        self.mask_seconds: list[float] = []

    def fill(self) -> None:
        """Compute the next allowed-token bitmask (llguidance releases the GIL)."""
        if self._filled:
            return
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self.mask_seconds.append(time.perf_counter() - start)
        self._filled = True

    def allowed(self) -> Tensor:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        self.fill()
        words = torch.from_numpy(self.words)
        bits = (words[:, None] >> _SHIFTS) & 1  # (W, 32): bit j of word i is token 32i + j
        return bits.reshape(-1)[:self.vocab_size].bool()

    def apply(self, logits: Tensor) -> Tensor | None:
        """A copy of ``logits`` (1, V) with every token the grammar refuses at -inf; None
        when it allows none of the model's tokens (a dead end: see :meth:`error`)."""
        allowed = self.allowed()[:logits.shape[-1]]
        if not bool(allowed.any()):
            return None
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> End | None:
        """Take the chosen token: End("stop") when the grammar is complete and can only
        end, an error End if it refuses the token (never, for a token :meth:`apply`
        allowed), else None."""
        self._filled = False
        if not self.matcher.consume_token(token):
            return End("error", self.error())
        return End("stop") if self.matcher.is_stopped() else None

    def error(self) -> str:
        why = self.matcher.get_error() or "no token of this model's vocabulary can continue it"
        return f"the output grammar cannot continue: {why}"


def constraints_for(tokenizer: Any, spec: OutputSpec | None, ends: Sequence[int], n: int
                    ) -> list[Constraint] | None:
    """``n`` constraints of ``spec`` over ``tokenizer`` whose replies end at ``ends`` (None
    without a spec): builds the grammar engine on first use and compiles, so call it
    off the event loop."""
    if spec is None:
        return None
    return grammar_engine(tokenizer, ends).constraints(spec, n)
