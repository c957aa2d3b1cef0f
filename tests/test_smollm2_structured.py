"""Structured output and tool calls on the real SmolLM2-135M-Instruct (fixture
``smollm2_gguf``) through the official ``openai`` client: ``chat.completions.parse`` with
a pydantic model, and a two-step tool loop (a forced call, then the ``tool`` result sent
back and answered in text). SmolLM2's template does not take tools, so they go in the
system message; the grammar engine is built from SmolLM2's own 49k-token vocabulary."""

from __future__ import annotations

import json
import os
import random
from unittest import mock

import openai
import pytest
from pydantic import BaseModel

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
)
from tinylm.serve.constrain import grammar_engine

MODEL = "smollm2"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    from tinylm.io.checkpoint import load_checkpoint

    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(tmp_path_factory.mktemp("c"))}):
        model, tok = load_checkpoint(smollm2_gguf)
    with live_server(model, tok, model_name=MODEL) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), tok


def test_parse_with_a_pydantic_model(smollm2) -> None:
    client, tok = smollm2
    r = client.chat.completions.parse(
        model=MODEL, response_format=City, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    parsed = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(parsed, City)
    assert parsed.name == "Paris"
    engine = grammar_engine(tok, [tok.eos_id])  # SmolLM2's vocabulary, byte for byte
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    assert engine.tokenizer.decode_bytes(ids).decode("utf-8", "replace") == tok.decode(ids)


def test_a_two_step_tool_loop(smollm2) -> None:
    client, _ = smollm2
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER,
                                       tool_choice="required", temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER,
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "sunny" in choice.message.content
