"""The training-speed pieces: the Muon option and the memory-lean FFN backward."""

from __future__ import annotations

import pytest
import torch

from tinylm.core.config import ModelConfig, TrainConfig
from tinylm.core.model import GPT
from tinylm.training import MuonAdamW, build_optimizer, newton_schulz

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402


def _tiny() -> GPT:
    return GPT(ModelConfig(vocab_size=17, context_length=16, n_layer=2, n_head=2, n_embd=32))


def test_newton_schulz_orthogonalises() -> None:
    G = torch.randn(48, 16)
    X = newton_schulz(G, steps=10)
    assert X.shape == G.shape
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's band around 1, not exact 1
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(X.flatten(), (U @ Vh).flatten(), dim=0) > 0.95


def _newton_schulz_plain(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration as Muon's authors write it: one matrix, elementwise sums."""
    a, b, c = 3.4445, -4.775, 2.0315
    X = G / (G.norm() + 1e-7)
    X = X if X.shape[0] <= X.shape[1] else X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X if G.shape[0] <= G.shape[1] else X.T


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 40, 24), (1, 16, 16)])
def test_newton_schulz_stack_equals_each_matrix_in_the_plain_form(shape) -> None:
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(G)
    assert got.shape == G.shape
    for g, x in zip(G, got, strict=True):
        torch.testing.assert_close(x, _newton_schulz_plain(g), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(newton_schulz(g), x, atol=1e-6, rtol=1e-5)  # 2-D input


def test_muon_option_trains_and_round_trips_state() -> None:
    model = _tiny()
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3), torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    muon = [p for g in opt.param_groups if g["muon"] for p in g["params"]]
    assert muon and all(p.dim() == 2 for p in muon)
    assert all(p is not model.tok_emb.weight for p in muon)  # tied embedding stays on AdamW
    ids = torch.randint(0, 17, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    first = None
    for _ in range(30):
        loss = model.loss(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert model.loss(x, y).item() < 0.5 * first
    state = opt.state_dict()
    assert "momentum_buffer" in state["state"][state["param_groups"][0]["params"][0]]
    twin = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3), torch.device("cpu"))
    twin.load_state_dict(state)
    assert twin.state_dict()["param_groups"] == state["param_groups"]


def test_ffn_recomputed_gelu_matches_plain_autograd() -> None:
    model = _tiny().double()
    on = native.enabled()  # TINYLM_NATIVE=0: the reference FFN, which must agree too
    assert native.accelerate(model, "cpu").paths == ({"ffn"} if on else set())  # float64
    ffn = model.blocks[0].ffn
    assert type(ffn).__name__ == ("NativeFeedForward" if on else "FeedForward")
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    y = ffn(x)  # the recomputing path (grad enabled, nn.Linear down)
    plain = ffn.down(ffn.act(ffn.up(x)))  # plain autograd through the same modules
    assert torch.equal(y, plain)
    g = torch.randn_like(y)
    params = [x, ffn.up.weight, ffn.up.bias, ffn.down.weight, ffn.down.bias]
    ours = torch.autograd.grad(y, params, g)
    ref = torch.autograd.grad(plain, params, g)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda h: ffn.drop(ffn(h)), (x[:1, :2].detach().requires_grad_(),))


def test_muon_leaves_an_untied_head_to_adamw() -> None:
    """Muon orthogonalises the blocks' weight matrices only; an untied LM head (a
    classifier over the vocabulary) is decayed by AdamW, as the embedding is."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=17, context_length=16, n_layer=1, n_head=2,
                            n_embd=16, tie_embeddings=False))
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3), torch.device("cpu"))
    muon = {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]}
    blocks = {id(p) for p in model.blocks.parameters() if p.dim() == 2}
    assert muon == blocks
    head = next(g for g in opt.param_groups if any(p is model.lm_head.weight
                                                    for p in g["params"]))
    assert not head["muon"] and head["weight_decay"] == TrainConfig().weight_decay > 0


def test_train_with_muon_saves_and_resumes_exactly(tmp_path) -> None:
    from tinylm.data import prepare
    from tinylm.data.corpora import load_corpus
    from tinylm.training import train

    text = tmp_path / "text.txt"
    text.write_text(load_corpus("python-docs")[:20_000], encoding="utf-8")
    prepare(tmp_path / "data", [text], tokenizer="char", context_length=16, progress=False)
    model = dict(n_layer=1, n_head=2, n_embd=16, context_length=16)
    common = dict(optimizer="muon", batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4,
                  eval_windows=2, log_every=1, seed=3, device="cpu")
    whole = train(ModelConfig(**model), TrainConfig(**common, max_steps=8, save_every=8),
                  tmp_path / "data", tmp_path / "whole", progress=False)

    def crash(step: int) -> None:  # dies after step 5; OUT/latest holds step 4
        if step == 5:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(ModelConfig(**model), TrainConfig(**common, max_steps=8, save_every=4),
              tmp_path / "data", tmp_path / "split", progress=False, on_step=crash)
    resumed = train(ModelConfig(**model), TrainConfig(**common, max_steps=8, save_every=4),
                    tmp_path / "data", tmp_path / "split", resume=True, progress=False)
    assert whole.final_val_loss is not None
    assert resumed.final_val_loss == whole.final_val_loss  # moments + buffers restored
