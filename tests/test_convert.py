"""`tinylm convert`: Hugging Face GPT-2 folder <-> tinylm checkpoint, tokenizers included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tinylm.cli import main
from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data.tokenizers import BPETokenizer, CharTokenizer
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint

TEXT = "This is a pen. That is a book.\nこれはペンです。 naïve café " * 20
SAMPLE = "This is a book. これは本です。 <|endoftext|> x\n  y"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([TEXT], vocab_size=320, special_tokens=["<|endoftext|>"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, bpe: BPETokenizer) -> Path:
    """A tiny random GPT-2 saved with save_pretrained, plus GPT-2 style tokenizer files."""
    folder = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    cfg = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=32, n_embd=24,
                                  n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    bpe.hf.model.save(str(folder))  # vocab.json + merges.txt, as GPT-2 ships them
    return folder


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_round_trip_hf_tinylm_hf(hf_dir: Path, bpe: BPETokenizer, tmp_path: Path,
                                 capsys) -> None:
    ours, back = tmp_path / "tinylm", tmp_path / "hf-again"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ours)]) == 0
    assert main(["convert", "--model", str(ours), "--to-hf", str(back)]) == 0
    assert "exported" in capsys.readouterr().out
    original = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    model, tok = load_checkpoint(ours)
    again = transformers.GPT2LMHeadModel.from_pretrained(back).eval()
    ids = torch.tensor([bpe.encode(SAMPLE)[:32]])
    expected = _logits(original, ids)
    torch.testing.assert_close(_logits(model, ids), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(again, ids), expected, atol=0, rtol=0)
    # The tokenizer travelled with the weights; AutoTokenizer reads the exported one.
    assert tok is not None and tok.encode(SAMPLE) == bpe.encode(SAMPLE)
    auto = transformers.AutoTokenizer.from_pretrained(back)
    # HF matches special tokens' spellings in text; tinylm only when asked.
    assert auto(SAMPLE)["input_ids"] == bpe.encode(SAMPLE, allow_special=True)
    assert auto(SAMPLE, split_special_tokens=True)["input_ids"] == bpe.encode(SAMPLE)
    assert auto.decode(bpe.encode(SAMPLE)) == SAMPLE
    assert len(auto) == bpe.vocab_size and auto.eos_token == "<|endoftext|>"


def test_pytorch_model_bin_is_read_with_weights_only(hf_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    legacy = tmp_path / "legacy"
    shutil.copytree(hf_dir, legacy)
    state = load_file(legacy / "model.safetensors")
    (legacy / "model.safetensors").unlink()
    torch.save(state, legacy / "pytorch_model.bin")
    assert main(["convert", "--from-hf", str(legacy), "--out", str(tmp_path / "t")]) == 0
    model, _ = load_checkpoint(tmp_path / "t")
    original = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(_logits(model, ids), _logits(original, ids), atol=1e-5, rtol=0)


def test_char_tokenizer_is_refused_unless_weights_only(tmp_path: Path, capsys) -> None:
    tok = CharTokenizer("abc 日本")
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=8, n_layer=1, n_head=2,
                            n_embd=8))
    ckpt = save_checkpoint(tmp_path / "char", model, tok)
    assert main(["convert", "--model", str(ckpt), "--to-hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "byte-level BPE" in err[0] and "--weights-only" in err[0]
    assert not (tmp_path / "out").exists()
    assert main(["convert", "--model", str(ckpt), "--to-hf", str(tmp_path / "out"),
                 "--weights-only"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[0, 1, 2, 3]])
    torch.testing.assert_close(_logits(hf, ids), _logits(model.eval(), ids), atol=1e-5, rtol=0)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_bad_inputs(hf_dir: Path, tmp_path: Path, capsys) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(hf_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 20)
    mismatched = tmp_path / "mismatched"
    shutil.copytree(hf_dir, mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["n_embd"] = 48
    (mismatched / "config.json").write_text(json.dumps(cfg))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    ours = tmp_path / "ours"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ours)]) == 0
    capsys.readouterr()
    cases = [
        ["--from-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
        ["--from-hf", str(corrupt), "--out", str(tmp_path / "x")],
        ["--from-hf", str(mismatched), "--out", str(tmp_path / "x")],
        ["--model", str(tmp_path / "missing"), "--to-hf", str(tmp_path / "x")],
        ["--model", str(ours), "--to-hf", str(occupied)],
        ["--from-hf", str(hf_dir)],
        ["--model", str(ours), "--out", str(tmp_path / "x")],
        [],
    ]
    for args in cases:
        assert main(["convert", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tinylm convert: error:"), (args, err)
    assert not (tmp_path / "x").exists()
    assert (occupied / "keep.txt").read_text() == "mine"


def test_from_hf_out_never_deletes_a_users_files(hf_dir: Path, tmp_path: Path, capsys) -> None:
    """--out that is a file, a folder with other files, a run folder or the HF folder
    itself is refused; an existing checkpoint is replaced only with --force."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    run = tmp_path / "run"
    (run / "latest").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    for out, words in ((notes, "notes.txt"), (run, "training run folder"), (afile, "is a file"),
                       (hf_dir, "not a tinylm checkpoint")):
        before = sorted(p.name for p in out.iterdir()) if out.is_dir() else afile.read_text()
        for extra in ([], ["--force"]):
            assert main(["convert", "--from-hf", str(hf_dir), "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1, err
        after = sorted(p.name for p in out.iterdir()) if out.is_dir() else afile.read_text()
        assert after == before
    ours = tmp_path / "ours"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ours)]) == 0
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ours)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ours), "--force"]) == 0
    load_checkpoint(ours)


