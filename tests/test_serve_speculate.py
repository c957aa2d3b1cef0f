"""Prompt-lookup decoding (tinylm.serve.speculate, ``--speculate ngram``): the n-gram
proposer, and greedy answers equal to plain decoding — tokens, logprobs and ends, with
stop ids and max_tokens falling inside drafts, sampled rows beside them, rows sliding at
the context's end — with drafts actually accepted; live with the openai client, and on
SmolLM2 quoting its prompt."""

from __future__ import annotations

import os
import random
from unittest import mock

import httpx
import openai
import pytest
import torch

from serve_support import (
    layout_model,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    run_engine,
    tiny_model_and_tokenizer,
)
from tinylm.core.model import GPT
from tinylm.serve.engine import Engine
from tinylm.serve.speculate import NgramLookup
from tinylm.use.sampling import SamplingConfig


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def model(request):
    """A model that mostly follows a fixed next-token rule, token t -> PERM[t] (its LM
    head reads the token embedding back through a permutation), which attention's
    context overrides on about 1 position in 10: so a prompt that holds a run of the
    rule's chain is quoted — drafts accepted — and the model still departs from it now
    and then — drafts rejected. GPT-2's layout, and Llama's (RoPE, GQA)."""
    m = layout_model(request.param, context_length=48)
    return follow_rule(m, PERM, 0.1 if request.param == "llama-gqa" else 1.0)


PERM = torch.randperm(50, generator=torch.Generator().manual_seed(1))


def follow_rule(model: GPT, perm: torch.Tensor, scale: float) -> GPT:
    """``model`` made to predict perm[t] after token t, unless its context (attention)
    outweighs the rule, which a smaller ``scale`` of the token embedding lets it do."""
    with torch.no_grad():
        model.tok_emb.weight.mul_(scale)
        model.lm_head.weight.copy_(model.tok_emb.weight[perm.argsort()] * (30 / scale))
    return model


def chain(start: int, n: int, perm: torch.Tensor = PERM) -> list[int]:
    """n tokens of the rule's chain from ``start``: start, perm[start], ..."""
    out = [start]
    while len(out) < n:
        out.append(int(perm[out[-1]]))
    return out


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    look = NgramLookup()
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last followed by 7 (position 8); the 3-gram "5 2 3" never occurred before
    assert look.propose(seq, 4) == [7, 8, 5, 2]
    assert look.propose(seq, 1) == [7]
    assert look.propose(seq, 0) == []
    seq += [7]  # "2 3 7" occurred: what followed it
    assert look.propose(seq, 3) == [8, 5, 2]
    seq += [4]  # "3 7 4", "7 4" and "4" never occurred
    assert look.propose(seq, 3) == []
    assert look.propose([5], 3) == []
    assert look.propose(seq + [8], 2) == [5, 2]  # the 1-gram 8 last followed by 5
    assert NgramLookup(max_ngram=1).propose([1, 2, 1, 3, 1], 2) == [3, 1]


