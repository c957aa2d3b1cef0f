"""Every command on the real SmolLM2-135M-Instruct GGUF (issue 29, item 6): sample, eval,
info, serve with the official ``openai`` client, quantize to int8, prepare --chat and a
LoRA finetune, and convert --to-hf loaded back by transformers.

The file is converted once per session into a private cache (``TINYLM_GGUF_CACHE`` in a
tmp folder), and every command is given the ``.gguf`` file itself, as a user would; the
commands run in-process through ``tinylm.cli.main`` (the same code as the ``tinylm``
executable, without a Python start per call), ``serve`` as a subprocess. The oracle for
perplexity and the chat template is transformers on the ``convert --to-hf`` export (that
the import equals transformers' own GGUF loader is tests/test_smollm2.py's part).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from serve_support import wait_healthy
from tinylm.cli import main

FRANCE = "What is the capital of France?"
#: SmolLM2's greedy answer (equal to transformers' greedy answer from the same file:
#: tests/test_smollm2.py).
PARIS = "The capital of France is Paris."
#: The system turn SmolLM2's template puts first when a conversation has none.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: A few KB of ordinary English prose (written for this test), for eval's perplexity.
ENGLISH = """\
The river runs through the middle of the old town, and for most of its history the town
lived from it. Boats carried grain and timber down to the coast, and the mills along the
banks ground flour for the villages around. In the spring the water rose and sometimes
flooded the lower streets, so the houses there were built with their doors a few steps
above the ground. Today the mills are museums and cafes, and the boats that still use the
river carry visitors instead of grain.

Every Saturday morning there is a market on the main square. Farmers from the hills bring
cheese, honey, apples and potatoes, and a baker sells bread that is still warm from the
oven. People come early to find the best vegetables, and by noon most of the stalls are
empty. Children like the market because one of the farmers keeps a small goat next to his
table, and they are allowed to feed it with pieces of carrot.

The school stands at the top of the hill, next to the church. It was built more than a
hundred years ago, when the town decided that every child should learn to read and write.
The building has large windows, high ceilings and a bell that once called the pupils to
their lessons. Now the bell is only rung on the first day of the school year, and the
children are called by an electric signal like in any other school.

In winter the days are short and the town becomes very quiet. Snow covers the roofs and
the streets, and the river freezes near the banks. Families stay at home in the evenings,
reading, cooking and playing games. When the weather is clear, the people who live on the
hill can see the lights of the city far away on the plain, and on very cold nights the
stars seem brighter than anywhere else.

Many young people leave the town to study or work in the city, but a good number of them
come back later. They say that life is slower here, that the air is cleaner and that it is
easier to raise children in a place where everybody knows everybody. Some of them open
small businesses: a bookshop, a workshop that repairs bicycles, a restaurant that cooks
with food from the market. Slowly, the old town changes, but it keeps its character.

Scientists study how plants grow by measuring their height, the size of their leaves and
the amount of water they use. A plant needs light, water, air and nutrients from the soil.
In a simple experiment, two groups of seeds are planted in the same soil, but one group is
kept in the dark. After two weeks, the plants in the light are green and strong, while the
plants in the dark are pale and thin. This shows that light is necessary for plants to
make their own food, a process called photosynthesis.

Computers follow instructions written by people. A program is a list of such instructions,
and a programming language is a way to write them so that both people and computers can
understand them. When a program has an error, it may stop or give a wrong answer, and the
programmer must find the mistake and correct it. Good programmers write small pieces of
code, test each of them carefully and give their functions clear names.
"""

#: SmolLM2's own template written out by hand (ChatML with its default system turn), for
#: the rows of prepared chat data: what they must decode to, independent of tinylm.
CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


def _chat_records() -> list[dict]:
    """40 short conversations of a format the model does not know (so a few LoRA steps
    show on the held-out loss): 20 without a system turn, 20 with one."""
    capitals = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"),
                ("Spain", "Madrid"), ("Portugal", "Lisbon"), ("Japan", "Tokyo"),
                ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
                ("Peru", "Lima"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
                ("Greece", "Athens"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
                ("Ireland", "Dublin"), ("Chile", "Santiago"), ("Cuba", "Havana"),
                ("Iran", "Tehran"), ("Russia", "Moscow")]
    rows = [{"messages": [{"role": "user", "content": f"Capital of {country}?"},
                          {"role": "assistant", "content": f"CAPITAL: {city.upper()}."}]}
            for country, city in capitals]
    rows += [{"messages": [{"role": "system", "content": "Answer tersely."},
                           {"role": "user", "content": f"Double {a}?"},
                           {"role": "assistant", "content": f"DOUBLE: {2 * a}."}]}
             for a in range(2, 22)]
    return rows


def _cli(*argv: str, capsys, cache: Path) -> str:
    """``tinylm ARGV`` in this process (with the session's GGUF cache); its stdout."""
    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(cache)}):
        code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, f"tinylm {' '.join(argv)} -> {code}: {err}"
    return out


