"""The web pages of ``tinylm serve`` in a real browser: Debian's Chromium, headless,
driven by Playwright (pointed at the system browser; nothing is downloaded). The page at
/ must work offline (every request it makes goes to the server itself), open in chat mode
on a model that chats and keep the conversation, show the server's own words when a
request fails, and keep an API key for the tab only (sessionStorage); the live explorer at
/explorer sends that key too."""

from __future__ import annotations

import pytest
import torch
from playwright import sync_api

from serve_support import (
    TEXT,
    live_server,
    one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    tiny_model_and_tokenizer,
)
from tinylm import generate
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data.chat import render_chat, stop_ids
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
REPLY = "Yes, a dog."  # what the rigged chat model answers, whatever it is asked
KEY = "a-key-of-twenty-chars"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _finished(page) -> None:
    """Wait until the page's generation has finished and it can send again."""
    page.wait_for_function(
        "document.getElementById('state').textContent.startsWith('finished')"
        " && !document.getElementById('send').disabled", timeout=30_000)


def test_page_streams_a_completion_and_shows_the_explorer(browser):
    with live_server(model_name="tiny", max_tokens=64) as (url, _):
        page = browser.new_page()
        try:
            outside = []
            page.on("request", lambda r: None if r.url.startswith(url)
                    else outside.append(r.url))
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('mode-hint').textContent")
            # no chat template: completion mode, and chat offered no more
            assert page.input_value("#mode") == "completion"
            assert page.is_disabled("#mode option[value=chat]")
            assert "no chat template" in page.text_content("#mode-hint")
            page.fill("#prompt", "The cat")
            page.fill("#max_tokens", "40")
            page.click("#send")
            _finished(page)
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
            assert page.get_attribute("a[href='/explorer']", "href") == "/explorer"
            assert outside == []  # no CDN, nothing off the server
        finally:
            page.close()


# --- chat mode ------------------------------------------------------------------------------


def rigged_chat_model() -> tuple[GPT, BPETokenizer]:
    """A tiny model in tinylm's chat format that answers REPLY and then ends its turn:
    the blocks add nothing (output projections zero) and there are no positions, so the
    next token depends on the current one only, and the LM head is a chain
    <|assistant|> -> REPLY's tokens -> <|end|> (each row the normalised embedding of the
    token before it, scaled far beyond any other logit)."""
    tok = BPETokenizer.train([TEXT * 4], vocab_size=300, special_tokens=STANDARD_SPECIALS)
    ids = tok.encode(REPLY)
    assert len(set(ids)) == len(ids)  # a chain: each token has one successor
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=64,
                            context_length=256, tie_embeddings=False)).eval()
    with torch.no_grad():
        for layer in (model.blocks[0].attn.out, model.blocks[0].ffn.down):
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
        model.pos_emb.weight.zero_()
        model.lm_head.weight.zero_()
        chain = [tok.token_to_id("<|assistant|>"), *ids, tok.token_to_id("<|end|>")]
        for before, after in zip(chain[:-1], chain[1:], strict=True):
            model.lm_head.weight[after] = 50 * model.final_norm(model.tok_emb.weight[before])
    return model, tok


def test_the_rigged_model_answers_its_reply_and_ends_the_turn():
    """The oracle of the chat test: tinylm.generate on the rendered conversation."""
    model, tok = rigged_chat_model()
    ids = render_chat(tok, [{"role": "user", "content": "Is it a cat?"}])
    out = generate(model, ids, 20, temperature=0, stop_ids=stop_ids(tok),
                   vocab_size=tok.vocab_size)[0, len(ids):].tolist()
    assert out[-1] == tok.token_to_id("<|end|>")
    assert tok.decode(out[:-1]) == REPLY


def _chat_requests(requests) -> list[dict]:
    """The page's chat requests (not the one-token probe of whether the model chats)."""
    bodies = [r.post_data_json for r in requests if r.url.endswith("/v1/chat/completions")]
    return [b for b in bodies if b["max_tokens"] != 1]


