"""evaluation.py: exact loss over windows, sliding windows, bits per byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT, lm_loss
from tinylm.use.evaluation import bits_per_byte, evaluate


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, context_length=16, n_layer=2, n_head=2, n_embd=16)
    return GPT(cfg).eval()


def test_own_training_window_gives_lm_loss(model: GPT) -> None:
    tokens = torch.randint(0, 37, (17,))
    x, y = tokens[:-1][None], tokens[1:][None]  # one full window of C = 16
    expected = lm_loss(model(x), y).item()
    result = evaluate(model, tokens)
    assert result.tokens == 16
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-6)
    assert result.bits_per_byte is None


def _manual_loss(model: GPT, tokens: torch.Tensor, C: int, S: int) -> float:
    """Each target scored once, by the first window (starts 0, S, 2S, ..., and one
    ending at the last token) that contains it, computed one window at a time."""
    n = len(tokens)
    starts = list(range(0, n - 1 - C + 1, S))
    if starts[-1] + C < n - 1:
        starts.append(n - 1 - C)
    nll = torch.zeros(n)
    seen = torch.zeros(n, dtype=torch.bool)
    for b in starts:
        logits = model(tokens[b:b + C][None])[0]  # (C, V)
        for row, j in enumerate(range(b + 1, b + C + 1)):
            if not seen[j]:
                nll[j] = torch.nn.functional.cross_entropy(logits[row], tokens[j])
                seen[j] = True
    assert seen[1:].all()
    return nll[1:].mean().item()


def test_non_overlapping_windows_cover_every_target_once(model: GPT) -> None:
    tokens = torch.randint(0, 37, (50,))  # 49 targets
    expected = _manual_loss(model, tokens, 16, 16)
    for bs in (1, 2, 16):
        result = evaluate(model, tokens.numpy().astype(np.uint16), batch_size=bs)
        assert result.tokens == 49
        assert result.loss == pytest.approx(expected, rel=1e-5)


def test_sliding_window_equals_manual_computation(model: GPT) -> None:
    tokens = torch.randint(0, 37, (40,))
    expected = _manual_loss(model, tokens, 16, 4)
    result = evaluate(model, tokens, stride=4, batch_size=3)
    assert result.tokens == 39
    assert result.loss == pytest.approx(expected, rel=1e-5)
    # Scored targets get more left context, so the loss differs from stride C.
    assert result.loss != pytest.approx(evaluate(model, tokens).loss, rel=1e-9)


def test_sharded_split_is_read_in_place_and_scores_like_one_array(model: GPT,
                                                                    monkeypatch) -> None:
    """A split of several memory-mapped shards (issue 17): evaluate reads its windows
    from the shards (never the whole split as one array) and gives the loss of the same
    tokens as one array, with windows that straddle shard boundaries."""
    from tinylm.data.shards import TokenShards

    ids = np.random.default_rng(0).integers(0, 37, 301).astype(np.uint16)
    shards = TokenShards([ids[:100], ids[100:170], ids[170:]])
    want = evaluate(model, ids, batch_size=3, stride=5)
    monkeypatch.setattr(TokenShards, "__array__", lambda *a, **k: pytest.fail("copied"))
    got = evaluate(model, shards, batch_size=3, stride=5)
    assert got.tokens == want.tokens == 300
    assert got.loss == pytest.approx(want.loss, rel=1e-6)


def test_short_sequence_is_one_window(model: GPT) -> None:
    tokens = torch.randint(0, 37, (6,))
    expected = lm_loss(model(tokens[:-1][None]), tokens[1:][None]).item()
    for stride in (None, 3, 16):
        assert evaluate(model, tokens, stride=stride).loss == pytest.approx(expected, rel=1e-6)


def test_bits_per_byte_formula(model: GPT) -> None:
    assert bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 100, 250) == pytest.approx(2.0 * 100 / (math.log(2) * 250))
    tokens = torch.randint(0, 37, (33,))
    r = evaluate(model, tokens, num_bytes=64)
    assert r.bits_per_byte == pytest.approx(r.loss * 32 / (math.log(2) * 64))


def test_max_windows_and_mode_restored(model: GPT) -> None:
    tokens = torch.randint(0, 37, (100,))
    model.train()
    try:
        r = evaluate(model, tokens, max_windows=2)
        assert model.training
    finally:
        model.eval()
    assert r.tokens == 32


@pytest.mark.parametrize("kwargs, error", [
    ({"stride": 0}, ConfigError), ({"stride": 17}, ConfigError),
    ({"batch_size": 0}, ConfigError), ({"context_length": 99}, ConfigError),
    ({"max_windows": 0}, ConfigError),
])
def test_bad_arguments(model: GPT, kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        evaluate(model, list(range(20)), **kwargs)


def test_bad_tokens(model: GPT) -> None:
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        evaluate(model, [1, 2, 500, 3])
    with pytest.raises(DataError, match="at least 2 tokens"):
        evaluate(model, [1])


# --- texts, prepared splits and `tinylm eval` ----------------------------------------------

TEXT = "This is a pen. これはペンです。\n" * 30


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """A prepared char dataset and a tiny random model saved with its tokenizer."""
    from tinylm.data import prepare
    from tinylm.io.checkpoint_files import save_checkpoint

    root = tmp_path_factory.mktemp("eval")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(root / "data", [root / "corpus.txt"], tokenizer="char", val_fraction=0.25,
                   context_length=16, progress=False)
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=data.tokenizer.vocab_size, context_length=16, n_layer=1,
                        n_head=2, n_embd=16))
    ckpt = save_checkpoint(root / "model", m, data.tokenizer)
    return root, data, m, ckpt


def test_decoded_bytes_counts_utf8(run) -> None:
    from tinylm.use.evaluation import decoded_bytes

    _root, data, _m, _ckpt = run
    tok = data.tokenizer
    ids = tok.encode(TEXT)
    assert decoded_bytes(tok, ids, chunk=7) == len(TEXT.encode("utf-8"))
    split = tok.decode(data.val)
    assert decoded_bytes(tok, data.val) == len(split.encode("utf-8"))


def test_decoded_bytes_never_splits_a_character() -> None:
    from tinylm.data.tokenizers import BPETokenizer
    from tinylm.use.evaluation import decoded_bytes

    text = "日本語のテキスト。" * 20 + "naïve café"
    tok = BPETokenizer.train([text], vocab_size=260)  # few merges: characters span tokens
    ids = tok.encode(text)
    for chunk in (1, 2, 3, 5):
        assert decoded_bytes(tok, ids, chunk=chunk) == len(text.encode("utf-8"))


def test_split_and_text_results(run) -> None:
    from tinylm.use.evaluation import evaluate_split, evaluate_text

    root, data, m, _ckpt = run
    r = evaluate_split(m, data.tokenizer, root / "data", "val")
    direct = evaluate(m, data.val)
    assert r.loss == pytest.approx(direct.loss) and r.tokens == len(data.val) - 1
    val_bytes = len(data.tokenizer.decode(data.val).encode("utf-8"))
    assert r.bits_per_byte == pytest.approx(r.loss * r.tokens / (math.log(2) * val_bytes))
    t = evaluate_text(m, data.tokenizer, TEXT)
    assert t.tokens == len(TEXT) - 1
    assert t.bits_per_byte == pytest.approx(t.loss * t.tokens
                                            / (math.log(2) * len(TEXT.encode("utf-8"))))


def test_cli_eval_text_and_json(run, capsys) -> None:
    import json

    from tinylm.cli import main
    from tinylm.use.evaluation import evaluate_split

    root, data, m, ckpt = run
    assert main(["eval", "--model", str(ckpt), "--data", str(root / "data"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"loss", "perplexity", "bits_per_byte", "tokens"}
    expected = evaluate_split(m, data.tokenizer, root / "data")
    assert got["loss"] == pytest.approx(expected.loss, rel=1e-6)
    assert got["tokens"] == expected.tokens
    assert main(["eval", "--model", str(ckpt), "--text", str(root / "corpus.txt"),
                 "--stride", "4", "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "bits per byte" in out and f"{len(TEXT) - 1:,}" in out


@pytest.mark.parametrize("args, message", [
    (["--stride", "0"], "stride"),
    (["--stride", "17"], "stride"),
    (["--batch-size", "0"], "batch size"),
    (["--max-windows", "0"], "max_windows"),
])
def test_cli_eval_bad_flags(run, capsys, args: list[str], message: str) -> None:
    from tinylm.cli import main

    root, _data, _m, ckpt = run
    assert main(["eval", "--model", str(ckpt), "--data", str(root / "data"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_cli_eval_bad_inputs(run, tmp_path, capsys) -> None:
    from tinylm.cli import main
    from tinylm.data import prepare
    from tinylm.io.checkpoint_files import save_checkpoint

    root, data, m, ckpt = run
    # Data prepared with another tokenizer (a different alphabet).
    (tmp_path / "other.txt").write_text("abcdefghij klmnop\n" * 40, encoding="utf-8")
    prepare(tmp_path / "other", [tmp_path / "other.txt"], context_length=16, progress=False)
    (tmp_path / "unknown.txt").write_text("zzz unknown characters", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    no_tok = save_checkpoint(tmp_path / "no_tok", m)
    cases = [
        (["--model", str(ckpt), "--data", str(tmp_path / "other")], "different tokenizer"),
        (["--model", str(ckpt), "--text", str(tmp_path / "unknown.txt")], "never saw"),
        (["--model", str(ckpt), "--text", str(tmp_path / "latin1.txt")], "UTF-8"),
        (["--model", str(ckpt), "--text", str(tmp_path / "nope.txt")], "does not exist"),
        (["--model", str(ckpt), "--data", str(tmp_path / "nope")], "does not exist"),
        (["--model", str(tmp_path / "nope"), "--data", str(root / "data")], "does not exist"),
        (["--model", str(no_tok), "--text", str(root / "corpus.txt")], "no tokenizer"),
    ]
    for args, message in cases:
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
