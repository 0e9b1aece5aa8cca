"""Named model configurations (architecture only, no weights)."""

from .layers.rope import RopeConfig
from .models import Qwen3Config
from .models.config import TransformerConfig

PRESETS: dict[str, TransformerConfig] = {
    # Trains from scratch on the shipped tiny stories in about a minute on 2 CPU cores.
    "tiny": Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
    ),
    # Qwen3-4B-Instruct-2507.
    "qwen3-4b": Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope=RopeConfig(theta=5_000_000.0),
        tie_word_embeddings=True, max_position_embeddings=262144, bos_token_id=151643, eos_token_id=151645,
    ),
}


def preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
