"""Tool calls on ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- **Offered** (``tool_choice`` "auto", "required" or a named function): a chat template
  that takes ``tools`` (transformers' convention: it reads a ``tools`` variable) renders
  them itself; any other template gets them in the system message, as JSON signatures
  with the instruction to answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the Hermes/Qwen format; :data:`TOOLS_PROMPT`). Earlier calls and ``tool`` results are
  rendered as that text too (a result as ``<tool_response>...</tool_response>`` in a user
  turn), or handed to a template that takes tools as transformers does.
- **Forced** ("required" or a named function): the reply is held by a JSON schema (see
  :mod:`tinylm.serve.constrain`) to one bare call ``{"name": ..., "arguments": {...}}``
  whose arguments validate against the tool's ``parameters``. At most one call per
  reply.
- **auto**: the reply is free; when it begins with ``<tool_call>`` its calls (one or
  more blocks) are parsed, else it is text. **none**: no tools are shown to the model.

A parsed reply becomes OpenAI's ``message.tool_calls`` (``id`` "call_...", ``type``
"function", ``function.arguments`` a JSON string), ``content`` null and
``finish_reason`` "tool_calls"; streamed, as the deltas the ``openai`` client assembles
(:class:`CallStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tinylm.data.chat import render_chat, template_ids
from tinylm.serve.constrain import OutputSpec
from tinylm.serve.schemas import RequestError

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]+)", "arguments": ')

#: What a template without tools support is given, in (or as) the system message.
TOOLS_PROMPT = ("You can call these functions (JSON signatures):\n{signatures}\n"
                "To call one, reply with only <tool_call>{{\"name\": FUNCTION, \"arguments\": "
                "{{...}}}}</tool_call>. Its result comes back as "
                "<tool_response>...</tool_response>.")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def signature(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}

    def openai(self) -> dict[str, Any]:
        """The tool as transformers hands it to a chat template."""
        return {"type": "function", "function": self.signature()}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and its choice: "auto", "none", "required" or "function"
    (then ``name`` is the function it must call)."""

    tools: tuple[Tool, ...]
    choice: str
    name: str | None = None

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def output(self) -> OutputSpec:
        """A forced reply's schema: one call of the chosen tool (or of any, for
        "required") with arguments valid against its parameters."""
        tools = [t for t in self.tools if self.choice != "function" or t.name == self.name]
        calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                                   "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in tools]
        return OutputSpec("json_schema", calls[0] if len(calls) == 1 else {"anyOf": calls},
                          "tools")


def output_of(output: OutputSpec | None, tools: ToolSpec | None) -> OutputSpec | None:
    """What holds a chat reply: the forced call's schema, else the request's
    response_format / regex / grammar; a 400 when both are asked for."""
    if tools is None or not tools.forced:
        return output
    if output is not None:
        raise RequestError(f"a forced tool call (tool_choice {tools.choice!r}) and "
                           f"'{output.param.split('.')[0]}' cannot both hold the reply; send "
                           f"one of them", param="tool_choice")
    return tools.output()


def _tool(i: int, v: Any) -> Tool:
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not _NAME.fullmatch(fn["name"]):
        raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": 1-64 of a-z A-Z 0-9 _ -, \"description\", "
                           f"\"parameters\": a JSON schema}}}}", param=f"tools[{i}]")
    description = fn.get("description", "")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str) or not isinstance(params, dict):
        raise RequestError(f"tools[{i}].function: 'description' must be a string and "
                           f"'parameters' a JSON schema object", param=f"tools[{i}].function")
    return Tool(fn["name"], description, params)


def _choice(v: Any, names: Sequence[str]) -> tuple[str, str | None]:
    if v in ("auto", "none", "required"):
        return v, None
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got "
                           f"{str(v)[:80]}", param="tool_choice")
    if fn["name"] not in names:
        raise RequestError(f"'tool_choice' names the function {fn['name']!r}, which is not in "
                           f"'tools' ({', '.join(names) or 'none given'})", param="tool_choice")
    return "function", fn["name"]


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """The request's tools and tool_choice (None without tools); a 400 naming the field
    when one is malformed."""
    raw = body.get("tools")
    if raw is not None and (not isinstance(raw, list) or len(raw) > MAX_TOOLS):
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} functions",
                           param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or []))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise RequestError("'tools' has two functions of the same name", param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"'parallel_tool_calls' must be true or false, got {parallel!r}",
                           param="parallel_tool_calls")
    given = body.get("tool_choice")
    if given is None:
        return ToolSpec(tools, "auto") if tools else None
    choice, name = _choice(given, names)
    if choice != "none" and not tools:
        raise RequestError(f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
    return ToolSpec(tools, choice, name)


# --- the prompt -------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _reads_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (it renders tools itself)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_message(m: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A message as transformers hands it to a template that takes tools."""
    out = dict(m)
    if "tool_calls" in m:
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in m["tool_calls"]]
    if m["role"] == "tool" and m["tool_call_id"] in names:
        out["name"] = names[m["tool_call_id"]]
    return out


