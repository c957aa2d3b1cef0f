"""The page's "Show token probabilities" control in a real browser (Debian's Chromium,
headless, driven by Playwright): with it on, the page asks for logprobs and shows each
generated token with its probability and top alternatives; the numbers must be the
API's own for the same request (greedy, so the same tokens), in completion and chat
mode. With it off, the page asks for none."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from playwright import sync_api

from serve_support import (
    TEXT,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def chat_model():
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=STANDARD_SPECIALS)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                            context_length=128, tie_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model, tok


def _generate_with_probs(page, url: str, text: str, max_tokens: int) -> list[dict]:
    """Greedy generation on the page with the control on; what each token box shows,
    and the bodies of the completion requests the page sends."""
    sent = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data))
            if r.url.endswith("completions") and r.post_data else None)
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('mode-hint').textContent")
    page.eval_on_selector("#temperature", "e => { e.value = 0; "
                          "e.dispatchEvent(new Event('input')); }")
    page.check("#show-probs")
    page.fill("#prompt", text)
    page.fill("#max_tokens", str(max_tokens))
    page.click("#send")
    page.wait_for_function(
        "document.getElementById('state').textContent.startsWith('finished')"
        " && !document.getElementById('send').disabled", timeout=30_000)
    boxes = page.eval_on_selector_all("#probs .ptok", """spans => spans.map(s => ({
        text: s.textContent, logprob: Number(s.dataset.logprob),
        top: JSON.parse(s.dataset.top), title: s.title,
        background: getComputedStyle(s).backgroundColor}))""")
    page.hover("#probs .ptok >> nth=0")
    boxes[0]["detail"] = page.text_content("#probs-detail")
    return boxes, sent  # (sent: a live list, more requests append to it)


def _check(boxes: list[dict], api: list[tuple[str, float, list[tuple[str, float]]]]) -> None:
    assert len(boxes) == len(api) > 0
    for box, (token, logprob, top) in zip(boxes, api, strict=True):
        assert box["logprob"] == pytest.approx(logprob, abs=1e-9)
        assert box["text"] == json.dumps(token, ensure_ascii=False)[1:-1]
        assert [s for s, _ in box["top"]] == [s for s, _ in top]
        assert [v for _, v in box["top"]] == pytest.approx([v for _, v in top], abs=1e-9)
        assert f"{100 * math.exp(logprob):.2f}%" in box["title"]  # its probability
        for s, v in top:  # and each alternative's
            assert f"{json.dumps(s, ensure_ascii=False)} {100 * math.exp(v):.2f}%" \
                in box["title"]
        assert box["background"].startswith("rgb")  # coloured
    first = boxes[0]
    assert f"{100 * math.exp(first['logprob']):.2f}%" in first["detail"]


def test_page_shows_the_apis_token_probabilities_for_a_completion(browser):
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, model_name="tiny", max_tokens=64) as (url, _):
        page = browser.new_page()
        try:
            boxes, sent = _generate_with_probs(page, url, "The cat", 12)
        finally:
            page.close()
        assert sent[-1]["stream"] and sent[-1]["logprobs"] == 5
        assert sent[-1]["temperature"] == 0
        r = httpx.post(url + "/v1/completions", json={
            "prompt": "The cat", "max_tokens": 12, "temperature": 0, "logprobs": 5}).json()
        lp = r["choices"][0]["logprobs"]
        _check(boxes, [(t, v, list(top.items())) for t, v, top in
                       zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                           strict=True)])


def test_page_shows_the_apis_token_probabilities_in_chat(browser):
    model, tok = chat_model()
    with live_server(model, tok, model_name="tiny-chat", max_tokens=64) as (url, _):
        page = browser.new_page()
        try:
            boxes, sent = _generate_with_probs(page, url, "Is the cat on the mat?", 10)
            page.uncheck("#show-probs")  # off: no logprobs asked for, none shown
            page.fill("#prompt", "And the dog?")
            page.click("#send")
            page.wait_for_function("!document.getElementById('send').disabled"
                                   " && document.querySelectorAll('.turn').length === 4")
            assert page.is_hidden("#probs")
        finally:
            page.close()
        streamed = [b for b in sent if b.get("stream")]
        assert len(streamed) == 2
        assert streamed[0]["logprobs"] is True and streamed[0]["top_logprobs"] == 5
        assert "logprobs" not in streamed[1] and "top_logprobs" not in streamed[1]
        r = httpx.post(url + "/v1/chat/completions", json={
            "messages": streamed[0]["messages"], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}).json()
        content = r["choices"][0]["logprobs"]["content"]
        _check(boxes, [(e["token"], e["logprob"],
                        [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                       for e in content])
