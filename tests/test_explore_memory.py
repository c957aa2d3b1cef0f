"""Bounded memory for explore/explain (issue #32): the explorer's ablations are reduced to
the page's numbers pass by pass, so an explore's peak memory is a few of one forward's
logits (C x V), not layers x heads x C x V; explore_cost says so before any work starts.

Peak memory is the process's resident high-water mark (VmHWM), reset through
/proc/self/clear_refs just before the call, minus its resident size then, measured in a
fresh interpreter (this file run as a script): inside a test run of a few GB, what the
allocator keeps from earlier tests moves the figures by more than the bounds allow.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinylm.core.config import ModelConfig
from tinylm.core.model import GPT
from tinylm.data.tokenizers import CharTokenizer
from tinylm.use import inspection
from tinylm.use.explorer import RequestCost, explain_cost, explore_cost, explorer_data
from tinylm.use.inspection import ablated_logits, ablation_keys, reduce_ablations, trace

VOCAB = 32_768  # a large vocabulary: one forward's logits over C = 32 tokens are 4 MiB
C = 32
LOGITS = 4 * C * VOCAB


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _peak_of(fn) -> int:
    """Bytes the resident set rose to above where it was, while ``fn()`` ran."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _model(n_layer: int, n_head: int) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=VOCAB, context_length=C, n_layer=n_layer,
                           n_head=n_head, n_embd=12)).eval()


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer("abcdefghijklmnopqrstuvwxyz")


def _explore_peak(model: GPT, tok: CharTokenizer) -> int:
    ids = [i % tok.vocab_size for i in range(C)]
    return _peak_of(lambda: explorer_data(model, tok, ids, top_k=5))


def measure_peaks() -> dict[str, int]:
    """Peak bytes of one explore: 1 x 1 and 2 x 6 (layers x heads) with passes of one
    ablation each, and 2 x 6 with the default passes."""
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz")
    small, big = _model(1, 1), _model(2, 6)
    _explore_peak(small, tok)  # once first: the one-time allocations of torch's kernels
    default_bytes = inspection.ABLATION_BYTES
    inspection.ABLATION_BYTES = LOGITS
    try:
        out = {"small": _explore_peak(small, tok), "big": _explore_peak(big, tok)}
    finally:
        inspection.ABLATION_BYTES = default_bytes
    return {**out, "default": _explore_peak(big, tok)}


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          check=True, timeout=300, env={**os.environ, "PYTHONPATH": src})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_explore_peak_does_not_grow_with_layers_times_heads(peaks) -> None:
    """2 layers x 6 heads (16 ablations: 64 MiB of logits if kept, and again in their
    softmax and concatenation) peak no higher than 1 x 1 (3 ablations) but for noise."""
    small, big = peaks["small"], peaks["big"]
    assert big <= 6 * LOGITS, (small, big, LOGITS)
    assert big - small <= 1.5 * LOGITS, (small, big, LOGITS)


def test_explore_peak_with_the_default_passes(peaks) -> None:
    assert peaks["default"] <= 6 * LOGITS + inspection.ABLATION_BYTES, (peaks, LOGITS)


def test_reduced_ablations_are_the_ablated_logits_reduced(tok: CharTokenizer) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=300, context_length=C, n_layer=2, n_head=2,
                            n_embd=12)).eval()
    ids = list(range(20))
    keys = ablation_keys(2, 2)
    full = ablated_logits(model, ids, keys)
    tiny_passes = reduce_ablations(model, ids, keys, lambda k, l: (k, l.clone()),
                                   max_bytes=1)  # one row per pass
    assert [k for k, _ in tiny_passes] == keys
    for b, (_, logits) in enumerate(tiny_passes):
        assert torch.allclose(logits, full[b], atol=1e-5)
    one = trace(model, ids, ablate=[keys[1]])["logits"]
    assert torch.allclose(full[1], one, atol=1e-4)


def test_explore_cost_is_known_before_and_bounds_the_peak(peaks) -> None:
    model = _model(2, 6)
    cost = explore_cost(model.config, C)
    assert isinstance(cost, RequestCost) and cost.forward_passes == 2 + 2 * (6 + 2)
    assert cost.bytes >= peaks["default"]
    assert cost.bytes <= 40 * LOGITS  # an estimate, not a multiple of L x H x C x V
    assert explain_cost(model.config, C).bytes < cost.bytes
    gpt2 = ModelConfig(vocab_size=50_257, context_length=1024, n_layer=12, n_head=12,
                       n_embd=768)
    small, full = explore_cost(gpt2, 32), explore_cost(gpt2, 1024)
    assert small.bytes < 2**30 < full.bytes  # what a server's budget refuses
    assert explore_cost(gpt2, 1024, layers=1).bytes < full.bytes


if __name__ == "__main__":  # the peaks fixture runs this file in a fresh interpreter
    torch.set_num_threads(1)
    print(json.dumps(measure_peaks()))
