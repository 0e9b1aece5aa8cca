"""Qwen2 / Qwen2.5: biases on q/k/v (not o), no q/k norm."""

import dataclasses
from typing import ClassVar

from ..layers.rope import RopeConfig
from .config import TransformerConfig, common_from_hf, common_to_hf


@dataclasses.dataclass(frozen=True)
class Qwen2Config(TransformerConfig):
    """`Qwen2ForCausalLM`'s `config.json`, as the fields eqx_tx uses."""

    rope: RopeConfig = RopeConfig(theta=1_000_000.0)
    qkv_bias: bool = True

    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    model_type: ClassVar[str] = "qwen2"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen2Config":
        return cls(**common_from_hf(hf), qkv_bias=True)

    def to_hf(self) -> dict:
        return common_to_hf(self, use_sliding_window=False)
