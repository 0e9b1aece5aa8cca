"""Model families. `config_from_hf` picks the family from `architectures`."""

from .config import TransformerConfig
from .llama import LlamaConfig
from .qwen2 import Qwen2Config
from .qwen3 import Qwen3Config
from .qwen3_moe import Qwen3MoeConfig
from .transformer import CausalLM

FAMILIES: dict[str, type[TransformerConfig]] = {
    c.architecture: c for c in (Qwen3Config, LlamaConfig, Qwen2Config, Qwen3MoeConfig)
}


def config_from_hf(hf: dict) -> TransformerConfig:
    """The family config for a parsed HF `config.json`, chosen by `architectures`."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch].from_hf(hf)
    raise ValueError(
        f"unsupported architecture {archs or hf.get('model_type')!r}; "
        f"supported: {', '.join(sorted(FAMILIES))}"
    )


__all__ = ["CausalLM", "FAMILIES", "LlamaConfig", "Qwen2Config", "Qwen3Config", "Qwen3MoeConfig", "TransformerConfig", "config_from_hf"]
