"""Qwen3 (dense): q/k RMSNorm, no biases by default, SwiGLU MLP."""

import dataclasses
from typing import ClassVar

from ..layers.rope import RopeConfig
from .config import TransformerConfig, eos_from_hf, require


@dataclasses.dataclass(frozen=True)
class Qwen3Config(TransformerConfig):
    """`Qwen3ForCausalLM`'s `config.json`, as the fields eqx_tx uses."""

    rope: RopeConfig = RopeConfig(theta=1_000_000.0)
    max_position_embeddings: int = 40960
    qk_norm: bool = True

    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    model_type: ClassVar[str] = "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3Config":
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (Qwen3 uses 'silu')")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        heads = int(require(hf, "num_attention_heads"))
        hidden = int(require(hf, "hidden_size"))
        bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=int(require(hf, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(require(hf, "intermediate_size")),
            num_hidden_layers=int(require(hf, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            qkv_bias=bias,
            o_bias=bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_from_hf(hf.get("eos_token_id")),
        )

    def to_hf(self) -> dict:
        if self.qkv_bias != self.o_bias:
            raise ValueError("Qwen3 has one attention_bias flag for q/k/v/o")
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.rope_type == "default" else self.rope.to_hf(),
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.qkv_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
