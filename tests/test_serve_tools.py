"""Tool calls on a live server with a tiny chat model, through the official ``openai``
client: forced calls (``required``, a named function) at temperature 1 over seeds are
always calls of an offered tool whose arguments validate against its parameters
(``jsonschema``); streamed, the client's own accumulation (``chat.completions.stream``)
assembles the same call; ``none`` shows the model no tools; the request fields are
checked (400s naming them); the prompt renders tools through a template that takes
them, or in the system message; "auto" replies are parsed as calls or text, streamed
deltas assembled by ``openai``'s ``ChatCompletionStreamState``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from serve_support import (
    TEXT,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from test_serve_structured import MODEL, USER, alone, chat_tokenizer
from tinylm.data.templates import TokenizerSettings
from tinylm.data.tokenizers import BPETokenizer
from tinylm.serve.tools import CallStream, ToolSpec, chat_prompt, parse_tools, reply_message

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model, _ = tiny_model_and_tokenizer(context_length=1024)  # the tools' signatures are long
    with live_server(model, tok, model_name=MODEL, max_tokens=200) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), url, model, tok


def _valid_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_forced_calls_are_valid_calls_of_the_offered_tools(served) -> None:
    client = served[0]
    names = set()
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice="required", temperature=1, seed=seed,
                                           max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _valid_call(choice.message.tool_calls[0])
        names.add(choice.message.tool_calls[0].function.name)
        r = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, temperature=1, seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "add"}})
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "add"
        _valid_call(call)
    assert names <= set(PARAMS)


def test_a_streamed_forced_call_is_assembled_by_the_client(served) -> None:
    client = served[0]
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", temperature=1,
              seed=2, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(deltas) > 1  # the arguments came in pieces, as they were generated
    assert final.finish_reason == "tool_calls"
    got, want = final.message.tool_calls[0], whole.message.tool_calls[0]
    assert got.function.name == want.function.name
    assert json.loads(got.function.arguments) == json.loads(want.function.arguments)
    _valid_call(got)


def test_tool_choice_none_shows_no_tools_and_auto_shows_them(served) -> None:
    client, _, model, tok = served
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=30)
    assert r.choices[0].message.content == alone(model, tok, USER, 30)
    assert r.choices[0].message.tool_calls is None
    plain = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                           max_tokens=5)
    auto = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                          temperature=0, max_tokens=5)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the signatures


def test_a_tool_result_is_taken_back(served) -> None:
    client, _, model, tok = served
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=20)
    as_text = [*USER, {"role": "assistant", "content":
                       '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'},
               {"role": "user", "content": "<tool_response>5</tool_response>"}]
    assert r.choices[0].message.content == alone(model, tok, as_text, 20)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": "x"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [*USER, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[1].tool_calls"),
])
def test_malformed_tool_fields_are_400s_naming_them(served, body, param) -> None:
    r = httpx.post(served[1] + "/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 5, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_template_that_takes_tools_renders_them() -> None:
    template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
                "{{ c.function.arguments.a }}{% endfor %}\n{% endfor %}assistant:")
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=["<|endoftext|>"])
    tok = tok.with_settings(TokenizerSettings(chat_template=template))
    spec = parse_tools({"tools": TOOLS})
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 4}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "9"}]
    text = tok.decode(chat_prompt(tok, messages, spec))
    assert text == ("TOOLS get_weather,add\nuser: The cat sat on the mat.assistant: CALL add4"
                    "tool: 9assistant:")  # (a newline after a block tag is trimmed)


def _assemble(spec: ToolSpec, pieces: list[str]):
    """The chunks a CallStream makes of ``pieces``, through openai's own accumulator."""
    state = ChatCompletionStreamState()
    stream = CallStream(spec)
    deltas = [{"role": "assistant", "content": ""}]
    for p in pieces:
        deltas += stream.push(p)
    last, reason = stream.finish("stop")
    deltas += last
    for k, d in enumerate([*deltas, {}]):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": None if k < len(deltas)
                         else reason}]}))
    return state.get_final_completion().choices[0]


def test_auto_replies_are_parsed_as_calls_or_text() -> None:
    spec = parse_tools({"tools": TOOLS})
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    message, reason = reply_message(text, spec, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    final = _assemble(spec, [text[i:i + 5] for i in range(0, len(text), 5)])
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.name == "add"
    assert json.loads(final.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    for plain in ("<tool>no", "The answer is 3.", "<tool_call>{broken</tool_call>"):
        assert reply_message(plain, spec, "stop") == ({"role": "assistant", "content": plain},
                                                     "stop")
        final = _assemble(spec, [plain[:3], plain[3:]])
        assert final.message.content == plain and final.finish_reason == "stop"
