"""Qwen3-MoE: Qwen3 attention, a sparse top-k MoE MLP in every layer."""

import dataclasses
from typing import ClassVar

from .config import common_from_hf, common_to_hf, require
from .qwen3 import Qwen3Config


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """`Qwen3MoeForCausalLM`'s `config.json`, as the fields eqx_tx uses."""

    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    model_type: ClassVar[str] = "qwen3_moe"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or require(hf, "num_experts"))
        step, dense = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
        layers = int(require(hf, "num_hidden_layers"))
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        if len(moe_layers) != layers:
            raise ValueError(
                f"config.json: decoder_sparse_step={step}, mlp_only_layers={dense} mix dense and MoE layers; "
                "eqx_tx supports the all-MoE layout of released Qwen3-MoE models"
            )
        bias = bool(hf.get("attention_bias", False))
        return cls(**common_from_hf(hf), qkv_bias=bias, o_bias=bias,
                   num_experts=experts, num_experts_per_tok=int(require(hf, "num_experts_per_tok")),
                   moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))

    def to_hf(self) -> dict:
        return common_to_hf(
            self, attention_bias=self.qkv_bias, use_sliding_window=False, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob, router_aux_loss_coef=self.router_aux_loss_coef,
            decoder_sparse_step=1, mlp_only_layers=[],
        )
