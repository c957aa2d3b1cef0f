"""lm-evaluation-harness through ``tinylm serve``: the parts of /v1/completions its
``local-completions`` model needs (``echo`` with ``logprobs`` over the prompt's tokens,
``max_tokens`` 0, batches of prompts, token-id prompts), then the harness itself run as
its documented command on a local multiple-choice task, against ``tinylm serve``.

Oracles: the model's own log_softmax (one forward of the prompt alone), and a reference
of the harness's scoring written here from its rules (lm_eval/api/model.py
``_encode_pair``: trailing spaces of the context go to the continuation, the pair is
encoded whole and the continuation is what follows the context's own encoding;
lm_eval/api/task.py: acc = argmax of the summed log-likelihoods, acc_norm of the sums
over the choice's length in characters, acc_bytes over its UTF-8 length, first index
on ties as numpy's argmax; each continuation is the target delimiter " " and the
choice). ``tinylm eval --task`` must agree with both.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import lm_eval  # noqa: F401  (the dev extra installs it: its absence fails, never skips)
import numpy as np
import pytest
import torch

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.serve.schemas import Limits, RequestError, parse_completion

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, model_name="tiny", max_tokens=8) as (url, _):
        yield url + "/v1/completions", model, tok


def _post(url: str, **body) -> dict:
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _reference(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log_softmax of the model's logits for ids, one forward alone."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


# --- the server side ------------------------------------------------------------------------


def test_echo_logprobs_score_the_prompt_with_the_models_log_softmax(served):
    url, model, tok = served
    ids = tok.encode("The cat sat on the mat. Café")
    ref = _reference(model, ids)
    for prompt in (ids, "The cat sat on the mat. Café"):
        r = _post(url, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
        c = r["choices"][0]
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) \
            == len(lp["text_offset"]) == len(ids) + 1  # the prompt, then the new token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for t in range(1, len(ids)):
            assert lp["token_logprobs"][t] == pytest.approx(float(ref[t - 1, ids[t]]), abs=1e-5)
            top = sorted(lp["top_logprobs"][t].values(), reverse=True)
            assert top[0] == pytest.approx(float(ref[t - 1].max()), abs=1e-5)
        assert lp["tokens"][:len(ids)] == [tok.decode([i]) for i in ids]
        assert all(b - a == len(s) for a, b, s in
                   zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"], strict=False))
        # the generated token (taken from the same forward, not decoded again): the
        # engine's greedy token, text and score, as the request without echo has them
        plain = _post(url, prompt=ids, logprobs=2, max_tokens=1, temperature=0)["choices"][0]
        assert c["text"] == tok.decode(ids) + plain["text"]
        assert c["finish_reason"] == plain["finish_reason"]
        assert lp["tokens"][-1] == plain["logprobs"]["tokens"][0]
        assert lp["token_logprobs"][-1] == pytest.approx(
            plain["logprobs"]["token_logprobs"][0], abs=1e-5)
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=1e-5)
        assert lp["top_logprobs"][-1].keys() == plain["logprobs"]["top_logprobs"][0].keys()


def test_a_padded_vocabulary_scores_over_all_the_models_ids():
    """A model with more ids than its tokenizer (GPT-2's 50304 for 50257): the prompt is
    scored over the model's whole vocabulary, as tinylm eval and the harness's own
    models do; the generated token stays among the tokenizer's ids, as the engine's."""
    _, tok = tiny_model_and_tokenizer()
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size + 20, n_layer=1, n_head=2, n_embd=32,
                            context_length=32)).eval()
    ids = tok.encode("The cat sat on")
    with torch.no_grad():  # a padding id beats every real one after the prompt
        best = int(_reference(model, ids)[-1].argmax())
        model.lm_head.weight[tok.vocab_size] = 3 * model.lm_head.weight[best]
    ref = _reference(model, ids)
    assert int(ref[-1].argmax()) == tok.vocab_size
    with live_server(model, tok) as (url, _):
        c = _post(url + "/v1/completions", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                  temperature=0)["choices"][0]
    assert c["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(
        [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))], abs=1e-5)
    truncated = torch.log_softmax(ref[-1].exp()[:tok.vocab_size].log(), -1)
    assert c["logprobs"]["token_logprobs"][-1] == pytest.approx(float(truncated.max()),
                                                                abs=1e-5)
    assert c["logprobs"]["tokens"][-1] == tok.decode([int(truncated.argmax())])


def test_max_tokens_zero_returns_only_the_prompt(served):
    url, model, tok = served
    ids = tok.encode("A dog ran in the park.")
    r = _post(url, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    c = r["choices"][0]
    assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length"
    assert len(c["logprobs"]["token_logprobs"]) == len(ids)
    ref = _reference(model, ids)
    want = [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))]
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                          "total_tokens": len(ids)}
    bare = _post(url, prompt="A dog", max_tokens=0)["choices"][0]
    assert bare["text"] == "" and bare["logprobs"] is None
    streamed = [json.loads(line[6:]) for line in httpx.post(
        url, json={"prompt": ids, "echo": True, "max_tokens": 0, "stream": True},
        timeout=30).text.splitlines() if line.startswith("data: {")]
    assert [ch["choices"][0]["text"] for ch in streamed] == [tok.decode(ids)]
    assert streamed[0]["choices"][0]["finish_reason"] == "length"


def test_echo_with_more_tokens_or_sampling_decodes_after_the_scored_prompt(served):
    url, model, tok = served
    ids = tok.encode("Numbers 0123456789 and")
    ref = _reference(model, ids)
    for extra in ({"max_tokens": 4, "temperature": 0}, {"max_tokens": 1, "temperature": 1.0,
                                                       "seed": 3}):
        r = _post(url, prompt=ids, echo=True, logprobs=1, **extra)["choices"][0]
        plain = _post(url, prompt=ids, logprobs=1, **extra)["choices"][0]
        assert r["text"] == tok.decode(ids) + plain["text"]
        lp = r["logprobs"]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
            [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))], abs=1e-5)
        assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
        assert lp["text_offset"][len(ids)] == sum(len(s) for s in lp["tokens"][:len(ids)])


def test_a_batch_of_prompts_scores_each_as_alone(served):
    url, _, tok = served
    prompts = [tok.encode("The cat sat"), "Numbers 0123", tok.encode("naïve façade, 日本語")]
    batch = _post(url, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for p, c in zip(prompts, batch["choices"], strict=True):
        alone = _post(url, prompt=p, echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert c["logprobs"] == alone["choices"][0]["logprobs"]
        assert c["text"] == alone["choices"][0]["text"]


def test_streamed_echo_logprobs_equal_the_whole_response(served):
    url, _, tok = served
    body = {"prompt": "The park", "echo": True, "logprobs": 1, "max_tokens": 4,
            "temperature": 0}
    whole = _post(url, **body)["choices"][0]
    chunks = [json.loads(line[6:]) for line in httpx.post(
        url, json=dict(body, stream=True), timeout=30).text.splitlines()
        if line.startswith("data: {")]
    parts = [ch["choices"][0] for ch in chunks]
    assert "".join(p["text"] for p in parts) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((p["logprobs"][key] for p in parts), []) == whole["logprobs"][key]
    assert parts[-1]["finish_reason"] == whole["finish_reason"]


def test_parse_completion_takes_what_the_harness_sends():
    limits = Limits(context_length=64)
    req = parse_completion({"prompt": [[1, 2, 3], [4, 5]], "echo": True, "logprobs": 1,
                            "max_tokens": 1, "temperature": 0, "seed": 1234}, limits)
    assert req.prompts == ((1, 2, 3), (4, 5)) and req.echo and req.gen.logprobs == 1
    assert parse_completion({"prompt": "x", "max_tokens": 0}, limits).gen.max_tokens == 0
    for bad in (-1, False, 0.5):
        with pytest.raises(RequestError, match="max_tokens"):
            parse_completion({"prompt": "x", "max_tokens": bad}, limits)


# --- the harness: lm_eval --model local-completions against tinylm serve ---------------------

WORDS = ["cat", "mat", "dog", "park", "café", "naïve", "façade", "日本語", "numbers",
         "attention", "words", "lait", "more", "need", "the", "sat", "ran"]


def _items(n: int = 20) -> list[dict]:
    """Multiple-choice items in tinylm's local format; choices of unequal lengths in
    characters and in bytes, so acc, acc_norm and acc_bytes can each pick differently;
    some contexts end in a space (the harness moves it to the continuation)."""
    rng = random.Random(0)
    items = []
    for i in range(n):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))
        context = context.capitalize() + (": " if i % 3 == 0 else " is")
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
                   for _ in range(4)]
        items.append({"context": context, "choices": choices, "answer": rng.randrange(4)})
    return items


def _harness_reference(model, tok, items: list[dict]) -> dict:
    """The harness's multiple-choice scores, from its rules (see the module docstring)."""
    hits = {"acc": [], "acc_norm": [], "acc_bytes": []}
    lls_all, preds = [], []
    for item in items:
        lls = []
        for choice in item["choices"]:
            context, cont = item["context"], " " + choice  # the target delimiter, then it
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, cont = context[:-n_spaces], context[-n_spaces:] + cont
            whole = tok.encode(context + cont)
            n_ctx = len(tok.encode(context))
            logp = _reference(model, whole)
            lls.append(sum(float(logp[t - 1, whole[t]]) for t in range(n_ctx, len(whole))))
        lls = np.array(lls)
        chars = np.array([len(c) for c in item["choices"]], dtype=float)
        nbytes = np.array([len(c.encode("utf-8")) for c in item["choices"]], dtype=float)
        pred = {"acc": np.argmax(lls), "acc_norm": np.argmax(lls / chars),
                "acc_bytes": np.argmax(lls / nbytes)}
        for key, p in pred.items():
            hits[key].append(float(p == item["answer"]))
        lls_all.append(lls.tolist())
        preds.append(tuple(int(p) for p in pred.values()))
    return {"lls": lls_all, "preds": preds, **{k: float(np.mean(v)) for k, v in hits.items()}}


TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offline_env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def write_task(tmp: Path, name: str, items: list[dict]) -> tuple[Path, Path]:
    """(the JSONL file of items in tinylm's format, the folder of its task YAML)."""
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items),
                    encoding="utf-8")
    tasks = tmp / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data,
                                                         cache=tmp / "hf"))
    return data, tasks