def test_pickle_with_code_is_refused_in_one_line(hf_dir: Path, tmp_path: Path, capsys) -> None:
    import os
    import pickle

    class Planted:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    legacy = tmp_path / "legacy"
    shutil.copytree(hf_dir, legacy)
    (legacy / "model.safetensors").unlink()
    (legacy / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Planted()}))
    assert main(["convert", "--from-hf", str(legacy), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds pickled objects other than tensors" in err
    assert "weights_only=False" not in err and "weights_only" not in err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "t").exists()


# --- issue 36 item 9: bookkeeping is not a feature -----------------------------------------

BOOKKEEPING = {
    "_model_name_or_path": "Smollm2 135M", "_name_or_path": "/somewhere/else",
    "_commit_hash": "abc123", "_attn_implementation": "sdpa", "transformers_version": "4.44.0",
    "torch_dtype": "bfloat16", "architectures": ["GPT2LMHeadModel"], "unk_token_id": 7,
    "quantization_config": {"quant_method": "gguf", "gguf_file": "m.gguf",
                            "dequantize": False},
    "max_length": 20, "temperature": 0.7, "do_sample": True, "tokenizer_class": "GPT2Tokenizer",
    "pruned_heads": {}, "feed_forward_length": 96,  # GGUF loader's copy of 4·n_embd
}


def test_from_hf_accepts_bookkeeping_keys(hf_dir: Path, tmp_path: Path, capsys) -> None:
    """A config.json carrying where it came from, how it was stored and how to generate
    (the keys a newcomer's folder was refused for) imports to the same logits."""
    folder = tmp_path / "kept"
    shutil.copytree(hf_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **BOOKKEEPING}))
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "t")]) == 0, \
        capsys.readouterr().err
    model, _ = load_checkpoint(tmp_path / "t")
    original = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(_logits(model, ids), _logits(original, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("extra, named", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config with quant_method='gptq'"),
    ({"quantization_config": {"bits": 4}}, "quantization_config with quant_method=None"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping=30.0"),
    ({"pruned_heads": {"0": [1]}}, "pruned_heads={'0': [1]}"),
    ({"feed_forward_length": 50}, "feed_forward_length=50"),
])
def test_from_hf_still_refuses_what_changes_the_computation(hf_dir: Path, tmp_path: Path,
                                                            capsys, extra, named) -> None:
    folder = tmp_path / "changed"
    shutil.copytree(hf_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **BOOKKEEPING, **extra}))
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "uses features tinylm does not implement" in err
    assert named in err, err
    for harmless in ("_model_name_or_path", "transformers_version", "torch_dtype", "unk_token"):
        assert harmless not in err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_model_transformers_loaded_from_gguf_imports(tmp_path: Path, arch: str) -> None:
    """transformers' GGUF loader dequantizes the weights and leaves quantization_config
    (quant_method gguf), _model_name_or_path and, for gpt2, feed_forward_length in the
    config: the in-memory model imports as it is, to the same logits."""
    from gguf import GGMLQuantizationType as Q

    from test_gguf import hf_model, transformers_from, write_gguf
    from tinylm.io.hf import from_hf

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hf_model(arch), Q.Q8_0,
                      meta={"general.name": "tiny one"})
    theirs = transformers_from(path)
    d = theirs.config.to_dict()
    assert d["quantization_config"]["quant_method"] == "gguf" and d["_model_name_or_path"]
    ours = from_hf(theirs)
    ids = torch.randint(0, ours.config.vocab_size, (2, 12))
    torch.testing.assert_close(_logits(ours, ids), _logits(theirs, ids), atol=1e-5, rtol=1e-5)


