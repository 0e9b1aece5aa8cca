"""Qwen3 (dense): q/k RMSNorm, no biases by default, SwiGLU MLP."""

import dataclasses
from typing import ClassVar

from ..layers.rope import RopeConfig
from .config import TransformerConfig, common_from_hf, common_to_hf


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
        bias = bool(hf.get("attention_bias", False))
        return cls(**common_from_hf(hf), qkv_bias=bias, o_bias=bias)

    def to_hf(self) -> dict:
        if self.qkv_bias != self.o_bias:
            raise ValueError("Qwen3 has one attention_bias flag for q/k/v/o")
        return common_to_hf(self, attention_bias=self.qkv_bias, use_sliding_window=False)
