"""Hostile and unlucky inputs end in one line, exit 2, nothing written (issue 11 item 5):
config.json, safetensors, pytorch_model.bin, JSON bounds, sampling flags; plus hypothesis
fuzz of config.json loading and of ``tinylm sample``'s flags (item 7)."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tinylm import GPT, ModelConfig, load_checkpoint, save_checkpoint
from tinylm.cli import main
from tinylm.core import config as config_module
from tinylm.core.config import check_model_fits, estimate_parameters
from tinylm.core.errors import CheckpointError, ConfigError, DataError, TinyLMError
from tinylm.data.tokenizers import CharTokenizer
from tinylm.io.checkpoint import build_model, load_model, read_config
from tinylm.io.jsonio import parse_json, read_json
from tinylm.use.sampling import SamplingConfig, check_generation, next_token_probs

TEXT = "hello world, this is a pen.\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tok = CharTokenizer(TEXT)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=16, n_layer=1,
                            n_head=2, n_embd=16))
    return save_checkpoint(tmp_path_factory.mktemp("hard") / "m", model, tok)


def _copy(ckpt: Path, tmp_path: Path, name: str = "c") -> Path:
    dest = tmp_path / name
    shutil.copytree(ckpt, dest)
    return dest


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def one_line_exit_2(argv: list[str], capsys, command: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tinylm {command}: error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


# --- config.json ---------------------------------------------------------------------------

HOSTILE_CONFIGS = {
    "version as a string": (lambda c: c.update(version="2"), "format version '2'"),
    "version as a float": (lambda c: c.update(version=1.5), "format version 1.5"),
    "version negative": (lambda c: c.update(version=-1), "format version -1"),
    "version from the future": (lambda c: c.update(version=99), "newer tinylm"),
    "vocab_size 1e12 (float)": (lambda c: c["model"].update(vocab_size=1e12), "vocab_size"),
    "vocab_size 10**12": (lambda c: c["model"].update(vocab_size=10**12), "vocab_size"),
    "n_layer 1e6": (lambda c: c["model"].update(n_layer=10**6), "n_layer"),
    "n_layer 1e6 float": (lambda c: c["model"].update(n_layer=1e6), "n_layer"),
    "a 2.7 TB model": (lambda c: c["model"].update(n_layer=5000, n_embd=4096, n_head=4),
                       "needs about"),
    "huge context": (lambda c: c["model"].update(context_length=2**31 - 1, n_embd=4096,
                                                 n_head=4), "needs about"),
    "model is a list": (lambda c: c.update(model=[1]), '"model" must be a JSON object'),
    "model is a string": (lambda c: c.update(model="gpt2"), '"model" must be a JSON object'),
    "train is a list": (lambda c: c.update(train=[1]), '"train" must be a JSON object'),
    "lowrank is a string": (lambda c: c.update(lowrank="x"), '"lowrank" must be'),
    "lowrank names no layer": (lambda c: c.update(lowrank={"nope": 2}), "lowrank"),
    "unknown model field": (lambda c: c["model"].update(n_layers=2), "unknown"),
    "n_head a string": (lambda c: c["model"].update(n_head="2"), "n_head"),
    "bias null": (lambda c: c["model"].update(bias=None), "bias"),
    "dropout NaN": (lambda c: c["model"].update(dropout=float("nan")), "dropout"),
    "format missing": (lambda c: c.pop("format"), "not a tinylm checkpoint"),
    "not an object": (lambda c: (c.clear(), c.update(__list__=True)), "not a tinylm"),
}


def _write_config(folder: Path, change) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    if cfg.get("__list__"):
        cfg = [1, 2, 3]
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(HOSTILE_CONFIGS))
@pytest.mark.parametrize("command", ["sample", "eval"])
def test_hostile_config_json_is_one_line(case, command, ckpt, tmp_path, capsys) -> None:
    change, expected = HOSTILE_CONFIGS[case]
    folder = _copy(ckpt, tmp_path)
    _write_config(folder, change)
    before = _listing(folder)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    extra = ["--prompt", "hello", "--max-new-tokens", "2"] if command == "sample" else \
        ["--text", str(text)]
    line = one_line_exit_2([command, "--model", str(folder), *extra], capsys, command)
    assert expected in line, line
    assert _listing(folder) == before  # nothing written or lost


@pytest.mark.parametrize("text", [
    '{"format": "tinylm", "model": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"format": "tinylm", "version": 1, "model": {"vocab_size": ' + "9" * 5000 + "}}",
    '{"format": "tinylm", "model": {',
    "",
])
def test_unparsable_config_json_is_one_line(text, ckpt, tmp_path, capsys) -> None:
    folder = _copy(ckpt, tmp_path)
    (folder / "config.json").write_text(text)
    line = one_line_exit_2(["sample", "--model", str(folder), "--prompt", "a"], capsys,
                           "sample")
    assert "config.json" in line and "corrupt" in line


def test_config_json_invalid_utf8_and_oversized(ckpt, tmp_path, monkeypatch) -> None:
    folder = _copy(ckpt, tmp_path)
    (folder / "config.json").write_bytes(b'{"format": "tinylm\xff"}')
    with pytest.raises(CheckpointError, match="not UTF-8"):
        read_config(folder)
    (folder / "config.json").write_text(json.dumps({"format": "tinylm", "pad": "x" * 5000}))
    monkeypatch.setattr("tinylm.io.checkpoint.CONFIG_MAX_BYTES", 1000)
    with pytest.raises(CheckpointError, match="more than the 1,000"):
        read_config(folder)


# --- the memory estimate -------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {},
    {"tie_embeddings": False},
    {"n_layer": 3, "n_head": 3, "n_embd": 48, "head_dim": 8},
    {"vocab_size": 1000, "context_length": 7, "bias": False},
])
def test_parameter_estimate_matches_the_built_model(fields) -> None:
    config = ModelConfig(**{"vocab_size": 300, "context_length": 32, "n_layer": 2,
                            "n_head": 2, "n_embd": 32, **fields})
    built = GPT(config).num_parameters()
    assert abs(estimate_parameters(config) - built) <= 0.01 * built


def test_model_that_cannot_fit_is_refused_with_the_estimate(monkeypatch, ckpt) -> None:
    config = ModelConfig(vocab_size=50257, context_length=1024, n_layer=12, n_head=12,
                         n_embd=768)
    monkeypatch.setattr(config_module, "available_memory", lambda device="cpu": 10**8)
    with pytest.raises(ConfigError, match=r"needs about 49\d\.\d MB \(124,4\d\d,\d{3} float32 "
                                          r"parameters\) but only 100\.0 MB"):
        check_model_fits(config)
    with pytest.raises(CheckpointError, match="too large to load"):
        build_model(read_config(ckpt) | {"model": config.to_dict()})
    monkeypatch.setattr(config_module, "available_memory", lambda device="cpu": None)
    assert check_model_fits(config) > 4 * 124_000_000  # unknown memory: no refusal


# --- weights -------------------------------------------------------------------------------


def _edit_weights(folder: Path, edit) -> str:
    state = load_file(folder / "model.safetensors")
    key = "blocks.0.attn.qkv.weight"
    state[key] = edit(state[key])
    save_file(state, folder / "model.safetensors")
    return key


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.bool])
def test_weights_relabelled_as_integers_are_refused(dtype, ckpt, tmp_path, capsys) -> None:
    folder = _copy(ckpt, tmp_path)
    if dtype == torch.bool:
        _edit_weights(folder, lambda w: w > 0)
    else:
        _edit_weights(folder, lambda w: w.contiguous().view(torch.uint8).view(dtype)
                      .reshape(-1)[: w.numel()].reshape(w.shape).clone())
    line = one_line_exit_2(["sample", "--model", str(folder), "--prompt", "a"], capsys,
                           "sample")
    assert f"stored as {str(dtype).replace('torch.', '')}" in line and "float32" in line


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_weights_are_cast_with_a_note(dtype, ckpt, tmp_path, caplog) -> None:
    folder = _copy(ckpt, tmp_path)
    key = _edit_weights(folder, lambda w: w.to(dtype))
    with caplog.at_level("WARNING", logger="tinylm"):
        model = load_model(folder)
    assert model.state_dict()[key].dtype == torch.float32
    expected = load_file(folder / "model.safetensors")[key].to(torch.float32)
    assert torch.equal(model.state_dict()[key], expected)
    assert any("cast to float32" in r.getMessage() and str(dtype).replace("torch.", "")
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_refused_unless_allowed(bad, ckpt, tmp_path, capsys) -> None:
    folder = _copy(ckpt, tmp_path)

    def poison(w):
        w = w.clone()
        w.view(-1)[3] = bad
        return w

    _edit_weights(folder, poison)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    line = one_line_exit_2(["eval", "--model", str(folder), "--text", str(text)], capsys,
                           "eval")
    assert "1 weights are NaN or infinite" in line and "--allow-nonfinite" in line
    one_line_exit_2(["sample", "--model", str(folder), "--prompt", "a"], capsys, "sample")
    assert main(["eval", "--model", str(folder), "--text", str(text), "--json",
                 "--allow-nonfinite"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert not math.isfinite(result["loss"])  # what the user asked to see
    model, _ = load_checkpoint(folder, allow_nonfinite=True)
    assert not torch.isfinite(model.blocks[0].attn.qkv.weight).all()


# --- pytorch_model.bin ---------------------------------------------------------------------


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted > /dev/null",))


@pytest.fixture(scope="module")
def hf_config_dir(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hfbin") / "gpt2"
    transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=8, n_layer=1,
                            n_head=2).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("payload", "expected"), [
    ([torch.zeros(2)], "holds a list"),
    (torch.zeros(3), "holds a Tensor"),
    ({"transformer.wte.weight": 1, "b": 2}, "to a int, not a tensor"),
    ({}, "holds a dict, not a dict of weight names"),
    ("planted", "pickled objects other than tensors (it refers to posix.system)"),
    ("planted, protocol 4", "pickled objects other than tensors, which were not loaded"),
    ("garbage", "not a readable PyTorch weights file"),
])
def test_pytorch_model_bin_payloads_are_one_line(payload, expected, hf_config_dir, tmp_path,
                                                 capsys) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(hf_config_dir, folder)
    path = folder / "pytorch_model.bin"
    if payload.__class__ is str and payload.startswith("planted"):
        path.write_bytes(pickle.dumps(_Planted(), protocol=4 if "4" in payload else 2))
    elif payload.__class__ is str:
        path.write_bytes(b"PK\x03\x04 not really a zip")
    else:
        torch.save(payload, path)
    out = tmp_path / "out"
    line = one_line_exit_2(["convert", "--from-hf", str(folder), "--out", str(out)], capsys,
                           "convert")
    assert expected in line, line
    assert "weights_only" not in line and "weights only" not in line.lower()
    assert not out.exists()


# --- the bounded JSON reader ---------------------------------------------------------------


def test_json_reader_bounds_depth_size_and_types_its_errors(tmp_path) -> None:
    assert parse_json('{"a": [[1]]}', max_depth=3) == {"a": [[1]]}
    with pytest.raises(DataError, match="deeper than"):
        parse_json('{"a": [[1]]}', max_depth=2)
    with pytest.raises(CheckpointError, match="deeper than"):
        parse_json("[" * 100_000 + "]" * 100_000, error=CheckpointError)
    with pytest.raises(DataError, match=r"is 11 bytes, more than the 10"):
        parse_json('"abcdefghi"', max_bytes=10)
    with pytest.raises(DataError, match="4,300 digits"):
        parse_json("1" * 5000)
    path = tmp_path / "x.json"
    with pytest.raises(FileNotFoundError):
        read_json(path)
    path.write_bytes(b"\x80{}")
    with pytest.raises(DataError, match=r"x\.json is not UTF-8 .*; fix it"):
        read_json(path, fix="fix it")
    with pytest.raises(DataError, match="is a folder"):
        read_json(tmp_path)


# --- sampling flags ------------------------------------------------------------------------

BAD_SAMPLE_FLAGS = {
    "--temperature 1e-40": (["--temperature", "1e-40"], "float32"),
    "--temperature 1e300": (["--temperature", "1e300"], "float32"),
    "--temperature nan": (["--temperature", "nan"], "temperature"),
    "--temperature inf": (["--temperature", "inf"], "temperature"),
    "--temperature x": (["--temperature", "x"], "--temperature"),
    "--top-p 1e-300": (["--top-p", "1e-300"], "float32"),
    "--top-p nan": (["--top-p", "nan"], "top_p"),
    "--top-p 0": (["--top-p", "0"], "top_p"),
    "--top-k 1e30": (["--top-k", "1e30"], "top_k"),
    "--top-k 0": (["--top-k", "0"], "top_k"),
    "--max-new-tokens 1e12": (["--max-new-tokens", "1000000000000"], "memory"),
    "--max-new-tokens 0": (["--max-new-tokens", "0"], "max_new_tokens"),
    "--max-new-tokens 2**64": (["--max-new-tokens", str(2**64)], "max_new_tokens"),
    "--max-new-tokens 1e9 x16": (["--max-new-tokens", "1000000000", "--num-samples", "16"],
                                 "16 samples of 1,000,000,000 new tokens need about"),
    "--num-samples 1e18": (["--num-samples", "1e18"], "memory"),
    "--num-samples 1.5": (["--num-samples", "1.5"], "expected an integer"),
    "--num-samples -3": (["--num-samples", "-3"], "num_samples"),
    "--seed 99999999999999999999999": (["--seed", "99999999999999999999999"], "int64"),
    "--seed -1": (["--seed", "-1"], "int64"),
    "--seed=--": (["--seed=--"], "expected an integer, got '--'"),
    "--max-new-tokens=--": (["--max-new-tokens=--"], "got '--'"),
    "--seed x": (["--seed", "x"], "expected an integer"),
    "--stop ''": (["--stop", ""], "--stop"),
    "unknown flag": (["--temprature", "1"], "unrecognized arguments"),
    "--device nope": (["--device", "nope"], "unknown device"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLE_FLAGS))
def test_bad_sample_flags_are_one_line(case, ckpt, capsys) -> None:
    flags, expected = BAD_SAMPLE_FLAGS[case]
    line = one_line_exit_2(["sample", "--model", str(ckpt), "--prompt", "hello", *flags],
                           capsys, "sample")
    assert expected in line, line


def test_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([[3.0, 40.0, -2.0, 39.999]])
    probs = next_token_probs(logits, SamplingConfig(temperature=2e-38))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    probs = next_token_probs(logits, SamplingConfig(temperature=0.5, top_p=2e-38))
    assert torch.isfinite(probs).all() and probs[0, 1] == 1


def test_generation_memory_estimate(monkeypatch) -> None:
    monkeypatch.setattr("tinylm.use.sampling.available_memory", lambda device="cpu": 64 * 10**6)
    check_generation(100_000, 9)  # 900k tokens x 64 bytes = 57.6 MB fits
    with pytest.raises(ConfigError, match=r"10 samples of 100,000 new tokens need about "
                                          r"64\.0 MB of memory on cpu .* only 64\.0 MB"):
        check_generation(100_000, 10, prompt_tokens=1)
    # GPT-2 small's KV cache is 2 x 12 layers x 1024 positions x 768 x 4 bytes = 75.5 MB
    # per sample: 1 fits in 100 MB, 2 do not
    gpt2 = ModelConfig(vocab_size=50257, context_length=1024, n_layer=12, n_head=12,
                       n_embd=768)
    monkeypatch.setattr("tinylm.use.sampling.available_memory", lambda device="cpu": 100 * 10**6)
    check_generation(10, 1, model_config=gpt2)
    with pytest.raises(ConfigError, match=r"2 samples of 10 new tokens need about 151\.8 MB"):
        check_generation(10, 2, model_config=gpt2)


# --- hypothesis fuzz -----------------------------------------------------------------------

_SIZE = st.one_of(st.integers(-3, 40), st.sampled_from([0, 2**31, 2**63, 10**12, -(2**70)]),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                  st.booleans(), st.none(), st.lists(st.integers(0, 3), max_size=2))
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_MODEL = st.fixed_dictionaries({}, optional={
    name: _SIZE for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd",
                             "head_dim")} | {
    name: st.one_of(st.booleans(), _JSON) for name in ("bias", "tie_embeddings")} | {
    "dropout": st.one_of(st.floats(), _JSON), "layer_norm_eps": st.one_of(st.floats(), _JSON),
    "extra": _JSON})
_CONFIG = st.one_of(
    st.fixed_dictionaries({"format": st.sampled_from(["tinylm", "x"]), "model": _MODEL},
                          optional={"version": st.one_of(st.integers(-2, 3), _JSON),
                                    "lowrank": _JSON, "train": _JSON}),
    _JSON)


@settings(max_examples=500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config=_CONFIG)
def test_fuzz_config_json_loading_raises_only_typed_errors(config, ckpt, tmp_path) -> None:
    folder = tmp_path / "fuzz"
    if not folder.exists():
        shutil.copytree(ckpt, folder)
    (folder / "config.json").write_text(json.dumps(config))
    try:
        load_model(folder)
    except TinyLMError as exc:
        assert "\n" not in str(exc)


_FLAG_VALUE = st.one_of(
    st.integers(-(2**70), 2**70).map(str), st.floats().map(repr), st.sampled_from(
        ["--", "-", "", "1e18", "1e-40", "nan", "inf", "0", "1", "0.5", "x", "1_000"]),
    st.text(max_size=6))
_FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
          "--num-samples", "--stop", "--device"]


@settings(max_examples=1200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(_FLAGS), _FLAG_VALUE, st.booleans()),
                      max_size=4))
def test_fuzz_sample_flags_give_one_line_exit_2(pairs, tmp_path, capsys) -> None:
    argv = ["sample", "--model", str(tmp_path / "no-such-model"), "--prompt", "hi"]
    for flag, value, joined in pairs:
        argv += [f"{flag}={value}"] if joined else [flag, value]
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 2, (argv, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(_FLAGS[:6]), _FLAG_VALUE), max_size=3))
def test_fuzz_sample_flags_on_a_real_model(pairs, ckpt, capsys) -> None:
    argv = ["sample", "--model", str(ckpt), "--prompt", "hello", "--max-new-tokens", "3"]
    for flag, value in pairs:
        if flag == "--max-new-tokens" and value.lstrip("-").isdigit() and int(value) > 50:
            value = "50"  # keep each case short; huge values are covered above
        if flag == "--num-samples" and value.lstrip("-").isdigit() and int(value) > 8:
            value = "8"
        argv += [f"{flag}={value}"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, err)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and out == "", (argv, err)


# --- files and names -----------------------------------------------------------------------


def test_prompt_file_is_bounded(ckpt, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("tinylm.cli.use.PROMPT_MAX_BYTES", 100)
    big = tmp_path / "big.txt"
    big.write_text("hello " * 50)
    line = one_line_exit_2(["sample", "--model", str(ckpt), "--prompt-file", str(big)],
                           capsys, "sample")
    assert "larger than" in line
    line = one_line_exit_2(["sample", "--model", str(ckpt), "--prompt-file", str(tmp_path)],
                           capsys, "sample")
    assert "cannot read" in line
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hel\xff")
    line = one_line_exit_2(["sample", "--model", str(ckpt), "--prompt-file", str(bad)],
                           capsys, "sample")
    assert "not UTF-8 text (invalid start byte at byte 3)" in line


@pytest.mark.skipif(os.uname().sysname == "Darwin", reason="macOS refuses non-UTF-8 names")
def test_checkpoint_folder_with_undecodable_bytes_in_its_name(ckpt, tmp_path, capsys) -> None:
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/m\xff"))
    shutil.copytree(ckpt, folder)
    assert main(["sample", "--model", str(folder), "--prompt", "hel", "--max-new-tokens",
                 "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("hel")
    assert main(["info", str(folder)]) == 0
    assert "parameters" in capsys.readouterr().out
    missing = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/nope\xfe"))
    one_line_exit_2(["sample", "--model", str(missing), "--prompt", "a"], capsys, "sample")


def test_eval_counts_take_scientific_notation(ckpt, tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    assert main(["eval", "--model", str(ckpt), "--text", str(text), "--batch-size", "1e3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    line = one_line_exit_2(["eval", "--model", str(ckpt), "--text", str(text),
                            "--batch-size", "2.5"], capsys, "eval")
    assert "expected an integer, got '2.5'" in line


def test_huge_hugging_face_config_is_refused_before_allocating(hf_config_dir, tmp_path,
                                                               capsys) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(hf_config_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(n_layer=5000, n_embd=4096, n_head=4)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"transformer.wte.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    line = one_line_exit_2(["convert", "--from-hf", str(folder), "--out",
                            str(tmp_path / "o")], capsys, "convert")
    assert "too large to load" in line and "needs about" in line
    assert not (tmp_path / "o").exists()


def test_pickles_are_refused_on_a_torch_with_known_weights_only_bypasses(
        hf_config_dir, tmp_path, capsys, monkeypatch) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(hf_config_dir, folder)
    torch.save({"transformer.wte.weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    monkeypatch.setattr("tinylm.io.hf._torch_version", lambda: (2, 5))
    line = one_line_exit_2(["convert", "--from-hf", str(folder), "--out",
                            str(tmp_path / "o")], capsys, "convert")
    assert "cannot read pickles safely (needs >= 2.10)" in line
    assert "weights_only" not in line