def test_page_opens_in_chat_mode_and_keeps_the_conversation(browser):
    model, tok = rigged_chat_model()
    with live_server(model, tok, model_name="chatty", max_tokens=64) as (url, _):
        page = browser.new_page()
        try:
            requests, errors = [], []
            page.on("request", lambda r: requests.append(r))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('mode-hint').textContent")
            assert page.input_value("#mode") == "chat"  # the model chats: chat mode
            assert page.is_visible("#chat") and not page.is_visible("#output")
            assert page.text_content("#send") == "Send"
            page.fill("#max_tokens", "20")
            page.fill("#prompt", "Is it a cat?")
            page.click("#send")
            _finished(page)
            assert page.input_value("#prompt") == ""  # sent: the box is free again
            page.fill("#prompt", "And now?")
            page.press("#prompt", "Enter")  # Enter sends in chat mode
            page.wait_for_function("document.querySelectorAll('.turn').length === 4")
            _finished(page)
            turns = page.eval_on_selector_all(
                ".turn", "ts => ts.map(t => [t.classList[1], "
                         "t.querySelector('.content').textContent])")
            assert turns == [["user", "Is it a cat?"], ["assistant", REPLY],
                             ["user", "And now?"], ["assistant", REPLY]]
            assert page.text_content("#state") == "finished: stop"  # at <|end|>
            for _, text in turns:
                assert "<|" not in text and all(c >= " " for c in text)
            first, second = _chat_requests(requests)
            assert first["messages"] == [{"role": "user", "content": "Is it a cat?"}]
            assert second["messages"] == [
                {"role": "user", "content": "Is it a cat?"},
                {"role": "assistant", "content": REPLY},
                {"role": "user", "content": "And now?"}]
            assert first["stream"] is second["stream"] is True
            # a failed message (max_tokens over the server's 64) shows the server's words,
            # gives the text back and stays out of the history
            page.fill("#max_tokens", "500")
            page.fill("#prompt", "Too long?")
            page.click("#send")
            page.wait_for_selector(".turn .error")
            error = page.text_content(".turn .error")
            assert error.startswith("the server answered 400") and "max_tokens" in error
            assert "64" in error
            assert page.input_value("#prompt") == "Too long?"
            assert page.text_content(".turn.assistant.failed .role") == "error"
            page.fill("#max_tokens", "20")
            page.fill("#prompt", "the cat " * 200)  # over the context of 256 tokens
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.turn .error').length === 2")
            error = page.locator(".turn .error").nth(1).text_content()
            assert "context length is 256" in error and "New chat" in error
            assert page.locator(".turn:not(.failed)").count() == 4  # the two exchanges
            page.fill("#prompt", "Too long?")
            page.click("#new-chat")
            assert page.locator(".turn").count() == 0
            page.fill("#system", "Be brief.")
            page.click("#send")
            page.wait_for_selector(".turn.assistant .content:text('Yes')")
            _finished(page)
            assert _chat_requests(requests)[-1]["messages"] == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Too long?"}]
            # what the page shows of a reply: control characters dropped, newlines kept
            assert page.evaluate("printable('a\\u0007b\\r\\nc\\u001b[0m\\u0085')") == "ab\nc[0m"
            assert errors == []
        finally:
            page.close()


# --- the API key ------------------------------------------------------------------------------


def test_the_key_is_kept_for_the_tab_and_the_live_explorer_sends_it(browser):
    with live_server(model_name="tiny", api_key=KEY) as (url, _):
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('notice').textContent")
            notice = page.text_content("#notice")
            assert notice.startswith("the server answered 401") and "API key" in notice
            assert "needed" in page.get_attribute("#key-box", "class")
            page.fill("#api-key", KEY)
            page.press("#api-key", "Tab")  # change: stored, and the model asked for again
            page.wait_for_function("document.getElementById('model-name').textContent")
            assert page.text_content("#notice") == ""
            assert page.evaluate("sessionStorage.getItem('tinylm-key')") == KEY
            assert page.evaluate("localStorage.getItem('tinylm-key')") is None
            # the live explorer, in the same tab: the key goes with every fetch
            sent, errors = [], []
            page.on("request", lambda r: sent.append(r.headers.get("authorization"))
                    if r.url.endswith("/v1/explore") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/explorer")
            assert page.input_value("#key-input") == KEY
            page.fill("#prompt-input", "The cat sat")
            page.click("#run")
            page.wait_for_function("document.querySelectorAll('#tokens .tok').length > 0",
                                   timeout=30_000)
            assert sent == [f"Bearer {KEY}"] and errors == []
        finally:
            context.close()


def test_the_live_explorer_asks_for_the_key_and_shows_errors(browser):
    with live_server(model_name="tiny", api_key=KEY) as (url, _):
        context = browser.new_context()  # a new tab: nothing stored
        try:
            page = context.new_page()
            page.goto(url + "/explorer")
            assert page.text_content("#summary").startswith("Type a prompt")
            page.fill("#prompt-input", "The cat sat")
            page.press("#prompt-input", "Control+Enter")
            page.wait_for_function(
                "document.getElementById('live-status').textContent.includes('401')")
            status = page.text_content("#live-status")
            assert "API key" in status and "Authorization: Bearer" in status
            assert page.get_attribute("#key-label", "class") == "needed"
            page.fill("#key-input", KEY)
            page.click("#run")
            page.wait_for_function("document.querySelectorAll('#tokens .tok').length > 0",
                                   timeout=30_000)
            assert page.get_attribute("#key-label", "class") == ""
            assert page.evaluate("sessionStorage.getItem('tinylm-key')") == KEY
            page.fill("#prompt-input", "")  # a 4xx: the server's message, not a bare status
            page.click("#run")
            page.wait_for_function(
                "document.getElementById('live-status').textContent.includes('answered 4')")
            assert "prompt" in page.text_content("#live-status")
        finally:
            context.close()


def test_the_page_takes_the_servers_word_on_chat_when_it_gives_one(browser):
    """A /v1/models entry with "chat": true (a server that says so) opens chat mode with
    no probe, even where the probe would say otherwise (this model has no template)."""
    model, tok = tiny_model_and_tokenizer(eos=False)  # no end-of-text: runs to max_tokens
    with live_server(model, tok, model_name="tiny") as (url, _):
        page = browser.new_page()
        try:
            def models(route):
                answer = route.fetch().json()
                answer["data"][0]["chat"] = True
                route.fulfill(json=answer)

            chats = []
            page.on("request", lambda r: chats.append(r.url)
                    if r.url.endswith("/v1/chat/completions") else None)
            page.route("**/v1/models", models)
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('mode-hint').textContent")
            assert page.input_value("#mode") == "chat" and chats == []
            page.select_option("#mode", "completion")
            assert page.is_visible("#output") and not page.is_visible("#chat")
            page.fill("#prompt", "The cat")
            page.fill("#max_tokens", "3")
            page.click("#send")
            _finished(page)
            assert page.text_content("#state").startswith("finished: length (Max tokens")
            assert chats == []
        finally:
            page.close()
