"""The steps that `generate` and the engine share, and what a request is checked
against and returns.

- `check_requests`: validate prompts and sampling params against a model.
- `last_token_logits`, `decode_one`: the LM head on one hidden vector per sequence,
  and one decoded token per sequence through the model and its cache.
- `paged_prefill_chunk`, `paged_decode_step`: the engine's two jitted steps over a
  page pool (`eqx_tx.cache.paged`), each on the rows a scheduler planned, and
  `paged_mixed_step`, both in one pass through the model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..cache.base import AbstractCache
from ..cache.paged import PagedKVCache
from ..core.compute import ComputeConfig
from ..core.ragged import join_tokens, split_tokens
from ..core.sharding import constrain
from ..kernels.mask import AttentionMask
from ..layers.lora import select_adapters
from ..models import CausalLM
from .prompt_scores import CHUNK as SCORE_CHUNK
from .prompt_scores import score_hidden
from .sampling import SamplerArrays, SamplingParams, sample_batch

STOP_REASONS = ("running", "stop", "length")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One request's result: new tokens (the stop token included), their
    log-probabilities under the model, and why it stopped (`"stop"` or `"length"`)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    prompt_scores: "PromptScores | None" = None  # asked for with the request (`Engine.add(score_last_n=...)`)


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """The last `n` prompt tokens' log-probs given the tokens before each, and the
    `k` most likely tokens at each of those positions with their log-probs (host
    arrays, `[n]`, `[n, k]`, `[n, k]`; under the model's unmodified distribution)."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def check_requests(config, prompts, params, n: int, prefill_chunk_size) -> tuple[list[list[int]], list[SamplingParams]]:
    """Validate the requests; returns the prompts as int lists and one `SamplingParams` each."""
    if not prompts:
        raise ValueError("no prompts")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
    prompts = [list(map(int, p)) for p in prompts]
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    limit = None if config.rope.extends_past_max_position else config.max_position_embeddings
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if limit is not None and len(p) > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_position_embeddings {limit}")
        if limit is not None and len(p) + sp.max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {sp.max_new_tokens} exceeds "
                f"max_position_embeddings {limit}"
            )
        if min(p) < 0 or max(p) >= config.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size})")
    return prompts, params


def last_token_logits(model: CausalLM, hidden_bd):
    """LM head on one hidden vector per sequence: `[batch, vocab]`, float32 (last-token prefill and decode)."""
    return constrain(model.head_logits(hidden_bd), ("batch", "act_vocab"))


def decode_one(model: CausalLM, cache: AbstractCache, token, positions, mask: AttentionMask, compute: ComputeConfig):
    """Feed one token per sequence at `positions`; returns the cache and the next logits."""
    out = model.hidden_states(token[:, None], positions=positions[:, None], mask=mask, compute=compute, cache=cache)
    assert out.cache is not None
    return out.cache, last_token_logits(model, out.hidden[:, 0])


@functools.partial(jax.jit, static_argnames=("compute", "top_k"), donate_argnames=("cache", "logits"))
def paged_prefill_chunk(model: CausalLM, cache: PagedKVCache, logits, rows, table, tokens, start, length, adapters,
                        targets=None, *, compute: ComputeConfig, top_k: int = 0):
    """Positions `[start[i], start[i] + C)` of `P` contexts (`tokens [P, C]`, real up to
    `length[i]`) into their pages (`table [P, pages_per_seq]`; padding rows: unallocated).
    Each context's next-token logits go to slot `rows[i]` (out of range: dropped, for
    padding and contexts that do not end in this chunk). `adapters [P]`: each context's
    adapter of the model's LoRA bank (`None` without one).

    With `targets [P, C]` (the token each position is scored on), also returns each
    position's log-prob of its target and its `top_k` most likely tokens with their
    log-probs (`[P, C]`, `[P, C, top_k]` twice), through the LM head in chunks of
    positions (never `[P, C, vocab]` logits); else `None`."""
    if adapters is not None:
        model = select_adapters(model, adapters)
    C = tokens.shape[1]
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    mask = AttentionMask(kv_lengths=length, q_offset=start)
    out = model.hidden_states(tokens, positions=positions, mask=mask, compute=compute, cache=cache.with_table(table))
    assert isinstance(out.cache, PagedKVCache)
    logits = logits.at[rows].set(last_token_logits(model, _chunk_last(out.hidden, start, length)), mode="drop")
    return out.cache.with_table(cache.page_table), logits, _chunk_scores(model, out.hidden, targets, top_k)


@functools.partial(jax.jit, static_argnums=(0, 1))
def zero_logits(rows: int, vocab: int):
    return constrain(jnp.zeros((rows, vocab), jnp.float32), (None, "act_vocab"))


@functools.partial(jax.jit, static_argnames=("compute", "top_logprobs", "share_rows"),
                   donate_argnames=("cache", "logits"))
