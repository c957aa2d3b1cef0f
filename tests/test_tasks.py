"""use/tasks.py: task accuracy scored as lm-evaluation-harness scores it, proven against a
reference written here from the harness's documented rules, on tiny models from configs.

The reference (``ref_*``) scores one request at a time with a whole forward pass of the
model, tokenizes with the harness's rules spelled out again (``_encode_pair``: trailing
spaces of the context move to the continuation, the pair is encoded whole and the
context's own encoding is cut off; an empty context is the prefix token) and picks with
numpy's argmax; the library batches, pads, sorts and projects only the needed positions.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import BPETokenizer
from tinylm.use.builtin_tasks import BUILTIN_TASKS, builtin_task
from tinylm.use.sampling import generate
from tinylm.use.task_files import load_task
from tinylm.use.tasks import (
    Extractor,
    Item,
    Task,
    encode_pair,
    evaluate_task,
    fewshot_prefixes,
    loglikelihoods,
)

TEXT = ("The cat sat on the mat. A dog ran in the park. The sun is hot and the snow is "
        "cold. Birds fly, fish swim. Numbers 0123456789 plus one two three. Café naïve. ")


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer.train([TEXT * 4], vocab_size=320, special_tokens=["<|endoftext|>"])


@pytest.fixture(scope="module")
def model(tok) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                      context_length=48, tie_embeddings=False)
    m = GPT(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)  # far-apart logits: no near-ties for rounding to flip
    return m


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the reference ------------------------------------------------------------------------


def ref_encode(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's TemplateLM.loglikelihood + _encode_pair, for a causal model."""
    if context == "":
        prefix = tok.bos_id if tok.bos_id is not None else tok.eos_id
        cont = tok.encode(continuation)
        return ([prefix], cont) if cont[0] != prefix else (cont[:1], cont[1:])
    stripped = context.rstrip()
    spaces = context[len(stripped):]
    whole = tok.encode(stripped + spaces + continuation)
    ctx = tok.encode(stripped)
    return ctx, whole[len(ctx):]


def ref_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    C = model.config.context_length
    inp = (ctx + cont)[-(C + 1):][:-1]
    with torch.no_grad():
        logits = model(torch.tensor([inp]))[0].double()  # (T, V)
    logp = torch.log_softmax(logits, -1)[len(inp) - len(cont):]  # (len(cont), V)
    target = torch.tensor(cont)
    total = float(logp[torch.arange(len(cont)), target].sum())
    return total, bool((logp.argmax(-1) == target).all())


def ref_multiple_choice(model, tok, items: list[dict]) -> dict[str, float]:
    acc, norm, nbytes = [], [], []
    for it in items:
        lls = np.array([ref_loglikelihood(model, *ref_encode(tok, it["context"], " " + c))[0]
                        for c in it["choices"]])
        chars = np.array([len(c) for c in it["choices"]], dtype=float)
        size = np.array([len(c.encode("utf-8")) for c in it["choices"]], dtype=float)
        acc.append(np.argmax(lls) == it["answer"])
        norm.append(np.argmax(lls / chars) == it["answer"])
        nbytes.append(np.argmax(lls / size) == it["answer"])
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm)),
            "acc_bytes": float(np.mean(nbytes))}


WORDS = ["cat", "dog", "mat", "park", "sun", "snow", "fish", "birds", "café", "naïve",
         "the hot sun", "one two", "three"]


