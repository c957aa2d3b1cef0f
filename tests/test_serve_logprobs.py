"""Log-probabilities of ``tinylm serve`` in OpenAI's exact shapes, through the official
``openai`` client (its pydantic types, validated strictly), on chat and completions,
streamed and not, greedy and sampled (temperature 1, a seed, n > 1). The oracle: the
log_softmax of the reference model's full forward logits (``model(ids)`` over the prompt
and the generated tokens, restricted to the tokenizer's ids) at each position; each
chosen token's log-probability and each top list must equal it within 1e-4, the top lists
sorted and of the asked length. Which tokens were generated is read from the answer
itself (chat: each token's raw ``bytes``), or (completions, whose tokens are only text)
from ``tinylm.generate`` with the same seed, which the token texts must then spell."""

from __future__ import annotations

import openai
import pytest
import torch
import torch.nn.functional as F
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from serve_support import (
    TEXT,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
)
from tinylm import generate
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data.chat import render_chat, stop_ids
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer

MODEL = "tiny-chat"
MESSAGES = [{"role": "user", "content": "Is the cat on the mat?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def served():
    """A tiny model with tinylm's chat template whose next-token distributions are
    neither flat nor one-hot (so sampling picks tokens other than the likeliest)."""
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=STANDARD_SPECIALS)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                            context_length=128, tie_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    with live_server(model, tok, model_name=MODEL, max_tokens=64) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        yield client, model, tok


def oracle(model, tok, ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference model's logits over ``ids`` (T, tokenizer's V)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0, :, :tok.vocab_size]
    return F.log_softmax(logits.float(), dim=-1)


def by_bytes(tok) -> dict[bytes, int]:
    table = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    assert len(table) == tok.vocab_size  # every token's bytes name it alone
    return table


def reference_ids(model, tok, prompt: list[int], max_tokens: int, seed: int | None,
                  ends: list[int]) -> list[int]:
    kw = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    out = generate(model, prompt, max_tokens, stop_ids=ends, vocab_size=tok.vocab_size, **kw)
    ids = out[0, len(prompt):].tolist()
    for end in ends:  # rows that stopped are padded with their stop id
        if end in ids:
            ids = ids[:ids.index(end) + 1]
    return ids


CASES = [pytest.param(False, None, 1, id="greedy"),
         pytest.param(False, 11, 3, id="sampled-n3"),
         pytest.param(True, None, 1, id="greedy-stream"),
         pytest.param(True, 11, 3, id="sampled-n3-stream")]


def _chat_entries(client, stream: bool, seed: int | None, n: int, k: int) -> list[list]:
    """Each choice's logprobs.content entries, from one request (chunks joined)."""
    kw = {"temperature": 0} if seed is None else {"temperature": 1, "seed": seed, "n": n}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                       logprobs=True, top_logprobs=k, stream=stream, **kw)
    entries: list[list] = [[] for _ in range(n)]
    if not stream:
        ChatCompletion.model_validate(r.model_dump())  # the exact shape, strictly
        assert len(r.choices) == n
        for c in r.choices:
            entries[c.index] = list(c.logprobs.content)
        assert r.usage.completion_tokens == sum(len(e) for e in entries)
        return entries
    for chunk in r:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                entries[c.index] += c.logprobs.content
    return entries


