"""inspection.py and `tinylm explain`: the seed's table, attention maps, PNG, HTML, neighbours."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinylm.cli import main
from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.data.tokenizers import CharTokenizer
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.use.inspection import (
    display_token,
    display_width,
    explain,
    format_table,
    nearest_tokens,
)

ALPHABET = "This apen.\n日本語<>/\"'&"
PROMPT = "This is a pen ."


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


@pytest.fixture(scope="module")
def model(tokenizer: CharTokenizer) -> GPT:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=24, n_layer=2, n_head=3,
                      n_embd=24)
    m = GPT(cfg)
    with torch.no_grad():  # larger weights than the init so the maps are not uniform
        for p in m.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    return m.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, model: GPT,
               tokenizer: CharTokenizer) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", model, tokenizer)


def test_rows_follow_the_seed_table(model: GPT, tokenizer: CharTokenizer) -> None:
    e = explain(model, tokenizer, PROMPT, top_k=4)
    ids = tokenizer.encode(PROMPT)
    assert list(e.ids) == ids and len(e.rows) == len(ids)
    for t, row in enumerate(e.rows):
        # Row t is the distribution after tokens 0..t: running the model on the prefix
        # alone gives the same distribution in its last row.
        assert row.position == t and row.id == ids[t] and row.token == PROMPT[t]
        with torch.no_grad():
            prefix = F.softmax(model(torch.tensor([ids[:t + 1]]))[0, -1], dim=-1)
        torch.testing.assert_close(e.probs[t], prefix, atol=1e-6, rtol=1e-5)
        top = torch.topk(prefix, 4)
        assert [c.id for c in row.candidates] == top.indices.tolist()


def test_probabilities_are_softmax_of_logits(model: GPT, tokenizer: CharTokenizer) -> None:
    e = explain(model, tokenizer, PROMPT, top_k=3)
    with torch.no_grad():
        logits = model(torch.tensor([list(e.ids)]))[0]
    torch.testing.assert_close(e.probs, F.softmax(logits, dim=-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(e.probs.sum(-1), torch.ones(len(e.ids)), atol=1e-5, rtol=0)
    for t, row in enumerate(e.rows):
        probs = [c.prob for c in row.candidates]
        assert probs == sorted(probs, reverse=True)
        assert probs[0] == pytest.approx(float(e.probs[t].max()))
        assert row.candidates[0].token == tokenizer.id_to_token(row.candidates[0].id)


def test_attention_maps_are_causal_and_those_of_the_fast_path(model: GPT,
                                                              tokenizer: CharTokenizer) -> None:
    e = explain(model, tokenizer, PROMPT)
    L, H, C = model.config.n_layer, model.config.n_head, len(e.ids)
    maps = e.attention
    assert maps.shape == (L, H, C, C)
    assert torch.all(maps.triu(diagonal=1) == 0)
    torch.testing.assert_close(maps.sum(-1), torch.ones(L, H, C), atol=1e-5, rtol=0)
    assert maps.std() > 0.05  # not uniform: the test below has teeth
    # Capture each attention layer's input in a fast-path (SDPA) forward, then recompute
    # its output from the explicit maps: maps · V, heads concatenated, W_o.
    inputs: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
             for b in model.blocks]
    outputs: list[torch.Tensor] = []
    out_hooks = [b.attn.register_forward_hook(lambda mod, args, out: outputs.append(out))
                 for b in model.blocks]
    try:
        with torch.no_grad():
            fast_logits = model(torch.tensor([list(e.ids)]))
    finally:
        for h in hooks + out_hooks:
            h.remove()
    for layer, block in enumerate(model.blocks):
        with torch.no_grad():
            _q, _k, v = block.attn._heads(inputs[layer])  # 3 × (1, H, C, D)
            r = maps[layer][None] @ v  # (1, H, C, C)·(1, H, C, D) -> (1, H, C, D)
            r = r.transpose(1, 2).reshape(1, C, -1)  # (1, H, C, D) -> (1, C, H·D)
            torch.testing.assert_close(block.attn.out(r), outputs[layer], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(F.softmax(fast_logits[0], -1), e.probs, atol=1e-5, rtol=1e-4)


def test_display_and_alignment(model: GPT, tokenizer: CharTokenizer) -> None:
    assert display_token(" ") == "␣" and display_token("\n") == "\\n"
    assert display_token("a\tb") == "a\\tb" and display_token("\x01") == "\\x01"
    assert display_width("日本") == 4
    table = format_table(explain(model, tokenizer, "a pen\n日本", top_k=3))
    lines = table.splitlines()
    assert len(lines) == 1 + 8  # header + one line per token, newline escaped
    assert lines[2].split()[1] == "␣" and lines[6].split()[1] == "\\n"
    # Aligned: in every row the first candidate starts at the header's "next-token"
    # display column (wide characters such as 日 count two columns).
    column = display_width(lines[0][:lines[0].index("next-token")])

    def char_at(line: str, col: int) -> str:
        for i in range(len(line)):
            if display_width(line[:i]) == col:
                return line[i] if display_width(line[i - 1]) and line[i - 1] == " " else "?"
        return "?"

    assert all(char_at(line, column) not in " ?" for line in lines[1:])


def test_neighbours(model: GPT, tokenizer: CharTokenizer) -> None:
    ns = nearest_tokens(model, tokenizer, "a", count=5)
    assert ns[0].token == "a" and ns[0].similarity == pytest.approx(1.0)
    sims = [n.similarity for n in ns]
    assert sims == sorted(sims, reverse=True) and len(ns) == 5
    emb = model.tok_emb.weight.detach()
    other = ns[1].id
    expected = F.cosine_similarity(emb[tokenizer.token_to_id("a")], emb[other], dim=0)
    assert ns[1].similarity == pytest.approx(float(expected), abs=1e-6)
    with pytest.raises(DataError, match="not a single token"):
        nearest_tokens(model, tokenizer, "pen")
    # Tokens as the table spells them: ␣ for a space, \n for a newline.
    assert nearest_tokens(model, tokenizer, "␣", count=1)[0].token == " "
    assert nearest_tokens(model, tokenizer, "\\n", count=1)[0].token == "\n"
    with pytest.raises(DataError, match="never saw"):
        nearest_tokens(model, tokenizer, "z")


def test_bad_explain_arguments(model: GPT, tokenizer: CharTokenizer) -> None:
    with pytest.raises(ConfigError):
        explain(model, tokenizer, PROMPT, top_k=0)
    with pytest.raises(DataError, match="context length is 24"):
        explain(model, tokenizer, "a" * 25)
    with pytest.raises(DataError, match="empty"):
        explain(model, tokenizer, "")


URL = re.compile(r"https?:|//[A-Za-z0-9]|\b(src|href)\s*=|@import|url\(", re.IGNORECASE)


# --- the command line -----------------------------------------------------------------------


def test_cli_table_json_png_html(checkpoint: Path, tmp_path: Path, capsys) -> None:
    png, page = tmp_path / "maps.png", tmp_path / "maps.html"
    assert main(["explain", "--model", str(checkpoint), "--prompt", PROMPT, "--top-k", "3",
                 "--attention", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["t", "token"] and len(out) == 1 + len(PROMPT)
    assert out[1].split()[:2] == ["0", "T"] and out[2].split()[:2] == ["1", "h"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not URL.search(page.read_text(encoding="utf-8"))
    assert main(["explain", "--model", str(checkpoint), "--prompt", PROMPT, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["token"] for r in rows] == list(PROMPT)
    assert set(rows[0]["candidates"][0]) == {"token", "id", "prob"}
    assert len(rows[0]["candidates"]) == 5


def test_cli_neighbours(checkpoint: Path, capsys) -> None:
    assert main(["explain", "--model", str(checkpoint), "--neighbours", "a", "--count", "3",
                 "--json"]) == 0
    ns = json.loads(capsys.readouterr().out)
    assert ns[0]["token"] == "a" and len(ns) == 3
    assert main(["explain", "--model", str(checkpoint), "--neighbours", "日"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["0", "日"]


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "a" * 25], "context length"),
    (["--prompt", "xyz"], "never saw"),
    (["--prompt", PROMPT, "--top-k", "0"], "top-k"),
    (["--prompt", ""], "empty"),
    (["--neighbours", "zz"], "never saw"),
    (["--neighbours", "a", "--count", "0"], "count"),
    ([], "nothing to explain"),
])
def test_cli_bad_inputs(checkpoint: Path, capsys, extra: list[str], message: str) -> None:
    assert main(["explain", "--model", str(checkpoint), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("tinylm explain: error:")


def test_cli_bad_model_folders(checkpoint: Path, tmp_path: Path, capsys) -> None:
    import shutil

    assert main(["explain", "--model", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not safetensors at all")
    assert main(["explain", "--model", str(corrupt), "--prompt", "a"]) == 2
    mismatched = tmp_path / "mismatched"
    shutil.copytree(checkpoint, mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["model"]["n_embd"] = 48
    (mismatched / "config.json").write_text(json.dumps(cfg))
    assert main(["explain", "--model", str(mismatched), "--prompt", "a"]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 3 and all(e.startswith("tinylm explain: error:") for e in errs)


def test_spare_embedding_rows_are_shown_as_unused(tokenizer: CharTokenizer) -> None:
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size + 4, context_length=8, n_layer=1,
                      n_head=1, n_embd=8)
    wide = GPT(cfg).eval()
    e = explain(wide, tokenizer, "a pen", top_k=cfg.vocab_size)
    shown = {c.token for c in e.rows[0].candidates}
    assert f"<unused {tokenizer.vocab_size}>" in shown and len(shown) == cfg.vocab_size
    assert len(nearest_tokens(wide, tokenizer, "a", count=cfg.vocab_size)) == cfg.vocab_size
