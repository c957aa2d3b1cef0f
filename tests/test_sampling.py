"""Sampling: the logit filters, generation with the KV cache, streaming, `tinylm sample`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tinylm import (
    GPT,
    ModelConfig,
    generate,
    generate_stream,
    load_checkpoint,
    save_checkpoint,
)
from tinylm.cli import main
from tinylm.core.errors import ConfigError, DataError
from tinylm.data.tokenizers import BPETokenizer, CharTokenizer
from tinylm.use.sampling import (
    SamplingConfig,
    TextStream,
    apply_temperature,
    generate_text,
    next_token_probs,
    top_k_filter,
    top_p_filter,
)

JAPANESE = "これはペンです。吾輩は猫である。名前はまだ無い。"
CORPUS = JAPANESE + " This is a pen. Hello, world!\n"


def tiny(vocab_size: int = 40, context_length: int = 16) -> GPT:
    config = ModelConfig(vocab_size=vocab_size, context_length=context_length, n_layer=2,
                         n_head=2, n_embd=16)
    return GPT(config).eval()


def greedy_by_full_forwards(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The reference: no cache, one full forward per token over the current window.

    The window is the whole sequence until it would exceed C tokens; then it restarts
    on the last C - 1 tokens (what generate documents for sliding).
    """
    C = model.config.context_length
    seq, start = prompt.clone(), 0
    with torch.no_grad():
        for _ in range(n):
            if seq.shape[1] - start > C:
                start = seq.shape[1] - (C - 1)
            nxt = model(seq[:, start:])[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


# --- filters -------------------------------------------------------------------------------


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    assert torch.equal(apply_temperature(logits, 2.0), logits / 2)
    assert apply_temperature(logits, 1.0) is logits
    with pytest.raises(ConfigError):
        apply_temperature(logits, 0.0)


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = top_k_filter(logits, 2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert torch.equal(out[torch.isfinite(out)], torch.tensor([3.0, 2.0]))
    assert torch.equal(top_k_filter(logits, 5), logits)


@pytest.mark.parametrize(("p", "kept"), [(0.5, 1), (0.79, 2), (0.8, 2), (0.81, 3),
                                         (0.95, 3), (0.951, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, kept: int) -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)  # sorted: .5 .3 .15 .05
    logits = probs.log().unsqueeze(0)
    out = top_p_filter(logits, p)
    order = [1, 3, 0, 2]  # ids by decreasing probability
    finite = torch.isfinite(out[0])
    assert [bool(finite[i]) for i in order] == [True] * kept + [False] * (4 - kept)


def test_filtered_probabilities_are_renormalised() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    for config in (SamplingConfig(1.0, top_k=7), SamplingConfig(0.7, top_p=0.6),
                   SamplingConfig(1.3, top_k=10, top_p=0.9)):
        probs = next_token_probs(logits, config)
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        full = torch.softmax(logits / config.temperature, dim=-1)
        kept = probs > 0
        # kept tokens keep their relative odds: p_i / sum over the kept set
        expect = torch.where(kept, full, 0) / (full * kept).sum(-1, keepdim=True)
        assert torch.allclose(probs, expect, atol=1e-6)
        if config.top_k is not None:
            assert (kept.sum(-1) <= config.top_k).all()


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                 dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_config_rejects_out_of_range(bad: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingConfig(**bad)


# --- generation ----------------------------------------------------------------------------


def test_greedy_with_cache_equals_repeated_full_forwards() -> None:
    model = tiny()
    prompt = torch.randint(0, 40, (3, 5))
    out = generate(model, prompt, 10, temperature=0)
    assert out.shape == (3, 15)
    assert torch.equal(out, greedy_by_full_forwards(model, prompt, 10))


def test_top_k_1_equals_greedy() -> None:
    model = tiny()
    prompt = torch.randint(0, 40, (2, 4))
    assert torch.equal(generate(model, prompt, 8, top_k=1, temperature=1.5),
                       generate(model, prompt, 8, temperature=0))


def test_same_seed_same_tokens() -> None:
    model = tiny()
    prompt = [1, 2, 3]
    a = generate(model, prompt, 20, seed=7, top_p=0.95)
    b = generate(model, prompt, 20, seed=7, top_p=0.95)
    c = generate(model, prompt, 20, seed=8, top_p=0.95)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sliding_window_matches_recomputation_on_the_last_window(caplog) -> None:
    model = tiny(context_length=8)
    prompt = torch.randint(0, 40, (2, 5))
    with caplog.at_level("INFO", logger="tinylm.use.sampling"):
        out = generate(model, prompt, 30, temperature=0)
    assert torch.equal(out, greedy_by_full_forwards(model, prompt, 30))
    assert sum("sliding the window" in r.message for r in caplog.records) == 1
    long_prompt = torch.randint(0, 40, (1, 20))  # longer than C = 8
    assert torch.equal(generate(model, long_prompt, 5, temperature=0),
                       greedy_by_full_forwards(model, long_prompt, 5))


def test_streaming_equals_generate_and_stop_ids_end_rows() -> None:
    model = tiny()
    prompt = torch.randint(0, 40, (2, 3))
    steps = list(generate_stream(model, prompt, 12, seed=3))
    assert torch.equal(torch.cat([prompt, torch.stack(steps, 1)], 1),
                       generate(model, prompt, 12, seed=3))
    greedy = generate(model, prompt, 12, temperature=0)[:, 3:]
    stop = int(greedy[0, 2])
    out = generate(model, prompt, 12, temperature=0, stop_ids=[stop])[:, 3:]
    first = int((out[0] == stop).nonzero()[0])
    assert (out[0, first:] == stop).all()  # a finished row repeats its stop id
    assert torch.equal(out[0, :first], greedy[0, :first])


def test_vocab_size_limits_the_ids() -> None:
    model = tiny()
    out = generate(model, [1], 50, vocab_size=5, seed=0, temperature=2.0)
    assert int(out[0, 1:].max()) < 5


def test_generate_rejects_bad_arguments() -> None:
    model = tiny()
    with pytest.raises(ConfigError):
        generate(model, [1], 0)
    with pytest.raises(ConfigError):
        generate(model, [], 3)
    with pytest.raises(DataError):
        generate(model, [99], 3)
    with pytest.raises(ConfigError):
        generate(model, [[1, 2], [3]], 3)


# --- text out -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    # A small vocabulary leaves most Japanese characters as 2-3 byte-level tokens.
    return BPETokenizer.train([CORPUS * 5], vocab_size=300, special_tokens=["<|endoftext|>"])


@pytest.fixture(scope="module")
def char() -> CharTokenizer:
    return CharTokenizer(CORPUS)


def test_text_stream_never_splits_a_character(bpe: BPETokenizer, char: CharTokenizer) -> None:
    for tok in (bpe, char):
        ids = tok.encode(JAPANESE)
        stream = TextStream(tok)
        pieces = [stream.push(i) for i in ids] + [stream.finish()]
        assert "".join(pieces) == JAPANESE
        assert not any("\ufffd" in p for p in pieces)
    assert any("\ufffd" in bpe.decode([i]) for i in bpe.encode(JAPANESE))  # really split


def test_text_stream_cuts_at_stop_strings(char: CharTokenizer) -> None:
    stream = TextStream(char, stop=["猫で", "XYZ"])
    pieces = [stream.push(i) for i in char.encode(JAPANESE)]
    assert stream.stopped
    assert "".join(pieces) + stream.finish() == "これはペンです。吾輩は"
    assert "".join(pieces[:11]) == "これはペンです。吾輩は"  # "猫" held back, then cut


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_streamed_text_equals_the_whole_decoded_text(kind: str, bpe, char) -> None:
    tok = bpe if kind == "bpe" else char
    model = tiny(vocab_size=tok.vocab_size, context_length=24)
    prompt = "吾輩は"
    pieces = list(generate_text(model, tok, prompt, 40, seed=5))
    prompt_ids = tok.encode(prompt)
    stop_ids = None if tok.eos_id is None else [tok.eos_id]
    out = generate(model, prompt_ids, 40, seed=5, vocab_size=tok.vocab_size, stop_ids=stop_ids)
    new = out[0, len(prompt_ids):].tolist()
    if tok.eos_id in new:
        new = new[:new.index(tok.eos_id)]
    assert "".join(p for _, p in pieces) == tok.decode(new)
    assert {i for i, _ in pieces} == {0}


# --- the CLI --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bpe: BPETokenizer, char: CharTokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sample")
    torch.manual_seed(0)
    out = {}
    for name, tok in (("char", char), ("bpe", bpe)):
        out[name] = save_checkpoint(root / name, tiny(tok.vocab_size, 24), tok)
    return out


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_sample_streams_prompt_and_continuation(folders, capsys, char) -> None:
    code, out, _ = run(["sample", "--model", str(folders["char"]), "--prompt", "吾輩は",
                        "--max-new-tokens", "30", "--temperature", "0"], capsys)
    assert code == 0
    model, _ = load_checkpoint(folders["char"])
    ids = generate(model, char.encode("吾輩は"), 30, temperature=0)[0].tolist()
    assert out == char.decode(ids) + "\n"


def test_cli_sample_batch_stop_and_stdin(folders, capsys, monkeypatch, tmp_path) -> None:
    code, out, _ = run(["sample", "--model", str(folders["bpe"]), "--num-samples", "3",
                        "--seed", "1", "--max-new-tokens", "20", "--no-echo",
                        "--stop", "。"], capsys)
    assert code == 0
    assert out.count("--- sample ") == 3 and "。" not in out
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("これは", encoding="utf-8")
    code, out, _ = run(["sample", "--model", str(folders["bpe"]), "--prompt-file",
                        str(prompt), "--max-new-tokens", "5", "--seed", "2"], capsys)
    assert code == 0 and out.startswith("これは")


def _corrupt(folder: Path, tmp_path: Path) -> Path:
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(folder, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return bad


def _mismatched(folder: Path, tmp_path: Path) -> Path:
    import shutil

    bad = tmp_path / "mismatched"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model"]["n_embd"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize(("case", "extra"), [
    ("missing model folder", []),
    ("corrupt safetensors", []),
    ("mismatched config", []),
    ("empty prompt, no end-of-text token", []),
    ("unknown characters", ["--prompt", "吾輩は犬"]),
    ("missing prompt file", ["--prompt-file", "nope.txt"]),
    ("temperature < 0", ["--prompt", "a", "--temperature", "-1"]),
    ("top-p 0", ["--prompt", "a", "--top-p", "0"]),
    ("top-p > 1", ["--prompt", "a", "--top-p", "1.5"]),
    ("top-k 0", ["--prompt", "a", "--top-k", "0"]),
    ("max-new-tokens 0", ["--prompt", "a", "--max-new-tokens", "0"]),
    ("num-samples 0", ["--prompt", "a", "--num-samples", "0"]),
])
def test_cli_sample_bad_input_is_one_line_exit_2(case, extra, folders, capsys,
                                                 tmp_path) -> None:
    model = folders["char"]
    if case == "missing model folder":
        model = tmp_path / "nowhere"
    elif case == "corrupt safetensors":
        model = _corrupt(model, tmp_path)
    elif case == "mismatched config":
        model = _mismatched(model, tmp_path)
    if case.startswith(("missing model", "corrupt", "mismatched")):
        extra = ["--prompt", "a"]
    code, out, err = run(["sample", "--model", str(model), *extra], capsys)
    assert code == 2, case
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinylm sample: error: "), err
    assert "Traceback" not in err


def test_generate_leaves_the_model_as_it_was() -> None:
    model = tiny()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, [1, 2], 5)
    assert model.training
    for name, value in model.state_dict().items():
        assert value.is_contiguous(), name  # the decoding weight layout is undone
        assert torch.equal(value, before[name]), name
    assert model.lm_head.weight is model.tok_emb.weight
