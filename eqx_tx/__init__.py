"""eqx_tx: memory-first training and sampling of Hugging Face LLMs in JAX + Equinox."""

from .core.compute import ComputeConfig
from .core.log import enable_console_logging
from .core.sharding import RULES, make_mesh, shard
from .infer.engine import Engine, EngineConfig, TokenEvent
from .infer.generation import Generation, generate, generate_text
from .infer.sampling import SamplingParams
from .infer.text import Tokenizer, apply_chat_template, load_tokenizer
from .io.adapters import load_adapter, load_adapter_bank, save_adapter
from .io.loading import load
from .io.saving import save
from .layers.lora import adapter_slot, apply_lora, merge_lora, select_adapters, set_adapter_slot
from .models import CausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, config_from_hf
from .train.batch import Batch
from .train.forward import init_model, logits
from .train.loss import token_logprobs, weighted_cross_entropy
from .train.policy import PolicyLoss, policy_loss
from .train.training import OptimizerConfig, TrainConfig, TrainState, init_train_state, train_step

__all__ = [
    "Batch",
    "CausalLM",
    "ComputeConfig",
    "Engine",
    "EngineConfig",
    "Generation",
    "LlamaConfig",
    "OptimizerConfig",
    "PolicyLoss",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "RULES",
    "SamplingParams",
    "TrainConfig",
    "TrainState",
    "TokenEvent",
    "Tokenizer",
    "adapter_slot",
    "apply_chat_template",
    "apply_lora",
    "config_from_hf",
    "enable_console_logging",
    "generate",
    "generate_text",
    "init_model",
    "init_train_state",
    "load",
    "load_adapter",
    "load_adapter_bank",
    "load_tokenizer",
    "logits",
    "make_mesh",
    "merge_lora",
    "policy_loss",
    "save",
    "save_adapter",
    "select_adapters",
    "set_adapter_slot",
    "shard",
    "token_logprobs",
    "train_step",
    "weighted_cross_entropy",
]