def test_from_hf_of_a_file(tmp_path: Path, capsys) -> None:
    """--from-hf FILE.gguf (or a GGUF file under another name) converts it as --from-gguf
    does; any other file is named a file, not "does not exist"."""
    from test_gguf_convert import write_chat_gguf

    path = write_chat_gguf(tmp_path / "m.gguf")
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "a")]) == 0
    renamed = tmp_path / "m.bin"
    shutil.copy(path, renamed)
    for source, out in ((path, "b"), (renamed, "c")):
        assert main(["convert", "--from-hf", str(source), "--out", str(tmp_path / out)]) == 0
        assert f"converted {source} -> {tmp_path / out}" in capsys.readouterr().out
        assert (tmp_path / out / "model.safetensors").read_bytes() == \
            (tmp_path / "a" / "model.safetensors").read_bytes()
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    assert main(["convert", "--from-hf", str(other), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{other} is a file, not a Hugging Face folder" in err
    assert "does not exist" not in err and "--from-gguf" in err


def test_info_says_where_an_hf_import_came_from(hf_dir: Path, tmp_path: Path, capsys) -> None:
    from tinylm.io.describe import describe_checkpoint, info_lines

    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "t")]) == 0
    info = describe_checkpoint(tmp_path / "t")
    assert info["source"] == {"hf": str(hf_dir.resolve())}
    lines = dict(info_lines(info))
    assert lines["made by"] == f"tinylm convert --from-hf {hf_dir.resolve()}"
    assert lines["training"] == "pretrained elsewhere (converted); none in tinylm"


def test_kept_quantized_gguf_counts_every_parameter(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    """convert --from-gguf --keep-quantized and info count the integer weights too: the
    same number as the dequantized model (issue 36 item 7: not the float ones only)."""
    from gguf import GGMLQuantizationType as Q

    from test_gguf_convert import write_chat_gguf
    from tinylm.commands.convert import import_model
    from tinylm.io.describe import describe_checkpoint
    from tinylm.io.gguf import gguf_to_tinylm

    path = write_chat_gguf(tmp_path / "q8.gguf", Q.Q8_0)
    full = gguf_to_tinylm(path).num_parameters()
    done = import_model(path, tmp_path / "ck", keep_quantized=True)
    assert done.parameters == full and f"({full:,} parameters" in done.line()
    info = describe_checkpoint(tmp_path / "ck")
    assert info["parameters"] == full and info["parameter_kinds"]["quantized"] > 0
    assert info["quantized"][0]["bits"] == 8 and info["quantized"][0]["group_size"] == 32
    # tinylm quantize of the .gguf file itself: pretrained elsewhere, not "no longer there"
    from tinylm.io.describe import info_lines

    monkeypatch.setenv("TINYLM_GGUF_CACHE", str(tmp_path / "cache"))
    assert main(["quantize", "--model", str(path), "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    lines = dict(info_lines(describe_checkpoint(tmp_path / "q")))
    assert lines["training"] == f"none in tinylm; made from {path}, pretrained elsewhere"
    assert lines["made by"].startswith("tinylm quantize (int8 symmetric, per output channel) "
                                       f"of {path}")