@pytest.mark.parametrize(("stream", "seed", "n"), CASES)
def test_chat_logprobs_are_the_reference_log_softmax(served, stream, seed, n):
    client, model, tok = served
    k = 5
    prompt = render_chat(tok, MESSAGES, add_generation_prompt=True)
    ends = sorted(set(stop_ids(tok)) | {tok.eos_id})
    ids_of = by_bytes(tok)
    not_top = 0
    for j, entries in enumerate(_chat_entries(client, stream, seed, n, k)):
        assert entries, "no logprobs for a choice"
        ids = [ids_of[bytes(e.bytes)] for e in entries]
        assert [e.token for e in entries] == [tok.id_to_token(i) for i in ids]
        want = reference_ids(model, tok, prompt, 16, None if seed is None else seed + j, ends)
        assert ids == want  # the tokens generated are tinylm.generate's
        logp = oracle(model, tok, prompt + ids)
        for t, (e, i) in enumerate(zip(entries, ids, strict=True)):
            row = logp[len(prompt) - 1 + t]
            assert e.logprob == pytest.approx(float(row[i]), abs=TOL)
            tops = e.top_logprobs
            assert len(tops) == k
            values = [x.logprob for x in tops]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx(torch.topk(row, k).values.tolist(), abs=TOL)
            for x in tops:
                assert x.logprob == pytest.approx(float(row[ids_of[bytes(x.bytes)]]), abs=TOL)
                assert x.token == tok.id_to_token(ids_of[bytes(x.bytes)])
            not_top += e.logprob < values[0] - TOL
    if seed is not None:
        assert not_top > 0  # sampling chose tokens other than the likeliest


def _completion_logprobs(client, stream: bool, seed: int | None, n: int, k: int) -> list:
    """Each choice's (tokens, token_logprobs, top_logprobs, text_offset, text)."""
    kw = {"temperature": 0} if seed is None else {"temperature": 1, "seed": seed, "n": n}
    r = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=16,
                                  logprobs=k, stream=stream, **kw)
    out = [([], [], [], [], "") for _ in range(n)]
    for part in ([r] if not stream else r):
        if not stream:  # (OpenAI's streamed chunks have finish_reason null: not its type)
            Completion.model_validate(part.model_dump())
        for c in part.choices:
            toks, lps, tops, offs, text = out[c.index]
            if c.logprobs is not None:
                Logprobs.model_validate(c.logprobs.model_dump())  # strictly, in chunks too
                toks += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offs += c.logprobs.text_offset
            out[c.index] = (toks, lps, tops, offs, text + c.text)
    return out


@pytest.mark.parametrize(("stream", "seed", "n"), CASES)
@pytest.mark.parametrize("k", [5, 20])
def test_completion_logprobs_are_the_reference_log_softmax(served, stream, seed, n, k):
    client, model, tok = served
    prompt = tok.encode("The cat sat")
    choices = _completion_logprobs(client, stream, seed, n, k)
    for j, (tokens, lps, tops, offsets, text) in enumerate(choices):
        ids = reference_ids(model, tok, prompt, 16, None if seed is None else seed + j,
                            [tok.eos_id])
        assert tokens == [tok.decode([i]) for i in ids]
        assert offsets == [sum(len(s) for s in tokens[:t]) for t in range(len(tokens))]
        assert text == tok.decode(ids[:-1] if ids[-1] == tok.eos_id else ids)
        logp = oracle(model, tok, prompt + ids)
        for t, i in enumerate(ids):
            row = logp[len(prompt) - 1 + t]
            assert lps[t] == pytest.approx(float(row[i]), abs=TOL)
            top = torch.topk(row, k)
            want: dict[str, float] = {}  # tokens of one text share a key: the likelier
            for v, w in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                want.setdefault(tok.decode([w]), v)
            assert list(tops[t]) == list(want)  # the same keys, in descending order
            assert list(tops[t].values()) == pytest.approx(list(want.values()), abs=TOL)


def test_top_logprobs_limits(served):
    client = served[0]
    r = client.completions.create(model=MODEL, prompt="The", max_tokens=1, logprobs=20,
                                  temperature=0)
    assert len(r.choices[0].logprobs.token_logprobs) == 1
    for body in ({"logprobs": 21}, {"logprobs": -1}):
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model=MODEL, prompt="The", max_tokens=1, **body)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       logprobs=True, top_logprobs=21)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                       logprobs=True, temperature=0)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                       temperature=0)
    assert r.choices[0].logprobs is None