def _text_message(m: dict[str, Any]) -> dict[str, str]:
    """A message in plain roles: calls as <tool_call> text, results as a user turn."""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>{m['content']}</tool_response>"}
    calls = "".join(OPEN + json.dumps({"name": c["function"]["name"], "arguments": _arguments(
        c["function"]["arguments"])}, ensure_ascii=False) + CLOSE for c in m.get("tool_calls", ()))
    return {"role": m["role"], "content": m["content"] + calls}


def _with_tools_prompt(messages: list[dict[str, str]], tools: Sequence[Tool]
                       ) -> list[dict[str, str]]:
    text = TOOLS_PROMPT.format(signatures=json.dumps([t.signature() for t in tools],
                                                     ensure_ascii=False))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], spec: ToolSpec | None
                ) -> list[int]:
    """The ids of a conversation that may offer tools and carry calls and results."""
    offered = spec is not None and spec.offered
    if not offered and not any("tool_calls" in m or m["role"] == "tool" for m in messages):
        return render_chat(tokenizer, list(messages), add_generation_prompt=True)
    template = tokenizer.own_template
    if template is not None and _reads_tools(template):
        names = {c["id"]: c["function"]["name"] for m in messages
                 for c in m.get("tool_calls", ())}
        tools = [t.openai() for t in spec.tools] if offered else None
        return template_ids(tokenizer, [_template_message(m, names) for m in messages],
                            True, tools)
    plain = [_text_message(m) for m in messages]
    return render_chat(tokenizer, _with_tools_prompt(plain, spec.tools) if offered else plain,
                       add_generation_prompt=True)


# --- the reply --------------------------------------------------------------------------------


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(text: str, spec: ToolSpec) -> list[dict[str, Any]] | None:
    """The calls in a finished reply, or None when it is text (or a cut-off call)."""
    if spec.forced:
        bodies = [text]
    elif text.lstrip().startswith(OPEN):
        bodies = _CALLS.findall(text)
    else:
        return None
    names = {t.name for t in spec.tools}
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in names \
                or not isinstance(call.get("arguments"), dict):
            return None
        calls.append(_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return calls or None


def reply_message(text: str, spec: ToolSpec | None, finish_reason: str
                  ) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of a finished reply."""
    calls = parse_calls(text, spec) if spec is not None and spec.offered \
        and finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


class CallStream:
    """One streamed choice's text as chat deltas: ``content`` pieces, or a tool call's
    deltas as the ``openai`` client assembles them (the call's ``index``, ``id``,
    ``type`` and ``function.name`` with empty ``arguments`` first, then the arguments in
    pieces). A forced call streams its arguments as they are generated; in "auto" a
    reply that begins with ``<tool_call>`` is held and sent as calls when it ends."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""  # all text so far
        self.sent = 0  # characters of text already sent (as content or arguments)
        self.mode = "forced" if spec.forced else "undecided"

    def push(self, piece: str) -> list[dict[str, Any]]:
        """The deltas ``piece`` (new text) makes sendable now."""
        self.text += piece
        if self.mode == "undecided":
            head = self.text.lstrip()
            if OPEN.startswith(head) or head.startswith(OPEN):
                return []  # perhaps (or surely) a call: held to the end
            self.mode = "content"
        if self.mode == "content":
            return self._content(len(self.text))
        if self.mode == "forced":
            found = _HEAD.match(self.text)
            if found is None:
                return []
            self.mode, self.sent = "arguments", found.end()
            return [{"tool_calls": [dict(_call(found[1], ""), index=0)]}]
        # arguments: all but the last character, which may be the call's closing brace
        return self._arguments(len(self.text) - 1)

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent:end], max(end, self.sent)
        return [{"content": piece}] if piece else []

    def _arguments(self, end: int) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent:end], max(end, self.sent)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece \
            else []

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the choice's finish_reason."""
        if self.mode == "arguments":
            end = len(self.text) - 1 if finish_reason == "stop" else len(self.text)
            return self._arguments(end), "tool_calls" if finish_reason == "stop" \
                else finish_reason
        message, reason = reply_message(self.text, self.spec, finish_reason)
        if self.mode == "content" or message["content"] is not None:
            return self._content(len(self.text)), finish_reason
        deltas = []
        for k, call in enumerate(message["tool_calls"]):
            deltas.append({"tool_calls": [dict(call, index=k, function={
                "name": call["function"]["name"], "arguments": ""})]})
            deltas.append({"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]})
        return deltas, reason
