"""eqx_tx: memory-first training and sampling of Hugging Face LLMs in JAX + Equinox."""

from .compute import ComputeConfig
from .forward import init_model, logits
from .loading import load
from .models import CausalLM, Qwen3Config, config_from_hf
from .saving import save
from .sharding import RULES, make_mesh, shard

__all__ = [
    "CausalLM",
    "ComputeConfig",
    "Qwen3Config",
    "RULES",
    "config_from_hf",
    "init_model",
    "load",
    "logits",
    "make_mesh",
    "save",
    "shard",
]