@pytest.fixture(scope="session")
def cache(smollm2_gguf, tmp_path_factory) -> Path:
    """The session's GGUF cache, with the file converted into it once."""
    from tinylm.io.checkpoint import resolve_checkpoint_dir

    root = tmp_path_factory.mktemp("gguf-cache")
    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(root)}):
        resolve_checkpoint_dir(smollm2_gguf)
    return root


@pytest.fixture(scope="session")
def checkpoint(smollm2_gguf, cache) -> Path:
    """The converted checkpoint folder (for library calls)."""
    from tinylm.io.checkpoint import resolve_checkpoint_dir

    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(cache)}):
        return resolve_checkpoint_dir(smollm2_gguf)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from tinylm.io.checkpoint import load_tokenizer_of

    return load_tokenizer_of(checkpoint)


@pytest.fixture(scope="session")
def hf_export(smollm2_gguf, cache, tmp_path_factory):
    """``tinylm convert --model FILE.gguf --to-hf OUT``, loaded back by transformers:
    (folder, model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("hf") / "smollm2"
    with mock.patch.dict(os.environ, {"TINYLM_GGUF_CACHE": str(cache)}):
        assert main(["-q", "convert", "--model", str(smollm2_gguf), "--to-hf", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return out, model, AutoTokenizer.from_pretrained(out)


def test_sample_greedy_and_sampled_end_at_the_models_eos(smollm2_gguf, cache, checkpoint,
                                                         tokenizer, capsys) -> None:
    """`tinylm sample --model FILE.gguf`: a ChatML prompt (its special tokens allowed) is
    answered and the sample ends at <|im_end|>, SmolLM2's eos, long before the limit;
    sampling with a seed gives the library's own samples for that seed."""
    from tinylm.io.checkpoint import load_model
    from tinylm.use.sampling import encode_prompt, generate

    prompt = CHATML.format(role="user", content=FRANCE) + "<|im_start|>assistant\n"
    out = _cli("sample", "--model", str(smollm2_gguf), "--prompt", prompt, "--allow-special",
               "--temperature", "0", "--max-new-tokens", "40", "--no-echo",
               capsys=capsys, cache=cache)
    assert out == PARIS + "\n"
    model = load_model(checkpoint)
    ids = encode_prompt(tokenizer, prompt, allow_special=True)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")  # the spelling became the token
    eos = tokenizer.eos_id
    assert tokenizer.decode([eos]) == "<|im_end|>"
    new = generate(model, torch.tensor([ids]), 40, temperature=0, stop_ids=[eos])
    new = new[0, len(ids):].tolist()  # ends at the first eos, far from the limit
    assert new[-1] == eos and len(new) < 20 and tokenizer.decode(new[:-1]) == PARIS

    argv = ("sample", "--model", str(smollm2_gguf), "--prompt", prompt, "--allow-special",
            "--temperature", "0.8", "--top-p", "0.95", "--seed", "7", "--num-samples", "2",
            "--max-new-tokens", "40", "--no-echo")
    sampled = _cli(*argv, capsys=capsys, cache=cache)
    texts = [part.split("\n", 1)[1].rstrip("\n") for part in sampled.split("--- sample ")[1:]]
    assert len(texts) == 2 and all(texts)
    rows = generate(model, torch.tensor([ids, ids]), 40, temperature=0.8, top_p=0.95, seed=7,
                    stop_ids=[eos])
    for text, row in zip(texts, rows[:, len(ids):].tolist(), strict=True):
        assert eos in row, "a sampled answer did not end at <|im_end|> within 40 tokens"
        assert text == tokenizer.decode(row[:row.index(eos)])


def test_eval_perplexity_equals_transformers(smollm2_gguf, cache, tokenizer, hf_export,
                                             tmp_path, capsys) -> None:
    """`tinylm eval --text` on a few KB of English: a sane perplexity for a 135M model,
    equal to the one computed from transformers' logits on the same ids."""
    text_file = tmp_path / "english.txt"
    text_file.write_text(ENGLISH)
    result = json.loads(_cli("eval", "--model", str(smollm2_gguf), "--text", str(text_file),
                             "--json", capsys=capsys, cache=cache))
    ids = tokenizer.encode(ENGLISH)  # add_bos_token is false for SmolLM2: no prefix
    assert hf_export[2](ENGLISH)["input_ids"] == ids  # the exported tokenizer agrees
    assert 600 < len(ids) < 8192 and result["tokens"] == len(ids) - 1  # one window
    with torch.inference_mode():
        logits = hf_export[1](torch.tensor([ids])).logits[0].double()
    want = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert result["loss"] == pytest.approx(want, rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(want), rel=1e-3)
    assert 2.0 < result["perplexity"] < 40.0
    assert 0.3 < result["bits_per_byte"] < 1.5