class RecordingEngine(Engine):
    """An engine that records, for each verifying step and row: its request, the tokens
    it had generated before, its draft's length, the tokens it took, whether it ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record: list[tuple[object, int, int, int, bool]] = []

    def _verify(self, drafts):
        rows = list(self.rows)
        before = [r.generated for r in rows]
        super()._verify(drafts)
        for row, n, draft in zip(rows, before, drafts, strict=True):
            self.record.append((row.req, n, len(draft), row.generated - n,
                                row not in self.rows))


def _requests(seed: int = 0) -> list[tuple[list[int], int, dict]]:
    """Prompts that hold a run of the chain (to quote: drafts found and accepted), some
    followed by other tokens (a question after the quoted text), random ones (drafts
    mostly rejected); stop ids, sampled rows, logprobs; long ones slide at the context
    of 48."""
    rng = random.Random(seed)
    reqs = []
    for i in range(30):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = chain(rng.randrange(50), rng.randint(6, 30))
        elif i % 3 == 1:
            prompt = chain(rng.randrange(50), rng.randint(10, 30)) + prompt[:4]
        kw = {"logprobs": 1, "stop_ids": (rng.randrange(50),)}
        if i % 5 == 4:
            kw |= {"sampling": SamplingConfig(1.0, top_k=20), "seed": i}
        reqs.append((prompt, rng.choice([1, 2, 5, 9, 17, 40]), kw))
    return reqs


def _plain_and_speculative(model, reqs, **kw):
    with Engine(model, max_batch=5, max_queue=100) as engine:
        plain = run_engine(engine, reqs)
    with RecordingEngine(model, max_batch=5, max_queue=100, speculate="ngram",
                         **kw) as engine:
        spec = run_engine(engine, reqs)
    for (t0, lp0, e0), (t1, lp1, e1) in zip(plain, spec, strict=True):
        assert t0 == t1 and e0 == e1
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp0), atol=1e-4, rtol=0)
    return plain, engine


def test_greedy_answers_equal_plain_decoding_and_drafts_are_accepted(model) -> None:
    """30 requests, 5 decoding together: with --speculate ngram every answer (tokens,
    logprobs within float tolerance, end) equals plain decoding's; drafts were accepted
    and rejected, rows ended (stop id or max_tokens) in a step that took accepted draft
    tokens, and a stop id met inside an accepted draft ends the answer there."""
    reqs = _requests()
    plain, engine = _plain_and_speculative(model, reqs, draft_tokens=6)
    m, record = engine.metrics, engine.record
    assert 0 < m.accepted_tokens < m.draft_tokens
    assert m.completion_tokens == sum(len(t) for t, _, _ in plain)
    assert any(n > 1 and ended for _, _, d, n, ended in record)
    assert any(d > 0 and n == 1 for _, _, d, n, _ in record), "no draft was rejected outright"
    assert all(n <= d + 1 for _, _, d, n, _ in record)
    # a token taken from the middle of an accepted draft, new in its answer, as a stop id
    greedy = {id(p): i for i, (p, _, kw) in enumerate(reqs) if "seed" not in kw}
    found = None
    for req, g, _, n, _ in record:
        out = plain[greedy[id(req.prompt)]][0] if id(req.prompt) in greedy else []
        if n >= 3 and out[g + 1] not in out[:g + 1]:
            found = (greedy[id(req.prompt)], out[g + 1], g + 2)
            break
    assert found is not None, "no accepted draft of 3 tokens to stop inside"
    i, stop, length = found
    prompt, max_tokens, kw = reqs[i]
    again = [(prompt, max_tokens, kw | {"stop_ids": (stop,)})]
    plain, engine = _plain_and_speculative(model, again, draft_tokens=6)
    assert len(plain[0][0]) == length and plain[0][2].reason == "stop"
    assert any(ended and 1 < n <= d for _, _, d, n, ended in engine.record)


def test_speculation_with_the_prefix_cache_answers_as_plain_decoding(model) -> None:
    """Both options at once: prompts that share their chain prefixes reuse cached blocks
    and speculate; every answer still equals plain decoding's."""
    reqs = _requests(seed=1)
    reqs += [(chain(3, 33) + [i], 9, {"logprobs": 0}) for i in range(4)]
    _, engine = _plain_and_speculative(model, reqs, prefix_cache=1 << 20)
    assert engine.metrics.prefix_hits >= 3 and engine.metrics.accepted_tokens > 0


def test_speculation_is_off_by_default_and_only_for_greedy_rows(model) -> None:
    prompt = [3, 4, 5] * 6
    with RecordingEngine(model, max_batch=2) as engine:
        run_engine(engine, [(prompt, 12, {})])
        assert engine.record == [] and engine.metrics.draft_tokens == 0
    with RecordingEngine(model, max_batch=2, speculate="ngram") as engine:
        run_engine(engine, [(prompt, 12, {"sampling": SamplingConfig(0.8), "seed": 1})])
        assert engine.record == [] and engine.metrics.draft_tokens == 0
    with pytest.raises(ValueError, match="speculate must be None or 'ngram'"):
        Engine(model, speculate="eagle")


def test_live_server_with_speculate_ngram_answers_as_without() -> None:
    """The official client against `--speculate ngram`: the same text and logprobs as
    the plain server's for a prompt (token ids) that holds the chain the model follows,
    and /metrics counts accepted drafts."""
    model, tok = tiny_model_and_tokenizer(context_length=128)
    perm = torch.randperm(tok.vocab_size, generator=torch.Generator().manual_seed(2))
    follow_rule(model, perm, 1.0)
    prompt = chain(5, 40, perm)[:30] + chain(7, 6, perm)
    answers = {}
    for mode in (None, "ngram"):
        with live_server(model, tok, model_name="m", speculate=mode) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            answers[mode] = client.completions.create(model="m", prompt=prompt, max_tokens=30,
                                                      temperature=0, logprobs=1).choices[0]
            text = httpx.get(url + "/metrics").text
            accepted = next(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("tinylm_draft_tokens_accepted_total"))
            assert (accepted > 0) == (mode == "ngram")
    assert answers["ngram"].text == answers[None].text
    assert answers["ngram"].finish_reason == answers[None].finish_reason
    torch.testing.assert_close(torch.tensor(answers["ngram"].logprobs.token_logprobs),
                               torch.tensor(answers[None].logprobs.token_logprobs),
                               atol=1e-4, rtol=0)


