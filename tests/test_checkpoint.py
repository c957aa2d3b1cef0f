"""Checkpoints: safetensors + JSON, atomic, identical logits after a round trip."""

from __future__ import annotations

import json

import pytest
import torch

from tinylm import GPT, CheckpointError, ModelConfig
from tinylm.io.checkpoint import load_model, load_train_state, read_config
from tinylm.io.checkpoint_files import save_checkpoint, strip_wrapper_prefixes
from tinylm.io.files import DiskFullError


def small() -> GPT:
    return GPT(ModelConfig(vocab_size=33, context_length=16, n_layer=2, n_head=2, n_embd=16))


def test_round_trip_identical_logits(tmp_path) -> None:
    model = small().eval()
    save_checkpoint(tmp_path / "ck", model)
    loaded = load_model(tmp_path / "ck")
    ids = torch.randint(0, 33, (2, 16))
    assert torch.equal(model(ids), loaded(ids))
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["format"] == "tinylm" and cfg["model"]["n_embd"] == 16


def test_untied_round_trip(tmp_path) -> None:
    model = GPT(ModelConfig(vocab_size=33, context_length=8, n_layer=1, n_head=2, n_embd=8,
                            tie_embeddings=False)).eval()
    save_checkpoint(tmp_path / "ck", model)
    ids = torch.randint(0, 33, (1, 8))
    assert torch.equal(model(ids), load_model(tmp_path / "ck")(ids))


def test_train_state_round_trip_and_overwrite_keeps_one_folder(tmp_path) -> None:
    model = small()
    save_checkpoint(tmp_path / "ck", model, train_tensors={"rng": torch.arange(5)},
                    train_meta={"step": 3})
    save_checkpoint(tmp_path / "ck", model, train_tensors={"rng": torch.arange(6)},
                    train_meta={"step": 4})
    tensors, meta = load_train_state(tmp_path / "ck")
    assert meta["step"] == 4 and torch.equal(tensors["rng"], torch.arange(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp folders left


def test_compiled_and_ddp_prefixes_are_stripped() -> None:
    state = {"_orig_mod.module.tok_emb.weight": 1, "module.blocks.0.ln1.bias": 2}
    assert strip_wrapper_prefixes(state) == {"tok_emb.weight": 1, "blocks.0.ln1.bias": 2}


def test_missing_folder(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_corrupt_weights(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", small())
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(tmp_path / "ck")


def test_corrupt_config(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", small())
    (tmp_path / "ck" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(tmp_path / "ck")


def test_mismatched_config(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", small())
    cfg_path = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["n_embd"] = 32
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path / "ck")


def test_failed_save_keeps_previous_checkpoint(tmp_path) -> None:
    model = small().eval()
    save_checkpoint(tmp_path / "ck", model)

    class Broken:
        def save(self, path):
            raise OSError(28, "No space left on device")

    with pytest.raises(DiskFullError, match="disk full while writing .*ck/tokenizer.json"):
        save_checkpoint(tmp_path / "ck", small(), tokenizer=Broken())
    ids = torch.randint(0, 33, (1, 16))
    assert torch.equal(load_model(tmp_path / "ck")(ids), model(ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_files_follow_the_umask(tmp_path, umask) -> None:
    import os
    import stat

    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "ck", small(), train_tensors={"t": torch.zeros(2)},
                        train_meta={"step": 1})
    finally:
        os.umask(old)
    folder = tmp_path / "ck"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert set(modes) == {"config.json", "model.safetensors", "train_state.safetensors",
                          "train_state.json"}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def _rewrite_weights(folder, change) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path))


def test_a_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path) -> None:
    """Issue #32: the extra lm_head.weight of a tied checkpoint was silently dropped."""
    model = small().eval()
    save_checkpoint(tmp_path / "ck", model)
    emb = model.tok_emb.weight.detach().clone()
    _rewrite_weights(tmp_path / "ck", lambda s: s.update({"lm_head.weight": emb + 1.0}))
    with pytest.raises(CheckpointError, match="lm_head.weight that differs from tok_emb"):
        load_model(tmp_path / "ck")
    _rewrite_weights(tmp_path / "ck", lambda s: s.update({"lm_head.weight": emb[:5]}))
    with pytest.raises(CheckpointError, match="differs from tok_emb"):
        load_model(tmp_path / "ck")
    # a head equal to the embedding (as some converters write it) is only a duplicate
    _rewrite_weights(tmp_path / "ck", lambda s: s.update({"lm_head.weight": emb.clone()}))
    loaded = load_model(tmp_path / "ck")
    ids = torch.randint(0, 33, (1, 16))
    assert torch.equal(loaded(ids), model(ids))
    assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_two_stored_names_of_one_weight_are_refused(tmp_path) -> None:
    """A wrapper-prefixed copy beside the plain name: one of them would be ignored."""
    model = small().eval()
    save_checkpoint(tmp_path / "ck", model)
    _rewrite_weights(tmp_path / "ck", lambda s: s.update(
        {"module.blocks.0.ln1.weight": s["blocks.0.ln1.weight"] * 2}))
    with pytest.raises(CheckpointError, match="name the same weight blocks.0.ln1.weight"):
        load_model(tmp_path / "ck")
    _rewrite_weights(tmp_path / "ck", lambda s: s.pop("module.blocks.0.ln1.weight"))
    assert torch.equal(load_model(tmp_path / "ck").blocks[0].ln1.weight,
                       model.blocks[0].ln1.weight)


def test_an_unused_extra_tensor_is_refused(tmp_path) -> None:
    model = small().eval()
    save_checkpoint(tmp_path / "ck", model)
    _rewrite_weights(tmp_path / "ck", lambda s: s.update({"blocks.0.extra": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['blocks.0.extra'\]"):
        load_model(tmp_path / "ck")
