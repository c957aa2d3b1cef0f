"""Non-finite values at run time (issue #32): a checkpoint whose every weight is 3e38 passes
the load-time NaN/Inf check, then overflows float32 in the forward pass. sample, eval,
explain and chat (and the library functions behind them) stop with one line naming the
checkpoint (exit 2), never a torch.multinomial traceback, never "nan" with exit 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tinylm import GPT, CheckpointError, ModelConfig
from tinylm.cli import main
from tinylm.data.tokenizers import STANDARD_SPECIALS, CharTokenizer
from tinylm.io.checkpoint import load_model
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.use.chatsession import ChatSession
from tinylm.use.evaluation import evaluate
from tinylm.use.explorer import explorer_data
from tinylm.use.inspection import explain, nearest_tokens, trace
from tinylm.use.sampling import generate


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer("abcdef ", special_tokens=STANDARD_SPECIALS)


def _model(tok: CharTokenizer, value: float | None) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, n_layer=2,
                            n_head=2, n_embd=16)).eval()
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return model


@pytest.fixture(scope="module")
def huge(tmp_path_factory, tok: CharTokenizer) -> Path:
    """Every tensor 3e38: finite, so it loads; the embedding sum is already inf."""
    return save_checkpoint(tmp_path_factory.mktemp("nonfinite") / "huge", _model(tok, 3e38), tok)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_text("abc def abc fed " * 8, encoding="utf-8")
    return path


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line(code: int, err: str, command: str, huge: Path) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err and "multinomial" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"tinylm {command}: error: "), err
    assert str(huge) in lines[0] and "NaN or infinite" in lines[0], err
    assert "earlier checkpoint" in lines[0], err


def test_the_checkpoint_loads_its_weights_are_finite(huge: Path) -> None:
    model = load_model(huge)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("flags", [[], ["--temperature", "0"], ["--top-k", "3"]])
def test_sample_stops_with_one_line(huge: Path, capsys, flags: list[str]) -> None:
    code, out, err = _cli(["sample", "--model", str(huge), "--prompt", "abc",
                           "--max-new-tokens", "4", *flags], capsys)
    _assert_one_line(code, err, "sample", huge)
    assert "next-token logits" in err


def test_eval_stops_with_one_line_unless_allowed(huge: Path, text_file: Path, capsys) -> None:
    code, out, err = _cli(["eval", "--model", str(huge), "--text", str(text_file)], capsys)
    _assert_one_line(code, err, "eval", huge)
    assert "nan" not in out.lower()
    # --allow-nonfinite: "see the (non-finite) loss anyway" (docs/evaluate.md)
    code, out, err = _cli(["eval", "--model", str(huge), "--text", str(text_file),
                           "--allow-nonfinite", "--json"], capsys)
    assert code == 0, err
    assert not math.isfinite(json.loads(out)["loss"])


@pytest.mark.parametrize("flags", [["--prompt", "abc"], ["--prompt", "abc", "--html", "P"],
                                   ["--prompt", "abc", "--neighbours", "a"]])
def test_explain_stops_with_one_line(huge: Path, capsys, tmp_path: Path,
                                     flags: list[str]) -> None:
    flags = [str(tmp_path / "page.html") if f == "P" else f for f in flags]
    code, out, err = _cli(["explain", "--model", str(huge), *flags], capsys)
    _assert_one_line(code, err, "explain", huge)
    assert out == "" and not (tmp_path / "page.html").exists()


def test_chat_stops_with_one_line(huge: Path, capsys) -> None:
    code, out, err = _cli(["chat", "--model", str(huge), "--prompt", "abc", "--device", "cpu"],
                          capsys)
    _assert_one_line(code, err, "chat", huge)


def test_library_functions_raise_checkpoint_errors(huge: Path, tok: CharTokenizer) -> None:
    model = load_model(huge)
    ids = tok.encode("abc")
    with pytest.raises(CheckpointError, match=f"{huge}.*NaN or infinite"):
        generate(model, ids, 3, temperature=0)
    with pytest.raises(CheckpointError, match="NaN or infinite values in the loss"):
        evaluate(model, tok.encode("abc def " * 4))
    with pytest.raises(CheckpointError, match="NaN or infinite values in the next-token logits"):
        explain(model, tok, "abc")
    with pytest.raises(CheckpointError, match="NaN or infinite values in the traced logits"):
        trace(model, ids)
    with pytest.raises(CheckpointError, match="NaN or infinite values in the traced logits"):
        explorer_data(model, tok, "abc")
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        "".join(ChatSession(model, tok, temperature=0).reply("abc"))


def test_a_model_built_in_python_is_named_the_model(tok: CharTokenizer) -> None:
    model = _model(tok, 3e38)
    with pytest.raises(CheckpointError, match="^the model gives NaN or infinite"):
        generate(model, tok.encode("ab"), 2)
    finite = _model(tok, None)  # the check costs nothing to a model that works
    assert generate(finite, tok.encode("ab"), 2, temperature=0).shape == (1, 4)
    assert math.isfinite(evaluate(finite, tok.encode("abc def " * 4)).loss)
    assert nearest_tokens(finite, tok, "b", 3)[0].token == "b"
    with torch.no_grad():
        finite.tok_emb.weight[tok.token_to_id("a")] = float("nan")
    with pytest.raises(CheckpointError, match="cosine similarities of its token embeddings"):
        nearest_tokens(finite, tok, "b")


def test_check_logits_is_what_a_decoding_loop_calls(huge: Path) -> None:
    """A server's own decoding loop (tinylm serve's engine) checks each step the same way."""
    from tinylm.use.sampling import check_logits

    model = load_model(huge)
    check_logits(model, torch.zeros(2, 5))
    for bad in (float("nan"), float("inf"), -float("inf")):
        logits = torch.zeros(2, 5)
        logits[1, 3] = bad
        with pytest.raises(CheckpointError, match=f"the model of {huge} gives NaN"):
            check_logits(model, logits)