def test_info_describes_the_gguf_model(smollm2_gguf, cache, capsys) -> None:
    """`tinylm info --model FILE.gguf`: SmolLM2-135M's shape, its parameter count, its
    tokenizer's eos, and where it was converted from."""
    from tinylm.cli.use import _info_lines

    info = json.loads(_cli("info", "--model", str(smollm2_gguf), "--json", capsys=capsys,
                           cache=cache))["checkpoint"]
    m = info["model"]
    assert (m["n_layer"], m["n_head"], m["n_kv_head"], m["n_embd"], m["vocab_size"]) == \
        (30, 9, 3, 576, 49152)
    assert (m["norm"], m["position"], m["mlp"], m["tie_embeddings"]) == \
        ("rmsnorm", "rope", "swiglu", True)
    assert m["rope_theta"] == 100000.0 and m["context_length"] == 8192
    assert info["parameters"] == 134_515_008  # SmolLM2-135M's count (tied head once)
    assert info["tokenizer"] == {"kind": "file", "vocab_size": 49152, "eos": "<|im_end|>",
                                 "chat": "its own template (turns end with <|im_end|>)"}
    assert info["source"]["gguf"] == smollm2_gguf.name
    assert info["source"]["architecture"] == "llama"
    lines = dict(_info_lines(info))  # what `tinylm info` prints from the same record
    assert lines["converted"].startswith(f"from {smollm2_gguf.name} (llama, 98.4 MB")
    assert lines["parameters"] == "134,515,008"
    assert lines["tokenizer"] == "file, 49,152 tokens, end-of-text <|im_end|>"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_the_openai_client(smollm2_gguf, cache) -> None:
    """`tinylm serve --model FILE.gguf` as a user runs it, with the official client:
    /v1/models names the file, chat completions (streamed and not) answer in SmolLM2's
    own template and stop at its end of turn."""
    import openai

    port = _free_port()
    env = {**os.environ, "TINYLM_GGUF_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "tinylm", "-q", "serve", "--model",
                             str(smollm2_gguf), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 120, lambda: proc.stderr.read().decode())
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        name = "SmolLM2-135M-Instruct.Q4_1"  # the file's name, not its cache folder's
        assert [m.id for m in client.models.list().data] == [name]
        messages = [{"role": "user", "content": FRANCE}]
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                           temperature=0)
        assert r.choices[0].message.content == PARIS
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
        stream = client.chat.completions.create(model=name, messages=messages,
                                                max_tokens=40, temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PARIS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        code = client.chat.completions.create(
            model=name, temperature=0, max_tokens=20,
            messages=[{"role": "system", "content": "You are a concise assistant."},
                      {"role": "user", "content": "Who wrote Romeo and Juliet?"}])
        assert "Shakespeare" in code.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(30)


def _answer(model_dir: Path, question: str) -> str:
    from tinylm.use.chatsession import open_session

    session = open_session(str(model_dir), temperature=0, max_new_tokens=40, device="cpu")
    return "".join(session.reply(question))


def test_quantize_int8_still_answers(smollm2_gguf, cache, checkpoint, tmp_path,
                                     capsys) -> None:
    """`tinylm quantize --model FILE.gguf --bits 8`: every Linear of the 30 blocks as int8
    with per-channel scales (the tied embedding stays float32); the int8 model gives the
    same greedy answer to the France question as the float32 one."""
    from tinylm.io.checkpoint import read_config

    out = tmp_path / "int8"
    report = _cli("quantize", "--model", str(smollm2_gguf), "--bits", "8", "--out", str(out),
                  capsys=capsys, cache=cache)
    assert "blocks.29.ffn.down" in report and f"wrote {out}" in report
    quantized = read_config(out)["quantize"]
    assert len(quantized) == 30 * 5  # qkv, out, gate, up, down of each block
    assert {q["bits"] for q in quantized.values()} == {8}
    size = (out / "model.safetensors").stat().st_size
    assert size < 0.45 * (checkpoint / "model.safetensors").stat().st_size
    assert _answer(out, FRANCE) == _answer(checkpoint, FRANCE) == PARIS


def test_prepare_chat_masks_only_assistant_spans_and_lora_lowers_held_out_loss(
        smollm2_gguf, cache, checkpoint, tokenizer, tmp_path, capsys) -> None:
    """`tinylm prepare --chat FILE --tokenizer FILE.gguf` renders each conversation in
    SmolLM2's template (its default system turn included) with the loss mask on the
    assistant's content and its <|im_end|> only; `tinylm finetune --model FILE.gguf
    --lora-rank 8` for a few steps lowers the held-out loss on those tokens."""
    from tinylm.data.chatdata import load_chat_data
    from tinylm.io.checkpoint import load_model
    from tinylm.use.evaluation import estimate_loss, sample_windows

    records = _chat_records()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in records))
    data_dir = tmp_path / "data"
    _cli("prepare", "--chat", str(chat), "--tokenizer", str(smollm2_gguf), "--out",
         str(data_dir), "--context-length", "64", "--val-fraction", "0.2", capsys=capsys,
         cache=cache)
    data = load_chat_data(data_dir)
    assert data.tokenizer.to_hf_json() == tokenizer.to_hf_json()  # no tokens added
    by_user = {r["messages"][-2]["content"]: r["messages"] for r in records}
    seen = []
    pad = tokenizer.token_to_id("<|im_end|>")
    for split in ("train", "val"):
        ids, mask = np.asarray(getattr(data, split)), np.asarray(getattr(data, f"{split}_mask"))
        for start in range(0, len(ids), data.row_length):  # rows of whole conversations
            row = ids[start:start + data.row_length].tolist()
            counts = mask[start:start + data.row_length].tolist()
            at = 0
            while at < len(row) and row[at] != pad:
                user = tokenizer.decode(row[at:]).split("<|im_start|>user\n", 1)[1]
                messages = by_user[user.split("<|im_end|>", 1)[0]]
                if messages[0]["role"] != "system":
                    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
                rendered = "".join(CHATML.format(**m) for m in messages)
                n = len(tokenizer.encode(rendered, allow_special=True))
                assert tokenizer.decode(row[at:at + n]) == rendered
                counted = [t for t, k in zip(row[at:at + n], counts[at:at + n], strict=True)
                           if k]
                assert tokenizer.decode(counted) == messages[-1]["content"] + "<|im_end|>"
                seen.append(messages[-2]["content"])
                at += n
            assert set(row[at:]) <= {pad} and not any(counts[at:])  # padding, not counted
    assert sorted(seen) == sorted(by_user)  # each conversation in one row, none lost

    run = tmp_path / "run"
    _cli("finetune", "--model", str(smollm2_gguf), "--data", str(data_dir), "--out", str(run),
         "--lora-rank", "8", "--max-steps", "4", "--batch-size", "4", "--warmup-steps", "1",
         "--eval-every", "1000", "--save-every", "1000", "--no-progress", capsys=capsys,
         cache=cache)
    records_out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().split("\n")
                   if line]
    final = next(r for r in records_out if r.get("final"))
    C = data.row_length - 1  # the windows finetune trains and evaluates (rows of C + 1)
    windows = sample_windows(len(data.val), C, None, 1337)
    before = estimate_loss(load_model(checkpoint), data.val, windows, context_length=C,
                           loss_mask=data.val_mask).loss
    assert final["val_loss"] < 0.8 * before, (before, final["val_loss"])
    config = json.loads((run / "latest" / "config.json").read_text())
    assert config["model"]["context_length"] == 8192  # trained on short rows, kept its length
    assert set(config["lora"]["layers"].values()) == {8}  # rank 8 adapters


