"""Attention of `n` samples per prompt over one stored copy of the prompt's keys/values."""

from jaxtyping import Array, Float, Int

from .flash import flash_attention, merge_partials
from .quantized import Quantized

KV = Float[Array, "batch kv_seq kv_heads head_dim"] | Quantized


def shared_prefix_attention(
    q: Float[Array, "samples q_seq heads head_dim"],
    k_own: KV,
    v_own: KV,
    k_prompt: KV,
    v_prompt: KV,
    *,
    own_lengths: Int[Array, " samples"],
    own_offset: int | Int[Array, " samples"],
    prompt_lengths: Int[Array, " prompts"],
    block_q: int = 512,
    block_kv: int = 512,
) -> Float[Array, "samples q_seq heads head_dim"]:
    """Sample `s` (of `P * n`) attends to prompt `s // n` and to its own completion.

    The two parts are computed separately and merged by their log-sum-exp, which is
    exact. The prompt part runs the `n` samples of a prompt as extra queries of that
    prompt's row, so the prompt's keys/values are never copied.

    **Arguments:**

    - `q`: the samples' queries.
    - `k_own`, `v_own`: each sample's completion keys/values (slot `t`: completion
      token `t`), masked causally from `own_offset` and by `own_lengths`.
    - `k_prompt`, `v_prompt`: `[P, prompt_len, ...]`, all visible up to `prompt_lengths`.
    - `block_q`, `block_kv`: blockwise tile sizes.

    **Returns:** the attention output, dtype of `q`.
    """
    S, T, H, K = q.shape
    P = prompt_lengths.shape[0]
    n = S // P
    o_own, lse_own = flash_attention(q, k_own, v_own, kv_lengths=own_lengths, q_offset=own_offset, causal=True,
                                     block_q=block_q, block_kv=block_kv)
    o_pre, lse_pre = flash_attention(q.reshape(P, n * T, H, K), k_prompt, v_prompt, kv_lengths=prompt_lengths,
                                     causal=False, block_q=block_q, block_kv=block_kv)
    o, _ = merge_partials(o_own, lse_own, o_pre.reshape(S, T, H, K), lse_pre.reshape(S, T, H))
    return o.astype(q.dtype)
