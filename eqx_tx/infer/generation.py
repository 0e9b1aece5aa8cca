"""KV-cached generation: last-token prefill, then a `lax.while_loop` of decode steps.

- **Prefill** runs the (right-padded, ragged) prompts through the scanned model in
  chunks of `prefill_chunk_size` positions, writing the cache, and applies the LM
  head only to each sequence's last real prompt token: no `[batch, seq, vocab]`.
- **Decode** is one jitted function holding a `lax.while_loop` over new tokens that
  stops as soon as every sequence has stopped. The cache is donated into both
  functions and updated in place.

`generate` is `plan_requests` (the sizes of the call), `prefill_state` (the prompts
prefilled into a cache from `cache_for`: the loop's first state), then `decode`; the
pieces are public so that benchmarks can time and analyse the loop alone.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from jaxtyping import Array, Float, Int

from ..cache.allocate import new_cache
from ..cache.base import AbstractCache
from ..cache.dense import KVCache
from ..cache.shared_prefix import SharedPrefixCache
from ..core.compute import ComputeConfig
from ..core.distributed import to_host
from ..core.log import log_once
from ..core.sharding import commit, current_mesh, mesh_context
from ..core.util import ceil_div, length_bucket, round_up
from ..kernels.dispatch import target_platform
from ..kernels.mask import AttentionMask
from ..layers.block import unstack
from ..layers.lora import check_adapter_ids, select_adapters
from ..models import CausalLM
from .sampling import SamplerArrays, SamplingParams, sample_batch
from .steps import STOP_REASONS, Generation, check_requests, decode_one, last_token_logits
from .text import Message, Tokenizer


def cache_multiple() -> int:
    """A dense cache's slots come in whole multiples of this: 128 on a TPU, whose decode
    kernel reads the cache in blocks of 128 tokens (an int8 cache's scales in lane
    tiles of 128 tokens); 16 elsewhere, where attention reads every slot (the xla path)
    and fewer are faster."""
    return 128 if target_platform(current_mesh()) == "tpu" else 16


class DecodeState(eqx.Module):
    """Everything the decode loop carries between steps."""

    cache: AbstractCache
    logits: Float[Array, "batch vocab"]  # next-token logits of each sequence
    lengths: Int[Array, " batch"]  # position of the next token (prompt + generated so far)
    generated: Int[Array, " batch"]  # new tokens produced so far
    done: Int[Array, " batch"]  # 0 running, 1 stop token, 2 length limit
    tokens: Int[Array, "batch max_new"]
    logprobs: Float[Array, "batch max_new"]
    step: Int[Array, ""]


@functools.partial(jax.jit, static_argnames=("chunk", "compute", "full_logits"), donate_argnames="cache")
def prefill(
    model: CausalLM, cache: KVCache, tokens, lengths, *, chunk: int, compute: ComputeConfig, full_logits: bool = False
):
    """Write the prompts' keys/values into `cache`; return it and each last token's logits.

    **Arguments:**

    - `tokens`: right-padded prompts `[batch, T]`, `T` a multiple of `chunk`.
    - `lengths`: prompt lengths `[batch]` (>= 1).
    - `chunk`: positions per prefill step (bounds activation memory).
    - `full_logits`: the naive baseline for benchmarks: apply the LM head to every
      position (`[batch, chunk, vocab]`) and pick the last token's row afterwards.

    **Returns:** the cache and `[batch, vocab]` float32 logits of the token after each prompt.
    """
    B, T = tokens.shape
    if T > cache.max_len:  # (a chunk's rows are written as whole windows: `KVCache.write`)
        raise ValueError(f"prefill of {T} padded positions into a cache of {cache.max_len} slots")
    n_chunks = T // chunk
    D = model.config.hidden_size

    def run_chunk(start, cache, last_hidden):
        ids = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        # q_offset stays the static 0 for the first chunk (cuDNN can run there).
        mask = AttentionMask(lengths, start if isinstance(start, int) else jnp.broadcast_to(start, (B,)))
        out = model.hidden_states(ids, positions=positions, mask=mask, compute=compute, cache=cache)
        assert isinstance(out.cache, KVCache)
        hidden, cache = out.hidden, out.cache
        if full_logits:
            hidden = model.head_logits(hidden)
        # Keep each sequence's last prompt token (hidden state, or logits) if it is in this chunk.
        idx = jnp.clip(lengths - 1 - start, 0, chunk - 1)
        here = ((lengths - 1 - start) >= 0) & ((lengths - 1 - start) < chunk)
        picked = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
        return cache, jnp.where(here[:, None], picked, last_hidden)

    width = model.config.vocab_size if full_logits else D
    last = jnp.zeros((B, width), jnp.float32 if full_logits else model.dtype)
    cache, last = run_chunk(0, cache, last)
    if n_chunks > 1:
        cache, last = jax.lax.fori_loop(1, n_chunks, lambda i, c: run_chunk(i * chunk, *c), (cache, last))
    return cache, (last if full_logits else last_token_logits(model, last))


def _decode_layers(model: CausalLM, compute: ComputeConfig, batch: int) -> CausalLM:
    """`model` with its layer stack as a decode loop of `batch` rows should run it:
    per-layer blocks sliced out once, here (`unstack`), or the stack as it is
    (`ComputeConfig.decode_layers`)."""
    choice = compute.decode_layers
    if choice == "auto":
        platform = target_platform(current_mesh())
        if platform == "tpu":
            choice, why = "unrolled", "a scanned step measured 1.14-1.33x slower on a TPU v5e"
        elif platform == "cpu" and batch > 1:
            choice, why = "unrolled", "XLA:CPU would copy every layer's weights out of the stack on every step"
        else:
            choice, why = "scan", "batch 1 reads the weights in place" if platform == "cpu" else platform
        log_once(f"decode layers: {choice} ({why})")
    if choice == "scan":
        return model
    return eqx.tree_at(lambda m: m.model.layers, model, unstack(model.model.layers))


@functools.partial(jax.jit, static_argnames="compute", donate_argnames="state")
def decode(model: CausalLM, state: DecodeState, sampler: SamplerArrays, num_steps, *, compute: ComputeConfig):
    """Sample up to `num_steps` tokens per sequence, stopping early when all are done.

    Each step samples from `state.logits`, records the token, marks sequences that
    hit a stop token or their `max_new_tokens`, and (while any is running) feeds
    the new tokens through the model at their positions, writing the cache.
    """
    B = state.lengths.shape[0]
    max_new = state.tokens.shape[1]
    stop_at = state.step + num_steps
    model = _decode_layers(model, compute, B)

    def cond(s: DecodeState):
        return (s.step < stop_at) & jnp.any(s.done == 0) & (s.step < max_new)

    def body(s: DecodeState):
        running = s.done == 0
        token, logp = sample_batch(s.logits, sampler, s.generated)
        write = jnp.where(running, s.generated, max_new)  # out of range: dropped
        tokens = s.tokens.at[jnp.arange(B), write].set(token, mode="drop")
        logprobs = s.logprobs.at[jnp.arange(B), write].set(logp, mode="drop")
        generated = s.generated + running
        hit_stop = jnp.any(token[:, None] == sampler.stop_ids, axis=-1)
        done = jnp.where(running & hit_stop, 1, s.done)
        done = jnp.where((done == 0) & (generated >= sampler.max_new), 2, done)
        # A shared-prefix cache masks the sample's own completion slots; the prompt is shared.
        slot = s.generated if s.cache.masks_completion_only else s.lengths
        cache, logits = decode_one(model, s.cache, token, s.lengths, AttentionMask.decode(slot), compute)
        lengths = s.lengths + running
        return DecodeState(cache, logits, lengths, generated, done, tokens, logprobs, s.step + 1)

    return jax.lax.while_loop(cond, body, state)


def cache_for(model: CausalLM, batch: int, max_len: int, dtype) -> KVCache:
    """A zero cache for `model` on the context mesh (`dtype` None: the model's)."""
    return new_cache(model.config, batch, max_len, model.dtype if dtype is None else dtype, mesh=current_mesh())


def _bucket(n: int, multiple: int) -> int:
    """`n` padded to a length bucket (`length_bucket`, four per octave): prompts and
    caches of every length take few shapes, so calls compile few programs, for at most
    25% more slots (on a TPU the decode kernel reads only the live ones)."""
    return length_bucket(n, multiple, per_octave=4)


def _cache_slots(needed: int, tokens: np.ndarray) -> int:
    """A dense cache's slots for `needed` positions: their length bucket, and at least
    the padded prompts `tokens [P, T]` (every prefill chunk lands whole: `KVCache.write`)."""
    return max(_bucket(needed, cache_multiple()), round_up(tokens.shape[1], cache_multiple()))


def _pad_prompts(prompts: Sequence[Sequence[int]], chunk_size: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pad `prompts` to a whole number of prefill chunks.

    **Returns:** `tokens [P, T]`, `lengths [P]` and the chunk size (default: the
    longest prompt's length bucket of 16s, one chunk). `T` is a bucket of chunks.
    """
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    chunk = chunk_size or _bucket(longest, 16)
    tokens = np.zeros((len(prompts), chunk * _bucket(ceil_div(longest, chunk), 1)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths, chunk


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one `generate` call: `P` prompt rows prefilled, `S` sequences decoded."""

    shared: bool  # n samples per prompt read one stored prompt (S = P * n)
    n: int
    tokens: np.ndarray  # [P, T] right-padded prompts
    lengths: np.ndarray  # [P]
    chunk: int
    max_new: int
    cache_len: int  # slots per prompt row (shared: the prompt only)

    @property
    def P(self) -> int:
        return len(self.lengths)

    @property
    def S(self) -> int:
        return self.P * self.n if self.shared else self.P


def plan_requests(prompts, params, n: int, share_prefix: bool,
                  prefill_chunk_size) -> tuple[Plan, list[SamplingParams], list[int]]:
    """Expand the requests for `n` samples and size the caches.

    **Returns:** the plan, the sampling params of each decoded sequence, and which of
    its prompt's `n` samples each one is (its seed stream).
    """
    shared = share_prefix and n > 1
    if n > 1 and not shared:  # the plain path: every sample carries its own copy of the prompt
        prompts = [p for p in prompts for _ in range(n)]
        params = [sp for sp in params for _ in range(n)]
    tokens, lengths, chunk = _pad_prompts(prompts, prefill_chunk_size)
    max_new = max(sp.max_new_tokens for sp in params)
    if shared:
        cache_len = _cache_slots(int(lengths.max()), tokens)
    else:
        cache_len = _cache_slots(max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)), tokens)
    plan = Plan(shared, n, tokens, lengths, chunk, max_new, cache_len)
    sequence_params = [sp for sp in params for _ in range(n)] if shared else params
    samples = list(range(n)) * (plan.S // n)
    return plan, sequence_params, samples


def prefill_state(model: CausalLM, plan: Plan, cache_dtype, compute: ComputeConfig) -> DecodeState:
    """Prefill the prompts and build the decode loop's initial state."""
    cache = cache_for(model, plan.P, plan.cache_len, cache_dtype)
    cache, logits = prefill(model, cache, jnp.asarray(plan.tokens), jnp.asarray(plan.lengths), chunk=plan.chunk,
                            compute=compute)
    lengths = plan.lengths
    if plan.shared:  # the completion caches exist only after prefill: peak = max, not sum
        completion = cache_for(model, plan.S, round_up(plan.max_new, cache_multiple()), cache_dtype)
        cache = SharedPrefixCache(cache, completion, jnp.asarray(plan.lengths))
        logits = jnp.repeat(logits, plan.n, axis=0)
        lengths = np.repeat(lengths, plan.n)
    S = plan.S
    state = DecodeState(
        cache=cache,
        logits=logits,
        lengths=jnp.asarray(lengths),
        generated=jnp.zeros((S,), jnp.int32),
        done=jnp.zeros((S,), jnp.int32),
        tokens=jnp.zeros((S, plan.max_new), jnp.int32),
        logprobs=jnp.zeros((S, plan.max_new), jnp.float32),
        step=jnp.zeros((), jnp.int32),
    )
    return commit(state)  # as the state `decode` returns (every streamed `generate` compiled its loop twice)


def _decode_streaming(model, state: DecodeState, sampler: SamplerArrays, *, compute: ComputeConfig,
                      stream_every: int | None, on_tokens) -> DecodeState:
    """Run the decode loop in segments of `stream_every` steps, reporting new tokens
    after each, until every sequence stopped."""
    S, max_new = state.tokens.shape
    segment = stream_every or max_new
    shown = np.zeros((S,), np.int64)
    while True:
        state = decode(model, state, sampler, jnp.asarray(segment, jnp.int32), compute=compute)
        done = to_host(state.done)
        if on_tokens is not None:
            generated = to_host(state.generated)
            toks = to_host(state.tokens)
            on_tokens([toks[b, shown[b] : generated[b]].tolist() for b in range(S)])
            shown = generated.astype(np.int64)
        if (done != 0).all() or int(to_host(state.step)) >= max_new:
            return state


def _results(state: DecodeState) -> list[Generation]:
    generated = to_host(state.generated)
    toks, logps, done = to_host(state.tokens), to_host(state.logprobs), to_host(state.done)
    return [
        Generation(toks[b, : generated[b]].tolist(), logps[b, : generated[b]].tolist(), STOP_REASONS[done[b]])
        for b in range(len(generated))
    ]


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    n: int = 1,
    share_prefix: bool = True,
    prefill_chunk_size: int | None = None,
    cache_dtype=None,
    compute: ComputeConfig = ComputeConfig(),
    stream_every: int | None = None,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    adapters: Sequence[int] | None = None,
) -> list[Generation]:
    """Sample continuations of a batch of prompts.

    **Arguments:**

    - `model`: the model (possibly sharded; its mesh is used).
    - `prompts`: token-id lists, of any (different) lengths >= 1.
    - `params`: one `SamplingParams` for all prompts, or one per prompt.
    - `n`: samples per prompt; sample `j` has its own seed stream (see `SamplingParams.seed`).
    - `share_prefix`: with `n > 1`, prefill each prompt once and store its keys/values
      once for its `n` samples (exact: the attention parts are merged by their
      log-sum-exp); `False` repeats the prompt `n` times instead (same results).
    - `prefill_chunk_size`: prefill this many positions at a time (default: all at once).
    - `cache_dtype`: KV-cache dtype (default: the model's dtype); `"int8"` stores int8
      values with a float32 scale per token and head.
    - `compute`: attention implementation etc.
    - `stream_every`, `on_tokens`: call `on_tokens(new tokens per sequence)` every
      `stream_every` decode steps (the decode loop runs in segments between calls).
    - `adapters`: for a model with a LoRA bank, the adapter of each prompt (its `n`
      samples use it too).

    **Returns:** `len(prompts) * n` `Generation`s, prompt-major: sample `j` of prompt
    `i` is at index `i * n + j`.
    """
    config = model.config
    prompts, params = check_requests(config, prompts, params, n, prefill_chunk_size)
    plan, sequence_params, samples = plan_requests(prompts, params, n, share_prefix, prefill_chunk_size)
    sampler = SamplerArrays.from_params(sequence_params, config.eos_token_ids, config.vocab_size, samples)
    ids = None if adapters is None else np.asarray(adapters, np.int32)
    check_adapter_ids(model, ids, len(prompts), name="adapters")
    prefill_model = decode_model = model
    if ids is not None:  # prefill rows: prompts (or n copies of each); decode rows: n samples of each prompt
        prefill_model = select_adapters(model, ids if plan.shared else np.repeat(ids, plan.P // len(prompts)))
        decode_model = select_adapters(model, np.repeat(ids, plan.S // len(prompts)))
    with mesh_context(model):
        state = prefill_state(prefill_model, plan, cache_dtype, compute)
        state = _decode_streaming(decode_model, state, sampler, compute=compute, stream_every=stream_every,
                                  on_tokens=on_tokens)
    return _results(state)


def generate_text(
    model: CausalLM,
    tokenizer: Tokenizer | tokenizers.Tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[Message]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    chat: bool = False,
    chat_kwargs: dict | None = None,
    **kwargs,
) -> list[str]:
    """`generate` on text.

    **Arguments:**

    - `model`: the model.
    - `tokenizer`: the checkpoint's `eqx_tx.infer.text.Tokenizer` (`eqx_tx.load_tokenizer`),
      or a bare `tokenizers.Tokenizer`.
    - `prompts`: texts; with `chat=True`, chats (lists of `{"role", "content"}`
      messages) or texts (each one user message), rendered with the chat template
      and an assistant turn opened.
    - `params`: default: the checkpoint's `generation_config.json` defaults (see
      `eqx_tx.infer.text.sampling_defaults`), else greedy.
    - `chat_kwargs`: extra chat-template variables (e.g. `{"enable_thinking": False}`).
    - `kwargs`: as `generate`.

    **Returns:** the completions' text; the stop token is dropped.
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer(tokenizer)
    if params is None:
        params = tokenizer.sampling_defaults() or SamplingParams()
    if not chat and not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be strings (pass chat=True for lists of messages)")
    ids = [tokenizer.encode_prompt(p, chat=chat, **(chat_kwargs or {})) for p in prompts]
    results = generate(model, ids, params, **kwargs)
    texts = []
    for r in results:
        toks = r.tokens[:-1] if r.stop_reason == "stop" else r.tokens
        texts.append(tokenizer.decode(toks))
    return texts


@functools.partial(jax.jit, static_argnames=("chunk", "compute"))
def _teacher_forced(model: CausalLM, cache, tokens, lengths, continuation, *, chunk: int, compute: ComputeConfig):
    cache, logits = prefill(model, cache, tokens, lengths, chunk=chunk, compute=compute)
    model = _decode_layers(model, compute, tokens.shape[0])

    def step(carry, token):
        cache, position = carry
        cache, logits = decode_one(model, cache, token, position, AttentionMask.decode(position), compute)
        return (cache, position + 1), logits

    _, rest = jax.lax.scan(step, (cache, lengths), continuation.T[:-1])
    return jnp.concatenate([logits[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)


def teacher_forced_logits(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    cache_dtype=None,
    prefill_chunk_size: int | None = None,
    compute: ComputeConfig = ComputeConfig(),
) -> Float[Array, "batch steps vocab"]:
    """The decode path's logits before each continuation token, feeding the given
    tokens instead of sampling (for measuring cache quantization; `[batch, steps,
    vocab]` float32, so for small vocabularies and step counts).

    Continuations must all have the same length `steps`."""
    steps = {len(c) for c in continuations}
    if len(steps) != 1 or len(continuations) != len(prompts):
        raise ValueError("one continuation per prompt, all of the same length")
    steps = steps.pop()
    tokens, lengths, chunk = _pad_prompts(prompts, prefill_chunk_size)
    with mesh_context(model):
        cache = cache_for(model, len(prompts), _cache_slots(int(lengths.max()) + steps, tokens), cache_dtype)
        return _teacher_forced(model, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                               jnp.asarray(continuations, jnp.int32), chunk=chunk, compute=compute)
