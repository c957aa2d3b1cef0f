"""A GGUF file as a tinylm checkpoint: ``tinylm convert --from-gguf``, ``--model x.gguf``
(through the private cache), and ``convert --from-hf ORG/NAME`` from the Hub's cache.

The GGUF files are written here: a tiny random Llama (transformers builds it; the writer of
tests/test_gguf.py lays its tensors out as llama.cpp's converter does) with a byte-level BPE
vocabulary trained on a few KB of text (tests/test_gguf_vocab.py's), SmolLM2's pre-tokenizer
name, bos/eos ids and a ChatML chat template. The oracles: tinylm's own readers of the
same file (``gguf_to_tinylm``, ``tokenizer_from_gguf``), which tests/test_gguf*.py prove
equal to transformers and llama.cpp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from test_gguf import encode, gguf_tensors, hf_model
from test_gguf_vocab import _byte_level_vocab
from tinylm import CheckpointError
from tinylm.commands.convert import import_model
from tinylm.data.chat import render_chat, stop_ids
from tinylm.data.gguf_vocab import tokenizer_from_gguf
from tinylm.io.checkpoint import load_checkpoint, resolve_checkpoint_dir
from tinylm.io.gguf import gguf_to_tinylm, read_gguf
from tinylm.layers.blocks import BlockLinear

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_gguf(path: Path, qtype: Q = Q.F32) -> Path:
    """A tiny Llama with a real vocabulary and ChatML, written as llama.cpp would."""
    tokens, types, merges = _byte_level_vocab()
    hf = hf_model("llama", vocab_size=len(tokens))
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-chat")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    for name, t in gguf_tensors(hf, "llama").items():
        data, kind = encode(t, qtype if t.ndim == 2 and name.startswith("blk.") else Q.F32)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


def _tinylm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", *map(str, args)], text=True,
                          capture_output=True, timeout=300, env={**os.environ, **(env or {})})


def _ids() -> torch.Tensor:
    return torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(1))


def test_convert_from_gguf_keeps_model_tokenizer_and_chat_template(chat_gguf, tmp_path) -> None:
    out = tmp_path / "ck"
    run = _tinylm("convert", "--from-gguf", chat_gguf, "--out", out)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"converted {chat_gguf} -> {out} (")
    assert "file tokenizer and its chat template; llama, F32 dequantized" in run.stdout
    model, tok = load_checkpoint(out)
    gm = read_gguf(chat_gguf)
    with torch.no_grad():
        assert torch.equal(model(_ids()), gguf_to_tinylm(gm)(_ids()))
    theirs = tokenizer_from_gguf(gm.fields)
    text = "Hello world! The quick brown fox, 12345 and <|im_end|>."
    assert tok.encode(text, allow_special=True) == theirs.encode(text, allow_special=True)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == CHATML
    assert (settings["bos_token"], settings["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert settings["model_max_length"] == 64
    messages = [{"role": "user", "content": "hi there"}]
    ids = render_chat(tok, messages)
    assert tok.decode(ids) == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.token_to_id("<|im_end|>") in stop_ids(tok)
    config = json.loads((out / "config.json").read_text())
    assert config["source"]["gguf"] == "tiny-chat.gguf"


def test_keep_quantized_writes_quantized_layers(tmp_path) -> None:
    path = write_chat_gguf(tmp_path / "q8.gguf", Q.Q8_0)
    info = import_model(path, tmp_path / "ck", keep_quantized=True)
    assert "kept as GGUF blocks where exact" in info.line()
    model, _ = load_checkpoint(tmp_path / "ck")
    kept = [m for m in model.blocks.modules() if isinstance(m, BlockLinear)]
    assert len(kept) == 2 * 5 and all(m.block_type == "Q8_0" for m in kept)  # qkv .. down
    assert type(model.lm_head) is torch.nn.Linear  # F32 in this file: float, as stored
    with torch.no_grad():
        assert torch.equal(model(_ids()), gguf_to_tinylm(path)(_ids()))


def test_a_gguf_file_is_a_model_for_every_command(chat_gguf, tmp_path) -> None:
    env = {"TINYLM_GGUF_CACHE": str(tmp_path / "cache")}
    first = _tinylm("sample", "--model", chat_gguf, "--prompt", "Hello", "--max-new-tokens",
                    "5", "--temperature", "0", env=env)
    assert first.returncode == 0, first.stderr
    assert "converting tiny-chat.gguf once into" in first.stderr
    again = _tinylm("sample", "--model", chat_gguf, "--prompt", "Hello", "--max-new-tokens",
                    "5", "--temperature", "0", env=env)
    assert again.returncode == 0 and "converting" not in again.stderr, again.stderr
    assert again.stdout == first.stdout
    info = _tinylm("info", chat_gguf, env=env)
    assert info.returncode == 0 and "llama" in info.stdout.lower(), info.stderr
    folders = list((tmp_path / "cache").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("tiny-chat-")


def test_the_cache_follows_the_file(chat_gguf, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINYLM_GGUF_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "m.gguf"
    copy.write_bytes(chat_gguf.read_bytes())
    first = resolve_checkpoint_dir(copy)
    assert resolve_checkpoint_dir(copy) == first
    os.utime(copy, ns=(1, 1))  # a changed file is converted again, into its own folder
    assert resolve_checkpoint_dir(copy) != first


@pytest.mark.parametrize("args, words", [
    (["convert", "--from-gguf", "missing.gguf", "--out", "x"], ["missing.gguf", "exist"]),
    (["convert", "--from-gguf", "model.bin", "--out", "x"], ["ends in .gguf", "--from-hf"]),
    (["convert", "--from-hf", "some/dir", "--out", "x", "--keep-quantized"],
     ["--keep-quantized", "--from-gguf only"]),
    (["sample", "--model", "missing.gguf"], ["missing.gguf", "does not exist"]),
])
def test_bad_gguf_arguments_are_one_line(tmp_path, args, words) -> None:
    run = _tinylm(*args, env={"TINYLM_GGUF_CACHE": str(tmp_path / "cache"),
                              "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    assert all(w in run.stderr for w in words), run.stderr


def _hub_cache(root: Path, repo: str) -> Path:
    """A Hugging Face Hub cache holding ``repo`` (a tiny Llama saved by transformers), laid
    out as huggingface_hub lays it: models--ORG--NAME/{refs/main, snapshots/<commit>/}."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    hf_model("llama").save_pretrained(snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    return snapshot


def test_from_hf_hub_name_offline_from_the_cache(tmp_path) -> None:
    _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    run = _tinylm("convert", "--from-hf", "tiny-org/tiny-llama", "--out", tmp_path / "ck",
                  env=env)
    assert run.returncode == 0, run.stderr
    assert "converted tiny-org/tiny-llama ->" in run.stdout
    model, _ = load_checkpoint(tmp_path / "ck")
    assert model.config.n_layer == 2 and model.config.n_kv_head == 2
    missing = _tinylm("convert", "--from-hf", "tiny-org/absent", "--out", tmp_path / "c2",
                      env=env)
    assert missing.returncode == 2 and "HF_HUB_OFFLINE" in missing.stderr, missing.stderr
    assert not (tmp_path / "c2").exists()


def test_a_missing_gguf_is_a_checkpoint_error(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(tmp_path / "none.gguf")