def run_lm_eval(model: Path, tokenizer: Path, name: str, tasks: Path, out: Path,
                max_length: int) -> tuple[dict, list[dict]]:
    """``tinylm serve --model MODEL`` in a subprocess, ``lm_eval --model local-completions``
    against it (the commands of docs/evaluate.md, offline); (results, samples)."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tinylm", "serve", "--model", str(model),
                               "--port", str(port), "--threads", "1", "-q"],
                              env=_offline_env(), stdout=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "tinylm serve exited"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tinylm serve did not become ready"
            time.sleep(0.2)
        args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                f"base_url={base}/v1/completions,tokenizer={tokenizer},"
                f"tokenizer_backend=huggingface,max_length={max_length}",
                "--batch_size", "8", "--tasks", name, "--include_path", str(tasks),
                "--output_path", str(out), "--log_samples"]
        done = subprocess.run(args, env=_offline_env(), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(30)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in
               next(out.rglob(f"samples_{name}_*.jsonl")).read_text().splitlines()]
    return results, samples


def check_against_reference(results: dict, samples: list[dict], name: str, ref: dict,
                            n: int) -> None:
    """The harness's acc, acc_norm and acc_bytes equal the reference's exactly, and each
    choice's log-likelihood equals the reference's."""
    got = results["results"][name]
    assert results["n-samples"][name]["effective"] == n
    for key in ("acc", "acc_norm", "acc_bytes"):
        assert got[f"{key},none"] == ref[key], key  # exactly: the same items chosen
    by_doc = {s["doc_id"]: s for s in samples}
    for i, lls in enumerate(ref["lls"]):
        harness = [float(r[0]) for r in by_doc[i]["filtered_resps"]]
        assert harness == pytest.approx(lls, abs=1e-4), i


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    """lm_eval through tinylm serve on a saved tiny checkpoint; (the checkpoint, the
    items file, the items, lm_eval's results, its samples)."""
    tmp = tmp_path_factory.mktemp("lmeval")
    model, tok = tiny_model_and_tokenizer()
    ckpt = save_checkpoint(tmp / "tiny", model, tok)
    items = _items()
    data, tasks = write_task(tmp, "tinylm_mc", items)
    results, samples = run_lm_eval(ckpt, ckpt, "tinylm_mc", tasks, tmp / "out",
                                   model.config.context_length)
    return ckpt, data, items, results, samples


def test_lm_eval_through_tinylm_serve_scores_as_the_reference(harness_run):
    ckpt, _, items, results, samples = harness_run
    model, tok = load_checkpoint(ckpt)
    ref = _harness_reference(model.eval(), tok, items)
    check_against_reference(results, samples, "tinylm_mc", ref, len(items))
    # the items tell the three rules apart: each pair picks differently somewhere
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert any(p[a] != p[b] for p in ref["preds"]), (a, b)


def test_tinylm_eval_task_equals_lm_eval_exactly(harness_run):
    """``tinylm eval --task FILE --json`` (issue #31 item 1) on the same items and model
    gives the harness's numbers exactly."""
    ckpt, data, _, results, _ = harness_run
    done = subprocess.run([sys.executable, "-m", "tinylm", "eval", "--model", str(ckpt), "--task",
                           str(data), "--json"], env=_offline_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (
        f"tinylm eval --task failed (exit {done.returncode}); it comes with issue #31's "
        f"task evaluation: {done.stderr.strip()[-500:]}")
    ours = json.loads(done.stdout)["tasks"][data.stem]
    got = results["results"]["tinylm_mc"]
    assert ours["kind"] == "multiple_choice" and ours["n"] == 20
    for key in ("acc", "acc_norm", "acc_bytes"):
        assert ours[key] == got[f"{key},none"], key
