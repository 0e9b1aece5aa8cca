"""RoPE scaling (yarn, dynamic NTK, longrope, llama3, linear) against Hugging Face."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import eqx_tx
from eqx_tx.infer.generation import generate
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.layers.rope import RopeConfig
from tests.hf_utils import hf_logits, hf_model, make_hf_checkpoint

HEAD_DIM = 16
MAX_POS = 64
ORIGINAL = 16  # every test sequence runs past it
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL, factor=4.0,
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0])
SCALINGS = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn_untruncated": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=ORIGINAL,
                             beta_fast=16.0, beta_slow=2.0, truncate=False),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, mscale=0.8,
                        mscale_all_dim=0.5),
    "yarn_attention_factor": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=ORIGINAL,
                                  attention_factor=1.25),
    "yarn_no_factor": dict(rope_type="yarn", factor=None, original_max_position_embeddings=ORIGINAL),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "longrope": LONGROPE,
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "linear": dict(rope_type="linear", factor=2.5),
}


def _hf_config(params, max_pos=MAX_POS, theta=10000.0):
    cfg = dict(TINY, max_position_embeddings=max_pos)
    return transformers.Qwen3Config(**cfg, rope_parameters={**params, "rope_theta": theta})


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("seq_len", [8, ORIGINAL + 1, 3 * MAX_POS])
def test_frequencies_and_attention_factor_equal_hf(name, seq_len):
    params = SCALINGS[name]
    hf_config = _hf_config(params)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu", seq_len=seq_len)
    if params["rope_type"] == "dynamic":  # as HF's forward: only past max_position_embeddings
        hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=torch.tensor(seq_len))
    rope = RopeConfig.from_hf(hf_config.to_dict())
    ours = np.asarray(rope.inv_freq_for(HEAD_DIM, jnp.asarray(seq_len)))
    np.testing.assert_allclose(ours, hf_inv.numpy(), rtol=2e-6)
    assert rope.attention_scaling() == pytest.approx(hf_scale, rel=1e-12)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_config_round_trips_through_hf(name):
    hf = _hf_config(SCALINGS[name]).to_dict()
    rope = RopeConfig.from_hf(hf)
    again = RopeConfig.from_hf({"max_position_embeddings": MAX_POS, "rope_parameters": rope.to_hf()})
    assert again == rope
    assert rope.to_hf() == {k: v for k, v in hf["rope_parameters"].items()
                            if k != "partial_rotary_factor" and v is not None}


@pytest.mark.parametrize("params,message", [
    (dict(rope_type="yarn", factor=0.5, original_max_position_embeddings=16), "factor must be >= 1"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=1.0, beta_slow=8.0),
     "beta_fast"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=-1.0),
     "attention_factor must be > 0"),
    (dict(rope_type="dynamic"), "needs 'factor'"),
    (dict(LONGROPE, long_factor=[1.0, 2.0]), "differ in length"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
          original_max_position_embeddings=16), "high_freq_factor"),
    (dict(rope_type="su", factor=2.0), "unsupported rope scaling type 'su'"),
])
def test_inconsistent_rope_settings_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        RopeConfig.from_hf({"max_position_embeddings": MAX_POS, "rope_parameters": {**params, "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def scaled_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {name: make_hf_checkpoint(root / name, rope_parameters={**SCALINGS[name], "rope_theta": 10000.0},
                                     **dict(TINY, max_position_embeddings=32 if name == "dynamic" else MAX_POS))
            for name in ("yarn", "dynamic", "longrope")}


@pytest.mark.parametrize("name", ["yarn", "dynamic", "longrope"])
def test_model_logits_past_the_original_length_equal_hf(scaled_checkpoints, name):
    path = scaled_checkpoints[name]
    model = eqx_tx.load(path, progress=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], (2, 48)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 40:] = 0  # ragged
    for attention in ("xla", "blockwise"):
        ours = np.asarray(eqx_tx.logits(model, ids, mask, compute=eqx_tx.ComputeConfig(attention=attention, block_q=8,
                                                                                        block_kv=8)))
        ref = hf_logits(path, ids, mask)
        np.testing.assert_allclose(ours[mask == 1], ref[mask == 1], atol=1e-4)
    # The training path: chunked LM head, as the loss sees it.
    targets = np.roll(ids, -1, axis=1)
    logp = np.asarray(eqx_tx.token_logprobs(model, ids, targets, attention_mask=mask, chunk_size=16))
    ref_logp = np.take_along_axis(torch.log_softmax(torch.as_tensor(ref), -1).numpy(), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp[mask == 1], ref_logp[mask == 1], atol=1e-4)


@pytest.mark.parametrize("name", ["yarn", "dynamic", "longrope"])
def test_prefill_and_decode_past_the_original_length_equal_hf_generate(scaled_checkpoints, name):
    path = scaled_checkpoints[name]
    model = eqx_tx.load(path, progress=False)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, TINY["vocab_size"], 12)]
    new = 30  # from position 12 past 16 (yarn, longrope) and past 32 (dynamic)
    ours = generate(model, [prompt], SamplingParams(max_new_tokens=new))[0]
    hf = hf_model(path)  # fresh: HF's dynamic frequencies remember earlier calls
    out = hf.generate(torch.as_tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    assert ours.tokens == tokens
    np.testing.assert_allclose(ours.logprobs, logps, atol=1e-4)


def test_scaling_is_written_back_on_save(scaled_checkpoints, tmp_path):
    model = eqx_tx.load(scaled_checkpoints["yarn"], progress=False)
    eqx_tx.save(model, tmp_path / "out")
    with open(os.path.join(tmp_path / "out", "config.json")) as f:
        saved = json.load(f)
    assert saved["rope_parameters"] == {**SCALINGS["yarn"], "rope_theta": 10000.0}
    assert eqx_tx.load(tmp_path / "out", progress=False).config.rope == model.config.rope