def test_smollm2_quoting_its_prompt_speculates_and_answers_the_same(smollm2_gguf,
                                                                      tmp_path) -> None:
    """The real model asked to repeat a sentence: 24 greedy tokens equal plain
    decoding's, and the quoted words came from accepted drafts (SmolLM2 quotes "The
    quick brown fox jumps over the lazy dog", about 9 tokens, then goes its own way)."""
    from tinylm.io.checkpoint import load_checkpoint

    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(tmp_path)}):
        model, tok = load_checkpoint(smollm2_gguf)
    text = "The quick brown fox jumps over the lazy dog near the river bank at dawn."
    prompt = tok.encode(f"<|im_start|>user\nRepeat this sentence exactly: {text}<|im_end|>\n"
                        f"<|im_start|>assistant\n")
    reqs = [(prompt, 24, {"logprobs": 0})]
    with Engine(model, max_batch=1, threads=1) as engine:
        plain = run_engine(engine, reqs)
    with Engine(model, max_batch=1, threads=1, speculate="ngram") as engine:
        spec = run_engine(engine, reqs)
        accepted = engine.metrics.accepted_tokens
    assert spec[0][0] == plain[0][0]
    assert text[:20] in tok.decode(plain[0][0])  # it does quote the prompt
    torch.testing.assert_close(torch.tensor(spec[0][1]), torch.tensor(plain[0][1]),
                               atol=1e-3, rtol=0)
    assert accepted >= 6


def test_cli_flags_reach_the_server(monkeypatch, capsys) -> None:
    """`tinylm serve --speculate ngram --draft-tokens 4 --prefix-cache 32` hands the
    server those settings (MiB as bytes); the defaults are off, 8 and 256 MiB; a
    negative --prefix-cache is refused with a message naming the flag."""
    import tinylm.serve
    from tinylm.cli import main

    seen = {}
    monkeypatch.setattr(tinylm.serve, "serve", lambda model, **kw: seen.update(kw))
    assert main(["serve", "--model", "m", "--speculate", "ngram", "--draft-tokens", "4",
                 "--prefix-cache", "32"]) == 0
    assert (seen["speculate"], seen["draft_tokens"], seen["prefix_cache"]) == \
        ("ngram", 4, 32 << 20)
    assert main(["serve", "--model", "m"]) == 0
    assert (seen["speculate"], seen["draft_tokens"], seen["prefix_cache"]) == \
        (None, 8, 256 << 20)
    assert main(["serve", "--model", "m", "--prefix-cache", "-1"]) == 2
    assert "--prefix-cache must be >= 0 MiB (0 turns it off), got -1" in capsys.readouterr().err


def test_constrained_rows_beside_speculating_rows_hold_their_grammar() -> None:
    """A grammar-constrained greedy row decodes in the same steps as a row whose drafts
    are accepted (it never drafts itself, and its mask is applied in the verifying step):
    both answers equal the plain engine's, the constrained one matches its regex, and
    drafts were accepted."""
    import re

    from tinylm.serve.constrain import OutputSpec, constraints_for

    model, tok = tiny_model_and_tokenizer(context_length=128)
    perm = torch.randperm(tok.vocab_size, generator=torch.Generator().manual_seed(2))
    follow_rule(model, perm, 1.0)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    spec = OutputSpec("regex", pattern, "regex")
    answers, accepted = {}, {}
    for mode in (None, "ngram"):
        reqs = [(chain(5, 40, perm)[:30] + chain(7, 6, perm), 30, {}),
                (tok.encode("The cat sat"), 20,
                 {"constraint": constraints_for(tok, spec, [tok.eos_id], 1)[0]})]
        with Engine(model, max_batch=4, speculate=mode, draft_tokens=6) as engine:
            answers[mode] = run_engine(engine, reqs)
            accepted[mode] = engine.metrics.accepted_tokens
    assert accepted[None] == 0 < accepted["ngram"]
    assert [(t, e) for t, _, e in answers["ngram"]] == [(t, e) for t, _, e in answers[None]]
    ids, _, end = answers["ngram"][1]
    assert end.reason == "stop"
    assert re.fullmatch(pattern, tok.decode([i for i in ids if i != tok.eos_id]))
