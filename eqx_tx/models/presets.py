"""Named model configurations (architecture only, no weights)."""

from ..layers.rope import RopeConfig
from . import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
from .config import TransformerConfig


def _llama3_rope(factor: float) -> RopeConfig:
    return RopeConfig(theta=500_000.0, rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)

PRESETS: dict[str, TransformerConfig] = {
    # Trains from scratch on the shipped tiny stories in about a minute on 2 CPU cores.
    "tiny": Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
    ),
    # Qwen3-0.6B.
    "qwen3-0.6b": Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=True, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
    ),
    # Qwen3-4B-Instruct-2507.
    "qwen3-4b": Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope=RopeConfig(theta=5_000_000.0),
        tie_word_embeddings=True, max_position_embeddings=262144, bos_token_id=151643, eos_token_id=151645,
    ),
    # Llama-3.2-1B.
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope=_llama3_rope(32.0), tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
    ),
    # Llama-3.1-8B.
    "llama3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=_llama3_rope(8.0), tie_word_embeddings=False,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
    ),
    # Qwen2.5-7B.
    "qwen2.5-7b": Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=151643, eos_token_id=151643,
    ),
    # Qwen3-30B-A3B: 128 experts, 8 per token.
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=False, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
}


def preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
