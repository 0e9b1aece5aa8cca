"""Log-probabilities of a prompt's own tokens, and the most likely alternatives.

`prompt_scores` runs the prompt once and turns its last `n` positions' hidden states
into scores chunk by chunk through the LM head: at most one `[chunk, vocab]` float32
tile exists at a time, never `[prompt, vocab]` logits. The prompt is padded to a
power-of-two length (causal attention: padding after it changes nothing), so prompts
of many lengths share a few compiled shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..kernels.mask import AttentionMask
from ..layers.lora import has_bank, select_adapters
from ..models import CausalLM

CHUNK = 256


def score_hidden(
    model: CausalLM, hidden: Float[Array, "n embed"], targets: Int[Array, " n"], *, top_k: int, chunk: int
) -> tuple[Float[Array, " n"], Int[Array, "n k"], Float[Array, "n k"]]:
    """Log-probs of `targets` after each hidden state, and the `top_k` most likely
    tokens with theirs, through the LM head `chunk` rows at a time (`n % chunk == 0`;
    at most one `[chunk, vocab]` float32 tile at a time)."""
    n = hidden.shape[0]
    weight = model.head_weight()

    def one(args):
        h, t = args
        logits = jnp.einsum("cd,vd->cv", h, weight, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0] - lse
        if not top_k:
            return logp, jnp.zeros((h.shape[0], 0), jnp.int32), jnp.zeros((h.shape[0], 0), jnp.float32)
        values, top_ids = jax.lax.top_k(logits, top_k)
        return logp, top_ids.astype(jnp.int32), values - lse[:, None]

    logp, top_ids, top_logp = jax.lax.map(one, (hidden.reshape(n // chunk, chunk, -1), targets.reshape(-1, chunk)))
    return logp.reshape(n), top_ids.reshape(n, top_k), top_logp.reshape(n, top_k)


@functools.partial(jax.jit, static_argnames=("top_k", "compute", "chunk"))
def _scores(model: CausalLM, ids: Int[Array, "1 seq"], length, targets: Int[Array, " n"], starts, *,
            top_k: int, compute: ComputeConfig, chunk: int):
    T = ids.shape[1]
    out = model.hidden_states(ids, positions=jnp.arange(T, dtype=jnp.int32)[None], mask=AttentionMask(length[None], 0),
                              compute=compute)
    hidden = jnp.take(out.hidden[0], starts, axis=0, mode="clip")  # [n, embed]: the positions scored
    return score_hidden(model, hidden, targets, top_k=top_k, chunk=chunk)


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def prompt_scores(
    model: CausalLM,
    prompt: list[int],
    *,
    last_n: int | None = None,
    top_k: int = 0,
    adapter: int | None = None,
    compute: ComputeConfig = ComputeConfig(),
) -> tuple[Float[np.ndarray, " n"], Int[np.ndarray, "n k"], Float[np.ndarray, "n k"]]:
    """Score the prompt's tokens `1 .. len(prompt) - 1` (or its last `last_n`) given
    the tokens before each.

    **Arguments:**

    - `model`: the model (with a LoRA bank: `adapter` names the slot).
    - `prompt`: token ids, at least 2.
    - `last_n`: score only the last `last_n` tokens (default: all but the first).
    - `top_k`: also return the `top_k` most likely tokens at each scored position.
    - `compute`: attention implementation etc.

    **Returns:** `(logprobs [n], top_ids [n, k], top_logprobs [n, k])`, float32 and
    int32 host arrays for the `n` scored tokens in order, under the model's
    unmodified distribution.
    """
    T = len(prompt)
    n = T - 1 if last_n is None else last_n
    if not 1 <= n <= T - 1:
        raise ValueError(f"can score 1 to {T - 1} tokens of a {T}-token prompt, asked for {n}")
    padded = _bucket(T, 16)
    ids = np.zeros((1, padded), np.int32)
    ids[0, :T] = prompt
    chunk = min(CHUNK, _bucket(n, 16))
    rows = _bucket(n, chunk)
    starts = np.full(rows, T - 1, np.int32)  # position t scores token t + 1
    starts[:n] = np.arange(T - 1 - n, T - 1)
    targets = np.zeros(rows, np.int32)
    targets[:n] = prompt[T - n:]
    if has_bank(model):
        model = select_adapters(model, np.asarray([0 if adapter is None else adapter], np.int32))
    logp, top_ids, top_logp = _scores(model, jnp.asarray(ids), jnp.asarray(T, jnp.int32), jnp.asarray(targets),
                                      jnp.asarray(starts), top_k=top_k, compute=compute, chunk=chunk)
    return np.asarray(logp)[:n], np.asarray(top_ids)[:n], np.asarray(top_logp)[:n]
