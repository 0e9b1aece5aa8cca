"""Loader and saver: round trips through HF transformers, sharded files, bad inputs."""

import json
import os
import pickle
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import eqx_tx
from tests.hf_utils import hf_logits, hf_model, ragged_batch


def _keys(directory):
    keys = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="numpy") as f:
                keys.update(f.keys())
    return keys


def test_round_trip_through_hf(checkpoint, tmp_path):
    name, path = checkpoint
    model = eqx_tx.load(path, progress=False)
    out = tmp_path / "saved"
    eqx_tx.save(model, out)
    assert _keys(out) == _keys(path)
    ids, mask = ragged_batch(model.config.vocab_size, [8, 5])
    reloaded = hf_model(str(out))
    np.testing.assert_allclose(hf_logits(reloaded, ids, mask), hf_logits(path, ids, mask), atol=1e-6)
    assert json.load(open(out / "config.json"))["architectures"] == json.load(open(f"{path}/config.json"))["architectures"]


def test_sharded_save_with_index_loads_in_hf_and_back(checkpoints, tmp_path):
    path = checkpoints["gqa_untied"]
    model = eqx_tx.load(path, progress=False)
    out = tmp_path / "sharded"
    eqx_tx.save(model, out, max_shard_bytes=20_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.isfile(out / "model.safetensors.index.json")
    ids, mask = ragged_batch(model.config.vocab_size, [6, 6])
    np.testing.assert_allclose(hf_logits(str(out), ids, mask), hf_logits(path, ids, mask), atol=1e-6)
    again = eqx_tx.load(out, progress=False)
    np.testing.assert_array_equal(np.asarray(eqx_tx.logits(again, ids)), np.asarray(eqx_tx.logits(model, ids)))


def test_load_bf16_and_save_keeps_dtype(checkpoints, tmp_path):
    model = eqx_tx.load(checkpoints["mha_tied"], dtype=jnp.bfloat16, progress=False)
    assert model.model.layers.mlp.up_proj.weight.dtype == jnp.bfloat16
    eqx_tx.save(model, tmp_path / "bf16")
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="flax") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"


def test_save_replaces_atomically_and_failure_keeps_previous(checkpoints, tmp_path, monkeypatch):
    model = eqx_tx.load(checkpoints["mha_tied"], progress=False)
    out = tmp_path / "ckpt"
    eqx_tx.save(model, out)
    before = load_file(str(out / "model.safetensors"))

    import eqx_tx.io.saving as saving

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(saving, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        eqx_tx.save(model, out)
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp dir left behind


@pytest.fixture
def copy_of(tmp_path, checkpoints):
    def make(name="gqa_untied"):
        dst = tmp_path / "copy"
        shutil.copytree(checkpoints[name], dst)
        return dst

    return make


def _rewrite(directory, change):
    path = str(directory / "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_missing_key_error(copy_of):
    d = copy_of()
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        eqx_tx.load(d, progress=False)


def test_unexpected_key_error(copy_of):
    d = copy_of()
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(KeyError, match="unexpected tensor.*model.layers.0.extra.weight"):
        eqx_tx.load(d, progress=False)


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) - 100], r"its tensors need \d+ bytes but the file has \d+ \(truncated or corrupt\)"),
    (lambda b: b[:5], "5 bytes, too short for a safetensors header"),
    (lambda b: b[:8] + b"{not json" + b[17:], "unreadable header"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "its header claims 1000000000 bytes"),
])
def test_truncated_or_corrupt_safetensors_names_the_file(copy_of, damage, message):
    d = copy_of()
    path = d / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid safetensors file: ") + message):
        eqx_tx.load(d, progress=False)


def test_shape_mismatch_error(copy_of):
    d = copy_of()
    cfg = json.load(open(d / "config.json"))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(80, 48\), expected \(96, 48\)"):
        eqx_tx.load(d, progress=False)


def test_unsupported_architecture_error(copy_of):
    d = copy_of()
    cfg = json.load(open(d / "config.json"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*supported: .*Qwen3ForCausalLM"):
        eqx_tx.load(d, progress=False)


def test_unknown_rope_scaling_error(copy_of):
    d = copy_of()
    cfg = json.load(open(d / "config.json"))
    cfg["rope_parameters"] = {"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0}
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'proportional'"):
        eqx_tx.load(d, progress=False)


class _Boom:
    """Unpickling this would create a marker file: proof that nothing was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_directory_is_refused_without_unpickling(copy_of, tmp_path):
    d = copy_of()
    os.remove(d / "model.safetensors")
    marker = tmp_path / "unpickled"
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump(_Boom(str(marker)), f)
    with pytest.raises(ValueError, match=r"only pickled weights \(pytorch_model.bin\).*never unpickles"):
        eqx_tx.load(d, progress=False)
    assert not marker.exists()


def test_missing_directory_and_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        eqx_tx.load(str(tmp_path / "nope"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        eqx_tx.load(tmp_path / "empty", progress=False)


def test_saved_files_have_the_usual_modes(tmp_path):
    """A saved checkpoint is readable by others as a plain `mkdir` / `open` makes it
    (temporary directories are 0700 and safetensors writes 0600)."""
    import stat

    model = eqx_tx.init_model(eqx_tx.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=16), key=jax.random.key(0))
    mask = os.umask(0o022)
    try:
        eqx_tx.save(model, tmp_path / "final")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "final").st_mode) == 0o755
    for name in os.listdir(tmp_path / "final"):
        assert stat.S_IMODE(os.stat(tmp_path / "final" / name).st_mode) == 0o644, name