def test_convert_to_hf_renders_the_same_chat_ids(tokenizer, hf_export) -> None:
    """`tinylm convert --model FILE.gguf --to-hf OUT` loads in transformers: its
    apply_chat_template gives tinylm's ids, and its greedy answer is tinylm's."""
    from tinylm.data.chat import render_chat

    folder, model, hf_tok = hf_export
    assert json.loads((folder / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    conversations = [
        [{"role": "user", "content": FRANCE}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "Café, naïve, 日本語 🙂"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=gen, return_dict=True)
            assert render_chat(tokenizer, messages, add_generation_prompt=gen) == \
                list(want["input_ids"])
    ids = render_chat(tokenizer, conversations[0])
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                             eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)
    assert hf_tok.decode(out[0, len(ids):], skip_special_tokens=True) == PARIS


def test_default_model_name_names_the_file_or_the_run(tmp_path) -> None:
    """serve's default model id: a GGUF file's stem, a run folder's own name (not
    ``latest``), a checkpoint folder's name."""
    from tinylm.serve import default_model_name

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert default_model_name(gguf, tmp_path / "cache" / "x-0123") == \
        "SmolLM2-135M-Instruct.Q4_1"
    (tmp_path / "run" / "latest").mkdir(parents=True)
    assert default_model_name(tmp_path / "run", tmp_path / "run" / "latest") == "run"
    assert default_model_name(tmp_path / "ckpt", tmp_path / "ckpt") == "ckpt"
