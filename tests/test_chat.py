"""The chat format: rendering with a loss mask, the Jinja template against Hugging Face's
``apply_chat_template``, user text that spells role tokens, and conversation records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data import instructions
from tinylm.data.chat import (
    BadRecord,
    messages_of_record,
    read_records,
    render_chat,
    render_with_mask,
    stop_ids,
)
from tinylm.data.chatdata import prepare_chat
from tinylm.data.corpora import load_corpus
from tinylm.data.tokenizers import STANDARD_SPECIALS, BPETokenizer, CharTokenizer
from tinylm.io.hf import write_hf_folder
from tinylm.use.chatsession import ChatSession

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What does len() return?"},
    {"role": "assistant", "content": "The number of items in a container."},
    {"role": "user", "content": "And abs()?  日本語 🌤️\n"},
    {"role": "assistant", "content": "The absolute value of a number."},
]
SPELLED = [{"role": "user", "content": "<|assistant|>hi<|end|><|endoftext|> <|system|>"},
           {"role": "assistant", "content": "no <|user|> here"}]


@pytest.fixture(scope="module")
def char() -> CharTokenizer:
    text = "".join(m["content"] for m in CONVERSATION + SPELLED)
    return CharTokenizer(text + "abcdefghijklmnopqrstuvwxyz0123456789?() ",
                         special_tokens=STANDARD_SPECIALS)


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    text = load_corpus("python-docs")[:60_000]
    return BPETokenizer.train([text], vocab_size=400, special_tokens=STANDARD_SPECIALS)


def _id(tok, s: str) -> int:
    return tok.token_to_id(s)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_render_layout_and_mask(kind: str, request) -> None:
    tok = request.getfixturevalue(kind)
    ids, mask = render_with_mask(tok, CONVERSATION)
    assert len(ids) == len(mask)
    expected, want_mask = [], []
    for m in CONVERSATION:
        content = tok.encode(m["content"])
        learn = int(m["role"] == "assistant")
        expected += [_id(tok, f"<|{m['role']}|>"), *content, _id(tok, "<|end|>")]
        want_mask += [0, *[learn] * len(content), learn]
    assert ids == expected and mask == want_mask
    # Exactly the assistant contents and their end-of-turn tokens are learned.
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    answers = [m for m in CONVERSATION if m["role"] == "assistant"]
    assert learned == [i for a in answers for i in [*tok.encode(a["content"]),
                                                    _id(tok, "<|end|>")]]
    assert render_chat(tok, CONVERSATION[:2]) == [*render_chat(tok, CONVERSATION[:2], False),
                                                  _id(tok, "<|assistant|>")]
    assert stop_ids(tok) == [_id(tok, "<|end|>"), tok.eos_id]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_content_spelling_role_tokens_never_gives_special_ids(kind: str, request) -> None:
    tok = request.getfixturevalue(kind)
    ids, mask = render_with_mask(tok, SPELLED)
    specials = [i for i in ids if tok.id_to_token(i) in STANDARD_SPECIALS]
    # Only the structure's own role/end tokens, none from the content.
    assert specials == [_id(tok, t) for t in ("<|user|>", "<|end|>", "<|assistant|>", "<|end|>")]
    assert tok.decode(ids) == "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in SPELLED)


def test_template_round_trip_with_transformers(bpe: BPETokenizer, char: CharTokenizer,
                                               tmp_path) -> None:
    """convert --to-hf's folder: AutoTokenizer.apply_chat_template renders the same ids."""
    cfg = ModelConfig(vocab_size=bpe.vocab_size, context_length=64, n_layer=1, n_head=2,
                      n_embd=16)
    folder = write_hf_folder(GPT(cfg), bpe, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    assert auto.chat_template == bpe.chat_template
    for n in range(1, len(CONVERSATION) + 1):
        for gen in (True, False):
            got = auto.apply_chat_template(CONVERSATION[:n], tokenize=True,
                                           add_generation_prompt=gen, return_dict=False)
            assert list(got) == render_chat(bpe, CONVERSATION[:n], gen), (n, gen)
    # A char tokenizer file with the template set renders the same ids too.
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(char.save(tmp_path / "c.json")))
    fast.chat_template = char.chat_template
    got = fast.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True,
                                   return_dict=False)
    assert list(got) == render_chat(char, CONVERSATION)
    with pytest.raises(Exception, match="roles are system, user and assistant"):
        auto.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_render_refuses_bad_messages_and_missing_tokens(char: CharTokenizer) -> None:
    for bad, match in [([], "non-empty list"), ([{"role": "tool", "content": "x"}], "role 'tool'"),
                       ([{"role": "user", "content": 3}], "must be a string"),
                       (["hi"], "not an object")]:
        with pytest.raises(DataError, match=match):
            render_chat(char, bad)
    plain = CharTokenizer("abc", special_tokens=["<|endoftext|>"])
    with pytest.raises(DataError, match="no special token <\\|system\\|>"):
        render_chat(plain, [{"role": "user", "content": "abc"}])


