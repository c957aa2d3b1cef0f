"""evaluation.py: exact loss over windows, sliding windows, bits per byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinylm.config import ModelConfig
from tinylm.errors import ConfigError, DataError
from tinylm.evaluation import bits_per_byte, evaluate
from tinylm.model import GPT, lm_loss


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