def paged_decode_step(model: CausalLM, cache: PagedKVCache, logits, rows, table, positions, generated, adapters,
                      sampler: SamplerArrays, *, compute: ComputeConfig, top_logprobs: int = 0, share_rows: int = 0):
    """For the slots `rows [R]` (padding: an out-of-range slot): sample token
    `generated[i]` from the slot's logits, feed it at `positions[i]` through the
    slot's pages `table [R, pages_per_seq]` (padding rows: unallocated, their writes
    dropped) with adapter `adapters[i]` (`None`: no bank) and store the next logits.
    Returns the tokens and their log-probs, and with `top_logprobs = k > 0` the `k`
    most likely tokens of each row and their log-probs (`[R, k]` each; else `None`),
    all under the model's unmodified distribution. `share_rows > 1`: the rows are in
    runs of that many that may share leading pages (`PagedKVCache.share_rows`)."""
    if adapters is not None:
        model = select_adapters(model, adapters)
    token, logp, top_ids, top_logp = _sample_rows(logits, rows, sampler, generated, top_logprobs)
    out, new = decode_one(model, cache.with_table(table, share_rows=share_rows), token, positions,
                          AttentionMask.decode(positions), compute)
    assert isinstance(out, PagedKVCache)
    return out.with_table(cache.page_table), logits.at[rows].set(new, mode="drop"), token, logp, top_ids, top_logp


@functools.partial(jax.jit, static_argnames=("compute", "top_k", "top_logprobs"), donate_argnames=("cache", "logits"))
def paged_mixed_step(model: CausalLM, cache: PagedKVCache, logits, prefill: tuple, decode: tuple, adapters,
                     sampler: SamplerArrays, targets=None, *, compute: ComputeConfig, top_k: int = 0,
                     top_logprobs: int = 0):
    """`paged_prefill_chunk` and `paged_decode_step` in one pass through the model: the
    prefill chunk's `P x C` tokens and the decode rows' `R` sampled tokens are laid out
    as one row (`eqx_tx.core.ragged`), so the weights are read once; attention and
    LoRA adapters run per group of rows. The decode rows sample from the logits as
    they were before this step (a context whose prefill ends here samples next step).

    **Arguments:** `prefill = (rows, table, tokens, start, length)` and `decode = (rows,
    table, positions, generated)`, as the two steps take them; `adapters`: `[P + R]`
    (prefill rows first; `None` without a bank); `sampler`, `targets`, `top_k` and
    `top_logprobs` as the two steps.

    **Returns:** the pool, the logits, the decode rows' tokens, log-probs and
    alternatives (as `paged_decode_step`), and the prefill's scores (as
    `paged_prefill_chunk`)."""
    p_rows, p_table, tokens, start, length = prefill
    d_rows, d_table, d_positions, generated = decode
    (P, C), R = tokens.shape, d_rows.shape[0]
    groups = ((P, C), (R, 1))
    if adapters is not None:
        model = select_adapters(model, adapters, groups=groups)
    token, logp, top_ids, top_logp = _sample_rows(logits, d_rows, sampler, generated, top_logprobs)
    p_positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    ids = join_tokens([tokens, token[:, None]])
    positions = join_tokens([p_positions, d_positions[:, None]])
    mask = AttentionMask(kv_lengths=jnp.concatenate([length, d_positions + 1]),
                         q_offset=jnp.concatenate([start, d_positions]))
    table = jnp.concatenate([p_table, d_table])
    out = model.hidden_states(ids, positions=positions, mask=mask, compute=compute,
                              cache=cache.with_table(table, groups))
    assert isinstance(out.cache, PagedKVCache)
    p_hidden, d_hidden = split_tokens(out.hidden, groups)
    new = last_token_logits(model, jnp.concatenate([_chunk_last(p_hidden, start, length), d_hidden[:, 0]]))
    logits = logits.at[jnp.concatenate([p_rows, d_rows])].set(new, mode="drop")
    scores = _chunk_scores(model, p_hidden, targets, top_k)
    return out.cache.with_table(cache.page_table), logits, token, logp, top_ids, top_logp, scores


def _sample_rows(logits, rows, sampler: SamplerArrays, generated, top_logprobs: int):
    """Token `generated[i]` of slot `rows[i]` sampled from its logits, its log-prob, and
    its `top_logprobs` most likely alternatives (`None` twice for 0)."""
    row_logits = jnp.take(logits, rows, axis=0, mode="clip")
    token, logp = sample_batch(row_logits, sampler, generated)
    if not top_logprobs:
        return token, logp, None, None
    top_values, top_ids = jax.lax.top_k(row_logits, top_logprobs)
    return token, logp, top_ids, top_values - jax.nn.logsumexp(row_logits, axis=-1, keepdims=True)


def _chunk_last(hidden, start, length):
    """`[P, D]`: each context's hidden vector at its last position, if it is in this
    chunk of `C` positions from `start` (else clipped into the chunk; its logits are dropped)."""
    C = hidden.shape[1]
    return jnp.take_along_axis(hidden, jnp.clip(length - 1 - start, 0, C - 1)[:, None, None], axis=1)[:, 0]


def _chunk_scores(model: CausalLM, hidden, targets, top_k: int):
    """Each position's log-prob of `targets [P, C]` and its `top_k` alternatives, through
    the LM head in chunks of positions (`None` without targets)."""
    if targets is None:
        return None
    P, C = targets.shape
    logp, top_ids, top_logp = score_hidden(model, hidden.reshape(P * C, -1), jnp.maximum(targets, 0).reshape(-1),
                                           top_k=top_k, chunk=min(P * C, SCORE_CHUNK))
    return logp.reshape(P, C), top_ids.reshape(P, C, top_k), top_logp.reshape(P, C, top_k)