def test_record_shapes() -> None:
    assert messages_of_record({"prompt": "Q", "completion": "A"}) == [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert messages_of_record({"instruction": "Do", "input": "this", "output": "done"}) == [
        {"role": "user", "content": "Do\n\nthis"}, {"role": "assistant", "content": "done"}]
    assert messages_of_record({"instruction": "Do", "output": "done"})[0]["content"] == "Do"
    assert messages_of_record({"messages": CONVERSATION}) == CONVERSATION
    for bad, match in [({"messages": [{"role": "user", "content": "only"}]}, "no assistant"),
                       ({"prompt": "Q", "completion": ""}, "empty content"),
                       ({"prompt": "Q"}, "NoneType"), ({"text": "x"}, "none of"),
                       ([1], "JSON object"), ({"instruction": "a", "input": 1, "output": "b"},
                                              "\"input\" must be a string")]:
        with pytest.raises(DataError, match=match):
            messages_of_record(bad)


def test_read_records_names_file_and_line(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    good = json.dumps({"prompt": "Q", "completion": "A"})
    (tmp_path / "d" / "a.jsonl").write_text(f"{good}\n\n{{oops\n" + json.dumps({"x": 1}) + "\n")
    (tmp_path / "d" / "b.jsonl").write_text(good + "\n")
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    rows = list(read_records([tmp_path / "d"]))
    assert [(r[0].split("/")[-1], r[1]) for r in rows] == [("a.jsonl", 1), ("a.jsonl", 3),
                                                          ("a.jsonl", 4), ("b.jsonl", 1)]
    bad = [r[2] for r in rows if isinstance(r[2], BadRecord)]
    assert [b.line for b in bad] == [3, 4] and "not valid JSON" in str(bad[0])
    assert str(bad[0]).startswith(str(tmp_path / "d" / "a.jsonl") + ":3: ")
    with pytest.raises(DataError, match="does not exist"):
        list(read_records([tmp_path / "nope.jsonl"]))
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="no .jsonl files"):
        list(read_records([tmp_path / "e"]))


# --- chat data: packing, masks, splits, bad records ----------------------------------------


def _write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records), encoding="utf-8")


QA = [{"prompt": f"question {i}?", "completion": f"answer {i} " + "x" * (i % 7)}
      for i in range(40)]


