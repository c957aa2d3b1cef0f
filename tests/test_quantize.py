"""tinylm.layers.quantized and tinylm.commands.quantize: the int8 scheme against closed-form
bounds, the replaced layer, the checkpoint round trip, `tinylm quantize` end to end, and every
command loading it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tinylm import GPT, ModelConfig, acceleration
from tinylm.cli import main
from tinylm.commands.quantize import quantize
from tinylm.core.decoding import Decoder
from tinylm.core.errors import ConfigError
from tinylm.data import prepare
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.quantized import (
    QuantizedLinear,
    dequantize_weight,
    quantize_weight,
    structure_of,
)
from tinylm.use.sampling import generate

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native.decoding import INT8_PREFILL_ROWS  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog. attention is all you need!\n" * 40


def tiny(**kw) -> GPT:
    cfg = dict(vocab_size=40, context_length=16, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg)).eval()


# --- the scheme ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape, group", [((7, 13), None), ((5, 33), 8), ((16, 64), 16),
                                          ((3, 10), 32), ((1, 1), None)])
def test_error_is_at_most_half_a_step_per_channel_or_group(bits, shape, group) -> None:
    W = torch.randn(*shape) * torch.rand(shape[0], 1) * 3  # rows of different magnitude
    q, s = quantize_weight(W, bits, group)
    O, I = shape
    G = I if group is None else min(group, I)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.shape == (O, -(-I // G))
    qmax = 2 ** (bits - 1) - 1
    assert int(q.abs().max()) <= qmax
    for g in range(s.shape[1]):  # the closed form, group by group
        block = W[:, g * G:(g + 1) * G]
        torch.testing.assert_close(s[:, g], block.abs().amax(1) / qmax)
        err = (block - q[:, g * G:(g + 1) * G].float() * s[:, g:g + 1]).abs()
        assert bool((err <= s[:, g:g + 1] / 2 * (1 + 1e-5)).all())
    torch.testing.assert_close(dequantize_weight(q, s, group), (q.float().view(O, -1)
                               * s.repeat_interleave(G, 1)[:, :I]), rtol=0, atol=0)
    assert bool(((dequantize_weight(q, s, group) - W).abs() <= s.max() / 2 * 1.0001).all())
    # The largest weight of every group is represented exactly (q = ±qmax).
    assert bool((q.abs().view(O, -1).amax(1) == qmax).all())


def test_zero_groups_and_exact_integers_are_exact() -> None:
    W = torch.zeros(3, 8)
    W[1] = torch.tensor([-127.0, 5, 0, 64, 127, -3, 1, 2])  # each group's max is 127: scale 1
    q, s = quantize_weight(W, 8, 4)
    torch.testing.assert_close(dequantize_weight(q, s, 4), W, rtol=0, atol=0)


def test_quantized_linear_is_dequantize_then_linear() -> None:
    lin = nn.Linear(19, 11)
    ql = QuantizedLinear.from_linear(lin, 8, 5)  # 19 = 5 + 5 + 5 + 4
    x = torch.randn(4, 3, 19)
    W = dequantize_weight(ql.qweight, ql.scale, 5)
    torch.testing.assert_close(ql(x), x @ W.t() + lin.bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ql(x), F.linear(x, lin.weight, lin.bias), rtol=0.05, atol=0.02)
    assert ql.qweight.dtype == torch.int8 and not ql.qweight.requires_grad


def test_quantize_report_and_bytes() -> None:
    model = tiny()
    report = quantize(model)
    names = [r.name for r in report.layers]
    assert names == [f"blocks.{i}.{n}" for i in range(2)
                     for n in ("attn.qkv", "attn.out", "ffn.up", "ffn.down")]
    assert set(structure_of(model)) == set(names)
    for r in report.layers:
        assert r.bytes_before == 4 * r.in_features * r.out_features
        assert r.bytes_after == r.in_features * r.out_features + 4 * r.out_features
        assert 0 < r.max_rel_error <= 1 / 254 * 1.0001 and 0 < r.mean_rel_error < 0.01
    saved = sum(r.bytes_before - r.bytes_after for r in report.layers)
    assert report.bytes_before - report.bytes_after == saved


def test_report_errors_share_one_denominator_and_the_table_says_so() -> None:
    """Issue 36 item 10: the mean error printed above its max (mean|dW|/mean|W| vs
    max|dW|/max|W|). A layer of small weights and one large one made it obvious; now both
    are over max|W| (mean <= max), against the closed forms, and the table says so."""
    model = tiny()
    torch.manual_seed(3)
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.up.weight.mul_(0.01)[0, 0] = 1.0  # one outlier per layer
    W = model.blocks[0].ffn.up.weight.detach().clone()
    old_mean = ((W - QuantizedLinear.from_linear(model.blocks[0].ffn.up).weight).abs().mean()
                / W.abs().mean())
    report = quantize(model)
    row = next(r for r in report.layers if r.name == "blocks.0.ffn.up")
    dW = W - model.blocks[0].ffn.up.weight
    assert float(old_mean) > row.max_rel_error  # the complaint: the old mean beat the max
    assert row.max_rel_error == pytest.approx(float(dW.abs().max() / W.abs().max()))
    assert row.mean_rel_error == pytest.approx(float(dW.abs().mean() / W.abs().max()))
    assert row.rel_error == pytest.approx(float(dW.norm() / W.norm()))
    assert all(r.mean_rel_error <= r.max_rel_error for r in report.layers)
    from tinylm.commands.quantize import format_report

    text = format_report(report)
    header = text.splitlines()[1].split()
    assert header[3:7] == ["max", "err", "mean", "err"] and "rel. error" in text
    assert "over the layer's largest |W| (one denominator: mean <= max)" in text
    assert "||W - q*s|| / ||W|| of the whole matrix" in text


@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 9}, "bits must be an integer in"), ({"bits": 1}, "bits must be"),
    ({"group_size": 0}, "group size must be"), ({"layers": ["mlp.c_fc"]}, "unknown layer"),
    ({"include_head": True}, "tie_embeddings"),
])
def test_bad_arguments_raise_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        quantize(tiny(), **kwargs)


# --- the checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("group, head", [(None, False), (8, True)])
def test_checkpoint_round_trip_gives_identical_logits(tmp_path, group, head) -> None:
    model = tiny(tie_embeddings=not head)
    quantize(model, 8, group, include_head=head)
    save_checkpoint(tmp_path / "q", model)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantize"] == structure_of(model)
    assert ("lm_head" in cfg["quantize"]) == head
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert stored["blocks.0.ffn.up.qweight"].dtype == torch.int8
    assert stored["blocks.0.ffn.up.scale"].dtype == torch.float32
    assert "blocks.0.ffn.up.weight" not in stored
    again, _ = load_checkpoint(tmp_path / "q")
    assert structure_of(again) == structure_of(model)
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_training_fast_paths_step_aside_and_greedy_decoding_matches_full_forwards() -> None:
    model = tiny()
    quantize(model, 8, 8)
    plan = acceleration.plan(model, "cpu")
    assert not {"block", "attention", "ffn"} & set(plan.paths)
    prompt = torch.randint(0, 40, (1, 4))
    with torch.no_grad():
        out = generate(model, prompt, 12, temperature=0)
        ids = prompt
        for _ in range(12):  # the oracle: repeated full forwards of the reference model
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert torch.equal(out, ids)


NATIVE_LIB = native.load() if os.environ.get("TINYLM_NATIVE") != "0" else None


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
@pytest.mark.parametrize("O, I, G", [(1, 1, None), (13, 7, None), (37, 19, 5), (65, 33, 8),
                                     (17, 129, 32), (100, 45, 45), (70, 300, None),
                                     (33, 521, 100), (9, 300, 7)])
def test_int8_kernel_equals_the_reference_layer_at_odd_shapes(O, I, G) -> None:
    """Rows 1-16 (the kernel's register tiles of 4 rows and their remainders, walks of 8
    rows over a panel and a second walk past 8), outputs that do not fill the last panel
    of 32, inputs past one block of 256 (and groups that straddle blocks), per channel and
    per group; the epilogue's bias, GELU and residual alone and together."""
    ql = QuantizedLinear.from_linear(nn.Linear(I, O), 8, G)
    res = torch.randn(16, O)
    for M in range(1, 17):
        x = torch.randn(M, I)
        with torch.no_grad():
            want = ql(x)
        G_ = I if G is None else min(G, I)
        got = NATIVE_LIB.linear_q8(x, ql.qweight, ql.scale, G_, ql.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got = NATIVE_LIB.linear_q8(x, ql.qweight, ql.scale, G_, None, 1, res[:M])
        want = F.gelu(F.linear(x, ql.weight), approximate="tanh") + res[:M]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got = NATIVE_LIB.linear_q8(x, ql.qweight, ql.scale, G_, ql.bias, 1, res[:M])
        want = F.gelu(F.linear(x, ql.weight, ql.bias), approximate="tanh") + res[:M]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
def test_int8_kernel_gelu_equals_f_gelu_over_its_range() -> None:
    """The epilogue's GELU (a vector at a time, as x·σ(2u), for full panels; the scalar
    tanh form for the last partial panel) against F.gelu(approximate="tanh") on outputs
    from -30 to 30: the tails (σ near 0 and 1, exp clamped) and the middle."""
    O = 70  # two full panels of 32 and a partial one
    q = torch.eye(O, dtype=torch.int8)  # y = x·diag(s) exactly: the GELU sees x·s
    s = torch.full((O, 1), 0.5)
    x = torch.linspace(-60, 60, 16 * O).view(16, O)
    got = NATIVE_LIB.linear_q8(x, q, s, O, None, 1)
    want = F.gelu(x * 0.5, approximate="tanh")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
def test_int8_packing_is_panels_of_32_output_features() -> None:
    """The packed layout the kernel streams: qp[p][i][j] = q[32p + j][i], scales
    sp[p][g][j] = s[32p + j][g], zero past the last output feature."""
    O, I, G = 40, 11, 4
    ql = QuantizedLinear.from_linear(nn.Linear(I, O), 8, G)
    packed = NATIVE_LIB.pack_q8(ql.qweight, ql.scale, G)
    q = torch.zeros(64, I, dtype=torch.int8)
    q[:O] = ql.qweight
    s = torch.zeros(64, 3)
    s[:O] = ql.scale
    assert torch.equal(packed.qweight.view(2, I, 32), q.view(2, 32, I).transpose(1, 2))
    assert torch.equal(packed.scale.view(2, 3, 32), s.view(2, 32, 3).transpose(1, 2))
    assert (packed.group_size, packed.out_features, packed.in_features) == (G, O, I)


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
def test_the_decoder_repacks_int8_weights_changed_in_place() -> None:
    """The fused step packs each QuantizedLinear once per weight; a later decoder of the
    same model must see integers or scales changed in place since."""
    model = tiny(tie_embeddings=False)
    quantize(model, include_head=True)
    prompt = torch.randint(0, 40, (2, 4))
    generate(model, prompt, 4, temperature=0)  # packs
    with torch.no_grad():
        model.lm_head.qweight.mul_(-1)  # in place: the version counters move
        model.lm_head.scale.mul_(3)
        model.blocks[0].ffn.up.qweight[:, :3] = 0
    with torch.inference_mode():
        plan = native.plan(model, "cpu")
        with plan.decoder(2) as dec:
            assert dec.path == "fused"
            dec.prefill(prompt)
            got = dec.step(prompt[:, -1])
        ref = Decoder(model, 2)  # the model's own forward
        ref.prefill(prompt)
        want = ref.step(prompt[:, -1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
def test_int8_prefill_of_a_short_prompt_runs_the_fused_step_and_equals_the_forward(
        monkeypatch) -> None:
    """A short prompt (B·T <= INT8_PREFILL_ROWS) goes through the fused step position by
    position, a long one through the model's forward; both give the reference logits and
    the same following step."""
    model = tiny(context_length=80, tie_embeddings=False)
    quantize(model, group_size=8, include_head=True)
    forwards = []
    real = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda *a: forwards.append(1) or real(*a))
    for B, T, via_forward in ((1, 5, False), (2, 64, False), (2, 65, True), (3, 1, False)):
        prompt = torch.randint(0, 40, (B, T))
        forwards.clear()
        with torch.inference_mode():
            with native.plan(model, "cpu").decoder(B) as dec:
                got = dec.prefill(prompt)
                assert bool(forwards) == via_forward == (B * T > INT8_PREFILL_ROWS)
                got_next = dec.step(prompt[:, 0])
            ref = Decoder(model, B)
            want = ref.prefill(prompt)
            want_next = ref.step(prompt[:, 0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_next, want_next, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(NATIVE_LIB is None, reason="TINYLM_NATIVE=0 or no C compiler: no kernel")
def test_int8_kernel_checks_its_arguments() -> None:
    ql = QuantizedLinear.from_linear(nn.Linear(10, 4), 8, 4)
    x = torch.randn(2, 10)
    with pytest.raises(native.OpError, match="int8"):
        NATIVE_LIB.linear_q8(x, ql.qweight.float(), ql.scale, 4, None)
    with pytest.raises(native.OpError, match="shape"):
        NATIVE_LIB.linear_q8(x, ql.qweight, ql.scale, 5, None)  # 2 groups, scale has 3
    with pytest.raises(native.OpError, match="group size"):
        NATIVE_LIB.linear_q8(x, ql.qweight, ql.scale, 0, None)
    packed = NATIVE_LIB.pack_q8(ql.qweight, ql.scale, 4)
    with pytest.raises(native.OpError, match="shape"):
        NATIVE_LIB.linear_q8_packed(torch.randn(2, 9), packed, None)  # I is 10
    with pytest.raises(native.OpError, match="shape"):
        NATIVE_LIB.linear_q8_packed(x, packed._replace(out_features=40), None)


# --- the command ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(root / "data", [root / "text.txt"], context_length=16, progress=False)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=data.vocab_size, context_length=16, n_layer=2,
                            n_head=2, n_embd=32, tie_embeddings=False))
    save_checkpoint(root / "model", model, data.tokenizer)
    code = main(["quantize", "--model", str(root / "model"), "--out", str(root / "q"),
                 "--data", str(root / "data"), "--group-size", "16", "--include-head"])
    assert code == 0
    return root


def test_quantize_prints_the_report_and_every_command_loads_it(setup, capsys, tmp_path) -> None:
    main(["quantize", "--model", str(setup / "model"), "--out", str(tmp_path / "q2"),
          "--layers", "ffn.up,attn.qkv", "--data", str(setup / "data"), "--eval-windows", "2"])
    printed = capsys.readouterr().out
    assert "blocks.1.ffn.up" in printed and "blocks.0.ffn.down" not in printed
    assert "val loss:" in printed and "perplexity" in printed and "MB ->" in printed
    model, tok = load_checkpoint(setup / "q")
    assert "lm_head" in structure_of(model) and tok is not None
    q = str(setup / "q")
    assert main(["sample", "--model", q, "--prompt", "the", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert main(["eval", "--model", q, "--data", str(setup / "data")]) == 0
    assert main(["explain", "--model", q, "--prompt", "the fox", "--json"]) == 0
    capsys.readouterr()


def test_data_prepared_with_another_tokenizer_is_refused_as_eval_refuses_it(
        setup, tmp_path, capsys) -> None:
    """Issue 36 item 3: --data of another tokenizer (here the same text in capitals: a
    char vocabulary of the same size, so every id is in range) printed a meaningless val
    loss with exit 0; now one line and exit 2, the words eval uses, nothing written."""
    (tmp_path / "upper.txt").write_text(TEXT.upper(), encoding="utf-8")
    other = prepare(tmp_path / "other", [tmp_path / "upper.txt"], context_length=16,
                    progress=False)
    model, _ = load_checkpoint(setup / "model")
    assert other.vocab_size == model.config.vocab_size  # the id range check cannot see it
    assert main(["eval", "--model", str(setup / "model"), "--data", str(other.dir)]) == 2
    eval_err = capsys.readouterr().err
    code = main(["quantize", "--model", str(setup / "model"), "--out", str(tmp_path / "q"),
                 "--data", str(other.dir)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("tinylm quantize: error:")
    assert "was prepared with a different tokenizer than the model's" in err
    assert eval_err.split(": error: ")[1].split(";")[0] == err.split(": error: ")[1].split(";")[0]
    assert str(setup / "model" / "tokenizer.json") in err
    assert not (tmp_path / "q").exists()
    # a missing folder: the hint prepares it with the model's tokenizer, not a char one
    code = main(["quantize", "--model", str(setup / "model"), "--out", str(tmp_path / "q"),
                 "--data", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert (f"does not exist; make it with the model's tokenizer: tinylm prepare --input TEXT "
            f"--tokenizer {setup / 'model' / 'tokenizer.json'} --out {tmp_path / 'absent'}") in err


def test_convert_to_hf_writes_the_dequantized_weights(setup, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    assert main(["convert", "--model", str(setup / "q"), "--to-hf", str(hf_dir),
                 "--weights-only"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    model, _ = load_checkpoint(setup / "q")
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--bits", "9"], "bits must be an integer in [2, 8]"),
    (["--group-size", "0"], "group size must be"),
    (["--layers", "mlp.c_fc"], "unknown layer name 'mlp.c_fc'"),
    (["--layers", ","], "--layers names no layer"),
    (["--eval-windows", "0"], "--eval-windows must be"),
    (["--out", "EXISTING"], "is not empty and not a tinylm checkpoint"),
])
def test_bad_flags_give_one_line_errors(setup, tmp_path, capsys, flags, message) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    flags = [str(existing) if f == "EXISTING" else f for f in flags]
    code = main(["quantize", "--model", str(setup / "model"), "--out",
                 str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert (existing / "keep.txt").read_text() == "mine"


def test_serve_answers_from_the_quantized_checkpoint(setup) -> None:
    import httpx  # the [serve] and [dev] extras, which make test installs

    from serve_support import live_server
    from tinylm.serve import make_server
    from tinylm.use.sampling import generate_text

    make_server(setup / "q")  # the serve command's checks accept the folder
    model, tok = load_checkpoint(setup / "q")
    want = "".join(p for _, p in generate_text(model, tok, "the", 5, temperature=0))
    with live_server(model, tok, model_name="q") as (url, _):
        r = httpx.post(url + "/v1/completions", json={
            "model": "q", "prompt": "the", "max_tokens": 5, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


def test_a_llama_layout_quantizes_and_every_command_loads_it(setup, tmp_path, capsys) -> None:
    """Issue 19 on every architecture: a Llama-layout model (RMSNorm, RoPE, SwiGLU's gate,
    grouped-query attention, untied head) quantizes with every Linear in int8; sample,
    eval and explain load it, and the dequantized Hugging Face export gives its logits."""
    transformers = pytest.importorskip("transformers")
    from tinylm.core.config import resolve_arch
    from tinylm.data import load_prepared

    data = load_prepared(setup / "data")
    torch.manual_seed(1)
    cfg = ModelConfig(**resolve_arch("llama", dict(vocab_size=data.vocab_size,
                                                   context_length=16, n_layer=2, n_head=4,
                                                   n_kv_head=2, n_embd=32)))
    save_checkpoint(tmp_path / "llama", GPT(cfg), data.tokenizer)
    q = str(tmp_path / "q")
    assert main(["quantize", "--model", str(tmp_path / "llama"), "--out", q,
                 "--include-head", "--data", str(setup / "data"), "--eval-windows", "2"]) == 0
    model, _ = load_checkpoint(q)
    layers = structure_of(model)
    assert "blocks.1.ffn.gate" in layers and "lm_head" in layers and len(layers) == 2 * 5 + 1
    assert main(["sample", "--model", q, "--prompt", "the", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert main(["eval", "--model", q, "--data", str(setup / "data")]) == 0
    assert main(["explain", "--model", q, "--prompt", "the fox", "--json"]) == 0
    assert main(["convert", "--model", q, "--to-hf", str(tmp_path / "hf"),
                 "--weights-only"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)
    capsys.readouterr()