def mc_records(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(2, 4)
        context = rnd.choice(["The cat sat on the", "A dog ran in the ", "Birds fly, fish",
                              "The sun is hot and the snow is", "Numbers 01234 plus"])
        if i % 5 == 0:
            context = context + "  "  # trailing spaces move to the continuation
        out.append({"context": context, "choices": rnd.sample(WORDS, k),
                    "answer": rnd.randrange(k)})
    return out


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")


# --- tokenizing and log-likelihoods --------------------------------------------------------


def test_encode_pair_moves_trailing_spaces_and_cuts_the_context_encoding(tok) -> None:
    for context, cont in [("The cat sat on the", " mat"), ("The cat sat on the ", "mat"),
                          ("The cat sat on the  \t", "mat"), ("A dog", " ran in the park")]:
        assert encode_pair(tok, context, cont) == ref_encode(tok, context, cont)
    ctx, cont = encode_pair(tok, "The cat sat on the ", "mat")
    assert ctx == tok.encode("The cat sat on the")
    assert tok.decode(cont) == " mat"


def test_empty_context_is_the_prefix_token(tok) -> None:
    eos = tok.eos_id
    assert tok.bos_id is None and eos is not None
    assert encode_pair(tok, "", " cat") == ([eos], tok.encode(" cat"))

    class Codepoints:  # ids are code points: a text can start with the prefix token
        kind, bos_id, eos_id = "stub", None, 7

        def encode(self, text):
            return [ord(c) for c in text]

    stub = Codepoints()
    assert encode_pair(stub, "", "ab") == ([7], [97, 98])
    # a continuation that starts with the prefix token keeps it as the context
    assert encode_pair(stub, "", "\x07ab") == ([7], [97, 98]) == ref_encode(stub, "", "\x07ab")
    stub.bos_id = 1  # bos, when there is one, before eos
    assert encode_pair(stub, "", "ab") == ([1], [97, 98])
    stub.bos_id = stub.eos_id = None
    with pytest.raises(DataError, match="empty context"):
        encode_pair(stub, "", "ab")


def test_loglikelihoods_equal_the_reference_in_any_batch(model, tok) -> None:
    pairs = [("The cat sat on the", " mat"), ("A dog ran in", " the park"),
             ("Birds fly,", " fish swim. The sun"), ("", " cat"),
             ("The sun is hot and the snow is " * 6, " cold")]  # longer than C: cut left
    requests = [encode_pair(tok, c, k) for c, k in pairs]
    assert len(requests[-1][0]) + len(requests[-1][1]) > model.config.context_length + 1
    expected = [ref_loglikelihood(model, *r) for r in requests]
    for bs in (1, 2, 16):
        got = loglikelihoods(model, requests, batch_size=bs)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert ll == pytest.approx(ref_ll, abs=1e-4)
            assert greedy == ref_greedy


def test_a_continuation_longer_than_the_context_is_refused(model, tok) -> None:
    long = tok.encode("The cat sat on the mat. " * 20)
    with pytest.raises(DataError, match="longer than the model's context length"):
        loglikelihoods(model, [([1], long)])


# --- the three kinds ---------------------------------------------------------------------


def test_multiple_choice_equals_the_reference(model, tok, tmp_path) -> None:
    records = mc_records(30)
    path = tmp_path / "mc.jsonl"
    write_jsonl(path, records)
    task = load_task(str(path))
    assert task.name == "mc" and task.kind == "multiple_choice"
    expected = ref_multiple_choice(model, tok, records)
    for bs in (1, 7):
        result = evaluate_task(model, tok, task, batch_size=bs)
        assert result["n"] == 30
        for key in ("acc", "acc_norm", "acc_bytes"):
            assert result[key] == expected[key], key
    assert result["baseline"] == pytest.approx(np.mean([1 / len(r["choices"])
                                                        for r in records]))
    limited = evaluate_task(model, tok, task, limit=10)
    assert limited["n"] == 10
    assert limited["acc"] == ref_multiple_choice(model, tok, records[:10])["acc"]


def test_ties_go_to_the_first_choice(model, tok) -> None:
    item = Item(("The cat sat on the",), (" mat", " mat"), 0, ("mat", "mat"))
    other = Item(("The cat sat on the",), (" mat", " mat"), 1, ("mat", "mat"))
    task = Task("ties", "multiple_choice", [item, other])
    result = evaluate_task(model, tok, task)
    assert result["acc"] == result["acc_norm"] == result["acc_bytes"] == 0.5


def _greedy_text(model, tok, prompt: str, n: int) -> str:
    ids = tok.encode(prompt)
    out = generate(model, ids, n, temperature=0.0)[0, len(ids):].tolist()
    return tok.decode(out)


def test_cloze_is_right_exactly_when_greedy_decoding_gives_the_target(model, tok) -> None:
    contexts = ["The cat sat on the", "A dog ran", "Birds fly, fish", "The sun is hot",
                "Numbers 0123", "Café", "The snow is", "one two"]
    items = []
    for i, c in enumerate(contexts):
        ids = tok.encode(c)
        greedy = generate(model, ids, 3, temperature=0.0)[0, len(ids):].tolist()
        # half the targets are the model's own greedy tokens, half are not
        target_ids = greedy if i % 2 == 0 else [(greedy[0] + 1) % 250 + 5] + greedy[1:]
        items.append(Item((c,), (tok.decode(target_ids),), 0))
    expected = [ref_loglikelihood(model, *ref_encode(tok, it.contexts[0],
                                                     it.continuations[0]))[1]
                for it in items]
    assert 0 < sum(expected) < len(expected)  # both right and wrong targets are scored
    result = evaluate_task(model, tok, Task("cloze", "cloze", items), batch_size=3)
    assert result["acc"] == pytest.approx(np.mean(expected))
    assert result["baseline"] == 0.0 and result["perplexity"] > 1


def test_generate_extracts_and_matches_like_the_harness(model, tok) -> None:
    prompts = ["The cat sat on the", "A dog ran", "Birds fly, fish", "The sun is hot",
               "Numbers 0123", "The snow is"]
    items = []
    for i, p in enumerate(prompts):
        text = _greedy_text(model, tok, p, 8)
        cut = text.find(".")
        text = text if cut < 0 else text[:cut]  # the reference's stop at "."
        items.append(Item((p,), (), text.strip() if i % 2 == 0 else "no such answer"))
    task = Task("gen", "generate", items, stop=(".",), max_new_tokens=8)
    result = evaluate_task(model, tok, task, batch_size=4)
    expected = np.mean([i % 2 == 0 for i in range(len(prompts))])
    # the odd targets can only match if the model happens to write them
    assert result["acc"] == pytest.approx(expected)
    assert result["exact_match"] == result["acc"] and result["baseline"] == 0.0


def test_extractor_is_the_harness_regex_filter() -> None:
    strict = Extractor("strict", "#### (\\-?[0-9\\.\\,]+)")
    flexible = Extractor("flexible", "(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)
    assert strict("so 3 + 4 = 7.\n#### 7") == "7"
    assert strict("no marker 7") == "[invalid]"
    assert flexible("3 apples and 12 pears, $1,200.") == "$1,200."
    assert flexible("answer 5") == "5"
    assert Extractor("plain")("  42 \n") == "42"


def test_gsm8k_task_ignores_what_the_harness_ignores(tmp_path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    write_jsonl(path, [{"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}])
    task = load_task(str(path))
    assert task.kind == "generate" and "Question:" in task.stop
    from tinylm.use.tasks import _generate_metrics

    got = _generate_metrics(task, task.items, ["It is 4.\n#### 4", ])
    assert got == {"strict-match": 1.0, "flexible-extract": 1.0, "acc": 1.0}
    got = _generate_metrics(task, task.items, ["It is 4 or $1,004."])
    assert got["strict-match"] == 0.0 and got["flexible-extract"] == 0.0


# --- few-shot -------------------------------------------------------------------------------


def test_fewshot_draws_from_the_train_split_with_the_harness_seed(model, tok) -> None:
    items = [Item((f"q{i}",), (" a", " b"), 0, ("a", "b"), shot=f"q{i} a") for i in range(6)]
    train = [Item((f"t{i}",), (" a", " b"), 1, ("a", "b"), shot=f"t{i} b") for i in range(5)]
    task = Task("fs", "multiple_choice", items, train)
    prefixes = fewshot_prefixes(task, items, train, 2, 1234)
    rnd = random.Random(1234)
    for prefix in prefixes:
        shots = rnd.sample(train, 2)
        assert prefix == f"{shots[0].shot}\n\n{shots[1].shot}\n\n"
    assert fewshot_prefixes(task, items, train, 0, 1234) == [""] * 6
    with pytest.raises(ConfigError, match="needs 6 examples"):
        fewshot_prefixes(task, items, train, 6, 1234)


def test_fewshot_of_a_file_never_uses_the_scored_items(model, tok, tmp_path) -> None:
    records = mc_records(12, seed=3)
    path = tmp_path / "items.jsonl"
    write_jsonl(path, records)
    task = load_task(str(path))
    with pytest.raises(ConfigError, match="--fewshot-file"):
        evaluate_task(model, tok, task, num_fewshot=1)  # every item is scored
    # with --limit 8 the 4 unscored items are the pool: a 1-shot prefix is one of them
    scored, pool = task.items[:8], task.items[8:]
    prefixes = fewshot_prefixes(task, scored, pool, 1, 1234)
    assert all(p[:-2] in {it.shot for it in pool} for p in prefixes)
    result = evaluate_task(model, tok, task, limit=8, num_fewshot=1)
    expected = []
    for it, prefix in zip(scored, prefixes, strict=True):
        record = records[task.items.index(it)]
        expected.append({**record, "context": prefix + record["context"]})
    assert result["acc"] == ref_multiple_choice(model, tok, expected)["acc"]
    shots = tmp_path / "train.jsonl"
    write_jsonl(shots, mc_records(3, seed=9))
    with_file = load_task(str(path), fewshot_file=shots)
    assert evaluate_task(model, tok, with_file, num_fewshot=2)["num_fewshot"] == 2


# --- built-in tasks -------------------------------------------------------------------------


def test_builtin_tasks_are_fixed_and_right() -> None:
    for spec in BUILTIN_TASKS:
        a, b = builtin_task(spec), builtin_task(spec)
        assert a.items == b.items and a.fewshot == b.fewshot and len(a.items) == 100
        assert not set(a.items) & set(a.fewshot)
    for it in builtin_task("builtin:count").items:
        numbers = [int(n) for n in re.findall(r"\d+", it.contexts[0])]
        assert int(it.continuations[0]) == numbers[-1] + 1
    for it in builtin_task("builtin:add-digits").items:
        a, b = map(int, re.findall(r"\d+", it.contexts[0]))
        assert it.answer == str(a + b)
    for it in builtin_task("builtin:brackets").items:
        stack = []
        for c in it.contexts[0].split(": ")[1].split():
            if c in "([{<":
                stack.append(c)
            else:
                assert "([{<"[")]}>".index(c)] == stack.pop()
        assert it.choice_texts[it.answer] == ")]}>"["([{<".index(stack[-1])]
    for it in builtin_task("builtin:copy").items:
        first, second = it.contexts[0].split("\n")
        assert first.split(": ")[1] == second.split(": ")[1] + it.continuations[0]
    with pytest.raises(ConfigError, match="builtin:copy"):
        builtin_task("builtin:nope")


def test_builtin_tasks_score_a_model(model, tok) -> None:
    for spec in BUILTIN_TASKS:
        result = evaluate_task(model, tok, load_task(spec), limit=4, num_fewshot=1)
        assert result["n"] == 4 and 0 <= result["acc"] <= 1
        assert result["kind"] == builtin_task(spec).kind


def test_an_hf_built_llama_scores_as_its_own_logits_say(tok, tmp_path) -> None:
    """The oracle is transformers' own forward of a tiny Llama: the harness's rules on
    its logits give the same log-likelihoods and accuracies as tinylm on its import."""
    transformers = pytest.importorskip("transformers")
    from tinylm.io.hf import from_hf

    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=48, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
    ours = from_hf(hf).eval()

    class HFLogits(torch.nn.Module):  # the reference reads logits from transformers
        config = ours.config

        def forward(self, ids):
            return hf(input_ids=ids).logits

    records = mc_records(16, seed=5)
    path = tmp_path / "hfmc.jsonl"
    write_jsonl(path, records)
    expected = ref_multiple_choice(HFLogits(), tok, records)
    result = evaluate_task(ours, tok, load_task(str(path)), batch_size=5)
    for key in ("acc", "acc_norm", "acc_bytes"):
        assert result[key] == expected[key], key
    requests = [encode_pair(tok, r["context"], " " + r["choices"][0]) for r in records]
    for (ll, _), r in zip(loglikelihoods(ours, requests), requests, strict=True):
        assert ll == pytest.approx(ref_loglikelihood(HFLogits(), *r)[0], abs=1e-4)


def test_progress_reports_items_done(model, tok) -> None:
    calls = []
    for spec in ("builtin:brackets", "builtin:add-digits"):
        calls.clear()
        evaluate_task(model, tok, load_task(spec), limit=5, batch_size=2,
                      progress=lambda done, total: calls.append((done, total)))
        assert calls[-1] == (5, 5) and all(t == 5 for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