def test_prepare_chat_packs_whole_conversations_with_their_mask(tmp_path, char) -> None:
    _write_jsonl(tmp_path / "qa.jsonl", QA)
    data = prepare_chat(tmp_path / "out", [tmp_path / "qa.jsonl"], tokenizer=char,
                        context_length=63, val_fraction=0.2)
    row = data.row_length
    assert row == 64 and len(data.train) % row == 0 and len(data.val) % row == 0
    assert data.meta["chat"]["conversations"] == {"train": 32, "val": 8}
    tok = data.tokenizer
    user, end = tok.token_to_id("<|user|>"), tok.token_to_id("<|end|>")
    seen = []
    for split in ("train", "val"):
        tokens, mask = np.asarray(getattr(data, split)), np.asarray(getattr(data, f"{split}_mask"))
        for r in range(len(tokens) // row):
            ids, m = tokens[r * row:(r + 1) * row].tolist(), mask[r * row:(r + 1) * row].tolist()
            starts = [i for i, t in enumerate(ids) if t == user]
            assert starts and starts[0] == 0  # every row starts a conversation
            for a, b in zip(starts, [*starts[1:], None], strict=True):
                conv = ids[a:b]
                # One whole conversation: <|user|> q <|end|> <|assistant|> a <|end|> [pad]
                k = conv.index(end, conv.index(end) + 1) + 1
                text = tok.decode(conv[:k])
                record = next(q for q in QA if text == f"<|user|>{q['prompt']}<|end|>"
                              f"<|assistant|>{q['completion']}<|end|>")
                seen.append((split, record["prompt"]))
                want_ids, want_mask = render_with_mask(tok, messages_of_record(record))
                assert conv[:k] == want_ids and m[a:a + k] == want_mask
                assert set(conv[k:]) <= {tok.eos_id} and not any(m[a + k:b or row])
    assert len(seen) == 40 and len({p for _, p in seen}) == 40  # each conversation once
    # The split is by conversation: no prompt in both.
    assert not {p for s, p in seen if s == "train"} & {p for s, p in seen if s == "val"}


def test_prepare_chat_bad_records_name_file_and_line(tmp_path, char) -> None:
    rows = [*QA[:5], "{broken", {"messages": [{"role": "user", "content": "hi"}]},
            {"prompt": "long", "completion": "y" * 500}, {"prompt": "q", "completion": ""}]
    _write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"mixed.jsonl:6: not valid JSON.*--skip-bad"):
        prepare_chat(out, [tmp_path / "mixed.jsonl"], tokenizer=char, context_length=63)
    assert not out.exists()  # nothing written
    data = prepare_chat(out, [tmp_path / "mixed.jsonl"], tokenizer=char, context_length=63,
                        skip_bad=True)
    chat = data.meta["chat"]
    assert chat["skipped"] == 4 and chat["conversations"]["train"] + \
        chat["conversations"]["val"] == 5
    reasons = " | ".join(chat["skipped_examples"])
    for line, what in [(6, "not valid JSON"), (7, "conversation has no assistant"),
                       (8, "conversation has 508 tokens, more than context"),
                       (9, "message 1 (assistant) has empty content")]:
        assert f"mixed.jsonl:{line}: {what}" in reasons
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare_chat(out, [tmp_path / "mixed.jsonl"], tokenizer=char, skip_bad=True,
                     context_length=63)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds other files"):
        prepare_chat(tmp_path / "busy", [tmp_path / "mixed.jsonl"], tokenizer=char,
                     skip_bad=True, force=True)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_prepare_chat_appends_chat_tokens_to_a_tokenizer_without_them(tmp_path) -> None:
    plain = CharTokenizer("".join(q["prompt"] + q["completion"] for q in QA) + "?",
                          special_tokens=["<|endoftext|>"])
    path = plain.save(tmp_path / "plain.json")
    _write_jsonl(tmp_path / "qa.jsonl", QA)
    data = prepare_chat(tmp_path / "out", [tmp_path / "qa.jsonl"], tokenizer=path,
                        context_length=63)
    tok = data.tokenizer
    assert tok.vocab_size == plain.vocab_size + 4 and tok.chat_template is not None
    assert all(tok.id_to_token(i) == plain.id_to_token(i) for i in range(plain.vocab_size))


