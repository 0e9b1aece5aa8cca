"""Llama 3.x: no q/k norm, optional attention/MLP biases, `llama3` RoPE scaling."""

import dataclasses
from typing import ClassVar

from ..layers.rope import RopeConfig
from .config import TransformerConfig, common_from_hf, common_to_hf


@dataclasses.dataclass(frozen=True)
class LlamaConfig(TransformerConfig):
    """`LlamaForCausalLM`'s `config.json`, as the fields eqx_tx uses."""

    rope: RopeConfig = RopeConfig(theta=500_000.0)
    max_position_embeddings: int = 131072

    architecture: ClassVar[str] = "LlamaForCausalLM"
    model_type: ClassVar[str] = "llama"

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        bias = bool(hf.get("attention_bias", False))
        return cls(**common_from_hf(hf), qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))

    def to_hf(self) -> dict:
        if self.qkv_bias != self.o_bias:
            raise ValueError("Llama has one attention_bias flag for q/k/v/o")
        return common_to_hf(self, attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
