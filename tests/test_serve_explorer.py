"""tinylm serve's explorer: POST /v1/explore is explorer_data, and /explorer is the same
page as `explain --html` in live mode, in a real browser (Debian's Chromium)."""

from __future__ import annotations

import httpx
from playwright import sync_api

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm.use.explorer import explorer_data, explorer_layers

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_explore_endpoint_is_explorer_data_and_bad_input_is_a_4xx():
    model, tok = tiny_model_and_tokenizer(context_length=16)
    with live_server(model, tok, model_name="tiny") as (url, _):
        r = httpx.post(url + "/v1/explore", json={"prompt": "The cat sat", "top_k": 3})
        assert r.status_code == 200
        assert r.json() == explorer_data(model, tok, "The cat sat", top_k=3)
        r = httpx.post(url + "/v1/explore", json={"prompt": "The cat sat", "top_k": 2,
                                                  "layer": 1, "head": 1})
        assert r.json() == explorer_data(model, tok, "The cat sat", top_k=2, layer=1, head=1)
        # a layer's step-by-step part alone: what the live page fetches for a layer
        r = httpx.post(url + "/v1/explore", json={"prompt": "The cat sat", "layers": [1]})
        assert r.status_code == 200
        assert r.json() == explorer_layers(model, tok, "The cat sat", [1])
        for body in [{"prompt": ""}, {"prompt": "The cat " * 20}, {"prompt": "x", "top_k": 0},
                     {"prompt": "x", "model": "other"}, {"prompt": "x", "layer": 99},
                     {"prompt": "x", "layers": [99]}, {"prompt": "x", "layers": "0"}]:
            bad = httpx.post(url + "/v1/explore", json=body)
            assert 400 <= bad.status_code < 500, body
            assert bad.json()["error"]["message"]


def test_explorer_page_recomputes_live():
    model, tok = tiny_model_and_tokenizer()
    with live_server(model, tok, model_name="tiny") as (url, _), \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            outside, errors = [], []
            page.on("request", lambda r: None if r.url.startswith(url)
                    else outside.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/explorer")
            assert page.is_visible("#prompt-input")
            for prompt in ["The cat sat", "A dog ran in the park"]:
                page.fill("#prompt-input", prompt)
                page.click("#run")
                n = len(tok.encode(prompt))
                page.wait_for_function(
                    f"document.querySelectorAll('#tokens .tok').length === {n}",
                    timeout=30_000)
            page.click("#steps button[data-step=softmax]")
            assert page.get_attribute("#step-maps canvas", "data-name") == "layer0.head0.attn"
            page.fill("#prompt-input", "")
            page.click("#run")
            page.wait_for_function(
                "document.getElementById('live-status').textContent.includes('prompt')")
            assert outside == [] and errors == []
        finally:
            browser.close()
