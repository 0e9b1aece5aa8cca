"""Model FLOPs and decode bytes of a dense transformer config, for utilisation figures.

The conventions of model-FLOP utilisation: 2 FLOPs per matmul parameter per token
forward (6 with the backward pass), plus causal attention (QKᵀ and PV over the
visible half of the scores); recomputation under remat is not counted.
"""


def matmul_params(cfg, *, head: bool) -> int:
    """Parameters of every layer's projections, plus the LM head's when `head`."""
    D, Q, KV = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = D * (2 * Q + 2 * KV) + 3 * D * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + (cfg.vocab_size * D if head else 0)


def train_flops(cfg, B: int, T: int) -> float:
    """6 · matmul params · tokens, plus causal attention (QKᵀ and PV, forward and backward)."""
    attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T  # per token, causal half
    return B * T * (6 * matmul_params(cfg, head=True) + attention)


def prefill_flops(cfg, B: int, T: int) -> float:
    """The forward pass of `B` prompts of `T` tokens, with last-token logits only."""
    attention = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T
    return B * T * (2 * matmul_params(cfg, head=False) + attention) + 2 * B * cfg.vocab_size * cfg.hidden_size


def kv_element_bytes(head_dim: int, kv: str) -> float:
    """Bytes per cached key or value element: `bf16` 2; `int8` 1 plus its share of a
    float32 scale per head."""
    if kv not in ("bf16", "int8"):
        raise ValueError(f"KV dtype is bf16 or int8, not {kv!r}")
    return 2.0 if kv == "bf16" else 1.0 + 4.0 / head_dim


def decode_bytes_per_token(cfg, bytes_per_param: int, kv_length: float = 0, kv_bytes: float = 2) -> float:
    """Bytes read per decode step at batch 1: every layer, the final norm, the LM head,
    and the keys and values of `kv_length` cached positions (`kv_bytes` per element:
    an int8 cache's include its share of the scales)."""
    weights = matmul_params(cfg, head=True) + cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size
    if cfg.qk_norm:
        weights += cfg.num_hidden_layers * 2 * cfg.head_dim
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_length * kv_bytes
    return bytes_per_param * weights + kv
