"""The architecture description shared by every decoder-only family."""

import abc
import dataclasses
import json
import os
from typing import ClassVar

from ..layers.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class TransformerConfig(abc.ABC):
    """What the generic decoder (`eqx_tx.models.transformer.CausalLM`) needs to know.

    Each family subclasses this once (frozen), maps its HF `config.json` onto these
    fields in `from_hf`, and writes it back in `to_hf`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Sparse MoE MLP (num_experts = 0: dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0

    architecture: ClassVar[str]
    model_type: ClassVar[str]

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )

    @classmethod
    @abc.abstractmethod
    def from_hf(cls, hf: dict) -> "TransformerConfig":
        """Build from a parsed HF `config.json`."""

    @abc.abstractmethod
    def to_hf(self) -> dict:
        """The HF `config.json` dict (transformers can build the model from it)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)


def read_hf_config(directory: str | os.PathLike) -> dict:
    """Parse `directory/config.json` with a clear error if it is missing or invalid."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {directory}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def require(hf: dict, key: str, where: str = "config.json"):
    """`hf[key]`, or an error naming the missing key."""
    if key not in hf or hf[key] is None:
        raise ValueError(f"{where}: missing required field {key!r}")
    return hf[key]


def eos_from_hf(value) -> int | tuple[int, ...] | None:
    if value is None or isinstance(value, int):
        return value
    return tuple(value)


def common_from_hf(hf: dict) -> dict:
    """The fields every family reads the same way from `config.json`."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    heads = int(require(hf, "num_attention_heads"))
    hidden = int(require(hf, "hidden_size"))
    return dict(
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
        max_position_embeddings=int(require(hf, "max_position_embeddings")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos_from_hf(hf.get("eos_token_id")),
    )


def common_to_hf(config: TransformerConfig, **extra) -> dict:
    """The `config.json` fields every family writes the same way, plus `extra`."""
    c = config
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    return {
        "architectures": [c.architecture],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "rope_scaling": None if c.rope.rope_type == "default" else c.rope.to_hf(),
        "rope_parameters": c.rope.to_hf(),
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        **extra,
    }
