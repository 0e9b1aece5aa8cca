"""Tiny random Hugging Face checkpoints and their PyTorch outputs (the oracle)."""

import numpy as np
import torch

torch.manual_seed(0)

# Small configs that cover MHA and GQA, tied and untied embeddings, head_dim !=
# hidden/heads, odd vocab sizes and attention biases; `architectures` picks the family
# (default Qwen3).
CONFIGS = {
    "mha_tied": dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True),
    "gqa_untied": dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gqa4_bias": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                      attention_bias=True, rope_theta=1000.0),
    # Llama 3 with llama3 RoPE scaling: the tests' sequences run past original_max_position_embeddings.
    "llama3": dict(architectures="LlamaForCausalLM", vocab_size=96, hidden_size=48, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
                   attention_bias=True, mlp_bias=True, max_position_embeddings=256,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "qwen3_moe": dict(architectures="Qwen3MoeForCausalLM", vocab_size=100, hidden_size=32, intermediate_size=64,
                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2": dict(architectures="Qwen2ForCausalLM", vocab_size=100, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}

# Divides over tp = 2, 4, 8 (kv heads over 2 and 4 only): used by the sharding tests.
TP_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)


def make_hf_checkpoint(directory, *, seed: int = 0, dtype=torch.float32, architectures="Qwen3ForCausalLM", **config):
    """Save a randomly initialised HF model (`Qwen3ForCausalLM` by default) with `save_pretrained`."""
    import transformers

    torch.manual_seed(seed)
    model_cls = getattr(transformers, architectures)
    cfg = model_cls.config_class(**config)
    model = model_cls(cfg).to(dtype)
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0: perturb them too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return str(directory)


def hf_model(directory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    return model


def hf_logits(directory_or_model, input_ids, attention_mask=None) -> np.ndarray:
    model = hf_model(directory_or_model) if isinstance(directory_or_model, str) else directory_or_model
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float().numpy()


def ragged_batch(vocab_size: int, lengths, seed: int = 0):
    """Right-padded random ids and 0/1 mask for sequences of `lengths`."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = rng.integers(0, vocab_size, size=(len(lengths), T))
    mask = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = np.where(mask == 1, ids, 0)
    return ids.astype(np.int32), mask


def per_expert(named: dict) -> dict:
    """HF's in-memory fused MoE tensors (transformers 5: `experts.gate_up_proj [E, 2I, D]`,
    `experts.down_proj [E, D, I]`) under their checkpoint names, one per expert."""
    out = {}
    for name, value in named.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = value[e, :half]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = value[e, half:]
        elif leaf == "down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out
