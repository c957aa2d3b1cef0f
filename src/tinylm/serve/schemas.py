"""Request bodies of the OpenAI-style API, validated into plain dataclasses.

Every problem a client can cause raises :class:`RequestError` with OpenAI's error
fields (message, type, param, code) and an HTTP status, so the app answers a 4xx in
OpenAI's shape and never a 500. Unknown fields are ignored (clients such as Open
WebUI send extras); known fields must have the right type and range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from tinylm.core.checks import is_int, is_number
from tinylm.core.errors import TinyLMError
from tinylm.use.sampling import SamplingConfig

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_LOGPROBS = 20  # completions' logprobs (OpenAI: 5; the issue asks 20)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs


class RequestError(TinyLMError):
    """A client error: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """Server-side limits on every request."""

    context_length: int
    max_tokens: int = 256  # largest max_tokens a request may ask for
    max_n: int = 8  # choices per request
    max_body_bytes: int = 1 << 20
    max_prompts: int = 16  # prompts in one completions request


@dataclass(frozen=True)
class Generation:
    """What to generate, shared by completions and chat. ``logprobs`` None = none;
    k >= 0 = the chosen token's log-probability and the k most likely alternatives.
    ``max_tokens`` 0 (completions only) generates nothing."""

    max_tokens: int
    sampling: SamplingConfig
    n: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids
    echo: bool  # the prompt first in each choice's text (with logprobs: and its scores)
    gen: Generation


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]  # role, content; tool_calls, tool_call_id if sent
    gen: Generation


@dataclass(frozen=True)
class ExplainRequest:
    model: str | None
    prompt: str
    top_k: int


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise RequestError(f"the request body is not valid JSON ({exc}); send a JSON object "
                           f"with Content-Type: application/json") from exc
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    return body


# --- field checks -------------------------------------------------------------------------


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        top = f" and <= {hi}" if hi is not None else ""
        raise RequestError(f"'{name}' must be an integer >= {lo}{top}, got {v!r}", param=name)
    return v


def _num(body: dict, name: str, default: float | None, lo: float, hi: float,
         lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v, finite=True) or v > hi or v < lo or (lo_open and v == lo):
        side = "(" if lo_open else "["
        raise RequestError(f"'{name}' must be a number in {side}{lo}, {hi}], got {v!r}",
                           param=name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


def _model(body: dict) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise RequestError(f"'model' must be a string, got {v!r}", param="model")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) \
            or len(stops) > MAX_STOP:
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP} strings,"
                           f" got {v!r}", param="stop")
    return tuple(s for s in stops if s)


def _unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise RequestError(f"'{name}' is not supported by this server (only 0); leave it"
                               f" out", param=name)
    if body.get("logit_bias"):
        raise RequestError("'logit_bias' is not supported by this server; leave it out",
                           param="logit_bias")


def _generation(body: dict, limits: Limits, logprobs: int | None,
                default_max_tokens: int) -> Generation:
    _unsupported(body)
    max_tokens = _int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    max_tokens = _int(body, "max_tokens", max_tokens, 1, limits.max_tokens) or \
        min(default_max_tokens, limits.max_tokens)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", None, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", None, 1, None)
    seed = _int(body, "seed", None, -(2 ** 63), 2 ** 64 - 1)
    n = _int(body, "n", 1, 1, limits.max_n)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {options!r}",
                           param="stream_options")
    include_usage = _bool(options or {}, "include_usage")
    sampling = SamplingConfig(temperature, top_k, None if top_p == 1.0 else top_p)
    return Generation(max_tokens, sampling, n, _stop(body), None if seed is None
                      else seed % 2 ** 63, logprobs, stream, include_usage)


# --- the three bodies ---------------------------------------------------------------------


def _prompts(v: Any, limits: Limits) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a
    list of such lists."""
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and v and all(is_int(i) for i in v):
        return (tuple(v),)
    if isinstance(v, list) and v and len(v) <= limits.max_prompts and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_int(i) for i in p))
            for p in v):
        return tuple(p if isinstance(p, str) else tuple(p) for p in v)
    raise RequestError(f"'prompt' must be a string, a list of token ids, or a list of at most "
                       f"{limits.max_prompts} of those; got {json.dumps(v)[:80]}",
                       param="prompt")


def parse_completion(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    if "prompt" not in body:
        raise RequestError("'prompt' is required", param="prompt")
    prompts = _prompts(body["prompt"], limits)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _bool(body, "echo")
    # max_tokens 0: nothing generated (with echo and logprobs: only the prompt's scores,
    # what lm-evaluation-harness's loglikelihood asks of an OpenAI-style server)
    nothing = is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    gen = _generation({k: v for k, v in body.items() if k != "max_tokens"} if nothing
                      else body, limits, logprobs, default_max_tokens=16)
    if nothing:
        gen = replace(gen, max_tokens=0)
    if len(prompts) * gen.n > limits.max_n * limits.max_prompts:
        raise RequestError("too many choices (prompts x n); send fewer", param="n")
    return CompletionRequest(_model(body), prompts, echo, gen)


def _tool_calls(i: int, v: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, as OpenAI's client sends them back."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(v, list) or not v:
        raise RequestError(f"{param} must be a non-empty list of calls", param=param)
    out = []
    for call in v:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str) \
                or not isinstance(call.get("id", ""), str):
            raise RequestError(f"each of {param} must be {{\"id\", \"type\": \"function\", "
                               f"\"function\": {{\"name\", \"arguments\": a JSON string}}}}",
                               param=param)
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _message(i: int, m: Any) -> dict[str, Any]:
    """One chat message: a role and text content (OpenAI's text parts joined); an
    assistant's may carry ``tool_calls`` instead of content, a ``tool`` message its
    ``tool_call_id``."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'",
                           param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI's content parts: keep the text ones
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{i}].content parts must all be text parts",
                               param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(i, m["tool_calls"])
        out["content"] = content or ""
    elif not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string, got {content!r}",
                           param=f"messages[{i}].content")
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"messages[{i}] (role tool) needs 'tool_call_id', the id of "
                               f"the call it answers", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = call_id
    return out


def parse_chat(body: dict[str, Any], limits: Limits) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} "
                           "objects", param="messages")
    out = [_message(i, m) for i, m in enumerate(messages)]
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    gen = _generation(body, limits, logprobs, default_max_tokens=limits.max_tokens)
    return ChatRequest(_model(body), tuple(out), gen)


def parse_explain(body: dict[str, Any]) -> ExplainRequest:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", param="prompt")
    top_k = _int(body, "top_k", 5, 1, 50)
    return ExplainRequest(_model(body), prompt, top_k)
