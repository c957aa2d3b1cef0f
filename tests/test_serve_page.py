"""The web page at / in a real browser: Debian's Chromium, headless, driven by
Playwright (pointed at the system browser; nothing is downloaded). The page must work
offline: every request it makes goes to the server itself."""

from __future__ import annotations

from playwright import sync_api

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_page_streams_a_completion_and_shows_the_explorer():
    with live_server(model_name="tiny", max_tokens=64) as (url, _), \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            outside = []
            page.on("request", lambda r: None if r.url.startswith(url)
                    else outside.append(r.url))
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('model-name').textContent")
            page.fill("#prompt", "The cat")
            page.fill("#max_tokens", "40")
            page.click("#send")
            page.wait_for_function(
                "document.getElementById('state').textContent.startsWith('finished')",
                timeout=30_000)
            assert page.text_content("#generated")  # streamed text arrived
            assert int(page.text_content("#ntok")) >= 1
            assert page.text_content("#output").startswith("The cat")
            # the explorer tab: next-token table and an attention map per layer and head
            page.click("#tab-explore")
            assert page.is_visible("#explain-prompt") and not page.is_visible("#prompt")
            page.fill("#explain-prompt", "The cat sat")
            page.click("#explain-run")
            page.wait_for_selector("#explain-table tr:nth-child(2)", timeout=30_000)
            n_tokens = page.eval_on_selector_all("#explain-table tr", "rows => rows.length")
            assert n_tokens - 1 == len(page.eval_on_selector_all(
                "#attn-tokens td", "cells => cells.map(c => c.textContent)"))
            assert page.eval_on_selector_all("#layer option", "o => o.length") == 2
            assert page.eval_on_selector_all("#head option", "o => o.length") == 2
            page.select_option("#layer", "1")
            assert page.evaluate("document.getElementById('attn').width") > 0
            assert outside == []  # no CDN, nothing off the server
        finally:
            browser.close()
