"""The server's web page on the real SmolLM2-135M-Instruct (fixture ``smollm2_gguf``) in
Chromium, as a user meets it: it opens in chat mode, and two questions asked in a row are
answered as turns, the second in the context of the first, each ending at SmolLM2's own
end of turn (ChatML's <|im_end|>) with no marker or control character in the text."""

from __future__ import annotations

import os
from unittest import mock

from playwright import sync_api

from serve_support import (
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
)
from test_serve_page import ARGS, CHROMIUM, _chat_requests, _finished

QUESTIONS = ["What is the capital of France?", "And of Germany?"]
ANSWERS = ["The capital of France is Paris.", "The capital of Germany is Berlin."]


def test_the_page_chats_with_smollm2(smollm2_gguf, tmp_path) -> None:
    from tinylm.io.checkpoint import load_checkpoint

    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(tmp_path)}):
        model, tok = load_checkpoint(smollm2_gguf)
    with live_server(model, tok, model_name="smollm2") as (url, _), \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            requests = []
            page.on("request", lambda r: requests.append(r))
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('mode-hint').textContent",
                                   timeout=60_000)
            assert page.input_value("#mode") == "chat"
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "40")
            for n, question in enumerate(QUESTIONS, 1):
                page.fill("#prompt", question)
                page.press("#prompt", "Enter")
                page.wait_for_function(f"document.querySelectorAll('.turn').length === {2 * n}")
                _finished(page)
                assert page.text_content("#state") == "finished: stop"
            turns = page.eval_on_selector_all(".turn .content", "ts => ts.map(t => t.textContent)")
            assert turns == [QUESTIONS[0], ANSWERS[0], QUESTIONS[1], ANSWERS[1]]
            assert _chat_requests(requests)[-1]["messages"] == [
                {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": ANSWERS[0]},
                {"role": "user", "content": QUESTIONS[1]}]
        finally:
            browser.close()
