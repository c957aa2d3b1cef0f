"""Structured output on a live server with a tiny chat model: every reply held by a
random JSON schema, at temperature 1 over many seeds, parses and validates
(``jsonschema``), while unconstrained requests decoding in the same batches answer what
they answer alone; regex and Lark grammars hold too; what llguidance refuses is a 400
naming the field. The grammar engine's view of a tokenizer (each id's bytes) is checked
against the tokenizer's own decoding, for byte-level BPE and a char tokenizer."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from serve_support import (
    TEXT,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm import generate
from tinylm.data.chat import render_chat, stop_ids
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer, CharTokenizer
from tinylm.serve.constrain import GrammarEngine, OutputSpec

MODEL = "tiny"
USER = [{"role": "user", "content": "The cat sat on the mat."}]


def chat_tokenizer() -> BPETokenizer:
    return BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=STANDARD_SPECIALS)


@pytest.fixture(scope="module")
def served():
    tok = chat_tokenizer()
    model, _ = tiny_model_and_tokenizer(context_length=512)
    with live_server(model, tok, model_name=MODEL, max_tokens=200) as (url, server):
        yield url, model, tok


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of random properties: string (bounded length), integer and
    number (bounded), boolean, enum, array (bounded), nested object; a random required
    list; no other properties (so every reply is bounded and ends)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 1:
        kinds.append("object")
    props = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            p = {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
        elif kind == "integer":
            lo = rng.randint(-100, 100)
            p = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
        elif kind == "number":
            p = {"type": "number", "minimum": -10, "maximum": 10}
        elif kind == "boolean":
            p = {"type": "boolean"}
        elif kind == "enum":
            p = {"enum": rng.sample(["red", "green", "blue", "cat", "mat"], rng.randint(1, 3))}
        elif kind == "array":
            p = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
        else:
            p = random_schema(rng, depth + 1)
        props[f"p{k}_{kind}"] = p
    required = [name for name in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def alone(model, tok, messages, max_tokens: int) -> str:
    """The greedy reply tinylm.generate gives the conversation alone."""
    ids = render_chat(tok, messages)
    stops = stop_ids(tok)
    out = generate(model, ids, max_tokens, temperature=0, stop_ids=stops,
                   vocab_size=tok.vocab_size)[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    return tok.decode(out[:cut])


def test_random_schemas_always_validate_beside_unconstrained_rows(served) -> None:
    url, model, tok = served
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(8)]
    plain = [[{"role": "user", "content": t}] for t in ("A dog ran", "Numbers 0123", "Café")]

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        held = [c.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=200, temperature=1, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{k}", "schema": s, "strict": True}})
            for k, s in enumerate(schemas) for seed in range(3)]
        free = [c.chat.completions.create(model=MODEL, messages=m, max_tokens=30,
                                          temperature=0) for m in plain]
        return await asyncio.gather(*held, *free)

    answers = asyncio.run(run())
    for k, r in enumerate(answers[:len(schemas) * 3]):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schemas[k // 3])
    texts = [r.choices[0].message.content for r in answers[len(schemas) * 3:]]
    assert texts == [alone(model, tok, m, 30) for m in plain]


def test_json_object_regex_and_lark_grammar_hold(served) -> None:
    url, _, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    pattern = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]*)?"
    lark = 'start: "(" item (", " item)* ")"\nitem: /[0-9]{1,3}/ | "cat" | "mat"'
    for seed in range(4):
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=1,
                                      seed=seed, extra_body={"regex": pattern})
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, r.choices[0].message.content)
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=1,
                                      seed=seed, extra_body={"grammar": lark})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":  # a list may run to max_tokens
            assert re.fullmatch(r"\((?:[0-9]{1,3}|cat|mat)(?:, (?:[0-9]{1,3}|cat|mat))*\)", text)
        else:
            assert re.fullmatch(r"\((?:[0-9]{1,3}|cat|mat)(?:, (?:[0-9]{1,3}|cat|mat))*,?"
                                r" ?[0-9a-z]*", text)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, temperature=0,
                                  response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_streamed_constrained_reply_equals_the_non_streamed_one(served) -> None:
    url, _, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    schema = random_schema(random.Random(5))
    kw = dict(model=MODEL, messages=USER, max_tokens=200, temperature=1, seed=3,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "s", "schema": schema}})
    whole = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole), schema)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"regex": "[a-z]+("}, "regex"),
    ({"regex": 5}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"regex": "a", "grammar": "start: \"a\""}, "grammar"),
])
def test_what_llguidance_refuses_is_a_400_naming_the_field(served, body, param) -> None:
    url, _, _ = served
    r = httpx.post(url + "/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 5, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]


def test_a_constrained_rows_logprobs_are_the_models_own(served) -> None:
    """The logprobs of a constrained reply are the model's log_softmax before the mask:
    the top alternatives include tokens the grammar refused (digits, here)."""
    url, _, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0,
                                  logprobs=True, top_logprobs=20, extra_body={"regex": "[0-9]+"})
    entries = r.choices[0].logprobs.content
    assert re.fullmatch("[0-9]+", r.choices[0].message.content)
    assert any(not re.fullmatch("[0-9]*", t.token) for e in entries for t in e.top_logprobs)
    for e in entries:  # the chosen token is one of the model's, scored by it
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6


def _walk(engine: GrammarEngine, tok, spec: OutputSpec, seed: int) -> list[int]:
    """Random tokens, each drawn from the grammar's mask, until the grammar ends."""
    con = engine.constraints(spec, 1)[0]
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(200):
        allowed = con.allowed().nonzero().flatten()
        t = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
        ids.append(t)
        if con.advance(t) is not None or t in engine_ends(tok):
            break
    return ids


def engine_ends(tok) -> set[int]:
    return {tok.eos_id} if tok.eos_id is not None else set()


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_the_grammar_engines_tokenizer_is_the_models(kind) -> None:
    if kind == "bpe":
        tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=["<|endoftext|>"])
    else:
        tok = CharTokenizer(sorted(set(TEXT)), special_tokens=["<|endoftext|>"])
    engine = GrammarEngine(tok, [tok.eos_id])
    rng = random.Random(1)
    for _ in range(20):  # llguidance decodes ids to the bytes tinylm decodes them to
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        ids = [i for i in ids if i != tok.eos_id]
        raw = engine.tokenizer.decode_bytes(ids)  # bytes; tinylm's text has U+FFFD for broken
        assert raw.decode("utf-8", errors="replace") == tok.decode(ids)
    assert engine.tokenizer.is_special_token(tok.eos_id)
    pattern = r"(cat|mat|dog) [0-9]{2}"
    for seed in range(5):
        ids = _walk(engine, tok, OutputSpec("regex", pattern, "regex"), seed)
        text = tok.decode([i for i in ids if i != tok.eos_id])
        assert re.fullmatch(pattern, text), text
