"""The page's "JSON output" control in Chromium (Playwright, Debian's browser): in chat
mode it sends ``response_format: {"type": "json_object"}``, and the reply the page shows
parses as a JSON object (the tiny model's reply is held to JSON by the grammar mask)."""

from __future__ import annotations

import json

from playwright import sync_api

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from test_serve_page import ARGS, CHROMIUM, _chat_requests, _finished
from test_serve_structured import chat_tokenizer


def test_the_json_output_control_gets_a_json_reply() -> None:
    tok = chat_tokenizer()
    model, _ = tiny_model_and_tokenizer(context_length=512)
    with live_server(model, tok, model_name="tiny", max_tokens=200) as (url, _), \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('mode-hint').textContent")
            assert page.input_value("#mode") == "chat" and page.is_visible("#json")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "200")
            page.check("#json")
            page.fill("#prompt", "The cat sat on the mat.")
            page.press("#prompt", "Enter")
            page.wait_for_function("document.querySelectorAll('.turn').length === 2")
            _finished(page)
            assert page.text_content("#state") == "finished: stop"
            reply = page.eval_on_selector_all(".turn .content",
                                              "ts => ts.map(t => t.textContent)")[1]
            assert isinstance(json.loads(reply), dict)
            assert _chat_requests(requests)[-1]["response_format"] == {"type": "json_object"}
            page.select_option("#mode", "completion")
            assert not page.is_visible("#json")  # a chat control only
            assert errors == []
        finally:
            browser.close()