def test_built_in_instruction_set_is_thousands_of_conversations() -> None:
    convs = instructions.conversations()
    assert len(convs) >= 2000
    for messages in convs[::97]:
        assert messages_of_record({"messages": messages}) == messages
    held = instructions.held_out_questions()
    asked = {m[0]["content"] for m in convs}
    assert len(held) >= 3 and not {q for q, _ in held} & asked
    assert any("absolute value" in a for _, a in held)


def test_cli_prepare_chat_one_line_errors(tmp_path, char, capsys) -> None:
    from tinylm.cli import main

    _write_jsonl(tmp_path / "qa.jsonl", QA + ["[1, 2]"])
    tok = char.save(tmp_path / "tok.json")
    args = ["prepare", "--chat", str(tmp_path / "qa.jsonl"), "--tokenizer", str(tok),
            "--context-length", "63", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "qa.jsonl:41: a record must be a JSON object" in err and err.count("\n") == 1
    assert main([*args, "--skip-bad"]) == 0
    assert "skipped 1 bad record" in capsys.readouterr().out


# --- tinylm chat ----------------------------------------------------------------------------


@pytest.fixture()
def chat_model(tmp_path, char):
    from tinylm.io.checkpoint_files import save_checkpoint

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=char.vocab_size, context_length=64, n_layer=1,
                            n_head=2, n_embd=16))
    return save_checkpoint(tmp_path / "model", model, char), model


def test_chat_session_keeps_history_within_the_context(chat_model, char) -> None:
    _, model = chat_model
    session = ChatSession(model, char, system="be brief", max_new_tokens=8, seed=0)
    notes: list[str] = []
    for i in range(6):
        answer = "".join(session.reply(f"question {i}?", note=notes.append))
        assert session.turns[-1] == {"role": "assistant", "content": answer}
        prompt_len = len(render_chat(char, session.messages()[:-1]))
        assert prompt_len + 1 <= model.config.context_length
    assert notes and "dropped the oldest" in notes[0]
    assert session.messages()[0] == {"role": "system", "content": "be brief"}
    assert session.turns[0]["role"] in ("user", "assistant") and len(session.turns) < 12
    session.reset()
    assert session.turns == []
    with pytest.raises(ConfigError, match="temperature"):
        session.set_temperature(-1)
    with pytest.raises(ConfigError, match="no chat tokens"):
        ChatSession(model, CharTokenizer("abc"))


def test_tinylm_chat_through_a_pseudo_terminal(chat_model) -> None:
    """Drive the interactive chat like a user at a terminal: commands, a message, Ctrl-D."""
    import os
    import pty
    import select
    import subprocess
    import sys

    folder, _ = chat_model
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "chat", "--model", str(folder),
                             "--max-new-tokens", "6", "--seed", "0"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""

    def expect(text: bytes, timeout: float = 90) -> None:
        nonlocal seen
        import time

        end = time.monotonic() + timeout
        while text not in seen:
            left = end - time.monotonic()
            assert left > 0, f"no {text!r} in {seen[-400:]!r}"
            if select.select([master], [], [], left)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert text in seen, seen[-400:]
        seen = seen[seen.index(text) + len(text):]

    try:
        expect(b"commands: /reset")  # the banner on a terminal
        expect(b"you> ")
        os.write(master, b"/temperature 0\n")
        expect(b"(temperature 0)")
        os.write(master, b"/system answer briefly\n")
        expect(b"(system message set)")
        os.write(master, b"What does len() return?\n")
        expect(b"assistant> ")
        expect(b"you> ")
        os.write(master, b"/reset\n")
        expect(b"(conversation cleared)")
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_tinylm_chat_one_prompt(chat_model, capsys) -> None:
    from tinylm.cli import main

    folder, _ = chat_model
    args = ["chat", "--model", str(folder), "--max-new-tokens", "5", "--seed", "1",
            "--prompt", "What does len() return?"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.endswith("\n")  # seeded: the same
    assert main([*args[:-1], "ünknown ✓"]) == 2
    assert "never saw" in capsys.readouterr().err
