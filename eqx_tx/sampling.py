"""Per-sequence sampling: greedy, temperature, top-k, top-p, a seed per request."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    **Arguments:**

    - `max_new_tokens`: stop after this many new tokens (stop reason `"length"`).
    - `temperature`: `0` is greedy; otherwise logits are divided by it.
    - `top_k`: keep the `k` most likely tokens (`0`: all).
    - `top_p`: keep the smallest set of most likely tokens whose probability reaches
      `p` (`1.0`: all). Applied after top-k, as Hugging Face does.
    - `seed`: the request's random seed. Token `i` of sample `j` (of `n`) is drawn
      with `fold_in(fold_in(key(seed), j), i)`, so the output does not depend on the
      batch, and each of the `n` samples has its own stream.
    - `stop_token_ids`: stop after producing any of these (stop reason `"stop"`);
      `None` uses the model's `eos_token_id`.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


class SamplerArrays(eqx.Module):
    """`SamplingParams` of a batch as arrays (one row per sequence)."""

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    seed: Int[Array, " batch"]
    sample: Int[Array, " batch"]  # which of a request's n samples (its own seed stream)
    max_new: Int[Array, " batch"]
    stop_ids: Int[Array, "batch n_stop"]  # padded with -1

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], default_stop: tuple[int, ...], vocab_size: int, samples=None
    ):
        stops = [p.stop_token_ids if p.stop_token_ids is not None else default_stop for p in params]
        width = max(1, max(len(s) for s in stops))
        for stop in stops:
            for t in stop:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop token id {t} is outside the vocabulary (size {vocab_size})")
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([min(p.top_k, vocab_size) for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            seed=jnp.asarray([p.seed for p in params], jnp.uint32),
            sample=jnp.asarray(samples if samples is not None else [0] * len(params), jnp.uint32),
            max_new=jnp.asarray([p.max_new_tokens for p in params], jnp.int32),
            stop_ids=jnp.asarray([list(s) + [-1] * (width - len(s)) for s in stops], jnp.int32),
        )


def filter_logits(
    logits: Float[Array, " vocab"], temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""]
) -> Float[Array, " vocab"]:
    """Temperature, then top-k, then top-p, as masks to `-inf` (one sequence)."""
    logits = logits / jnp.where(temperature > 0, temperature, 1.0)
    sorted_desc = jnp.sort(logits)[::-1]
    kth = sorted_desc[jnp.clip(top_k - 1, 0, logits.shape[0] - 1)]
    logits = jnp.where((top_k > 0) & (logits < kth), -jnp.inf, logits)
    sorted_desc = jnp.where((top_k > 0) & (sorted_desc < kth), -jnp.inf, sorted_desc)
    probs = jax.nn.softmax(sorted_desc)
    before = jnp.cumsum(probs) - probs  # mass strictly above each sorted token
    keep = before < top_p
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf))
    return jnp.where((top_p < 1.0) & (logits < threshold), -jnp.inf, logits)


def sample_token(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    key,
) -> Int[Array, ""]:
    """One token: argmax when `temperature == 0`, else a draw from the filtered softmax."""
    filtered = filter_logits(logits, temperature, top_k, top_p)
    drawn = jax.random.categorical(key, filtered)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


def sample_batch(
    logits: Float[Array, "batch vocab"], sampler: SamplerArrays, index: Int[Array, " batch"]
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Sample token `index[b]` of every sequence; returns tokens and their log-probabilities
    under the model's unmodified distribution (`log_softmax` of the raw logits)."""
    keys = jax.vmap(lambda s, j, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), j), i))(
        sampler.seed, sampler.sample, index
    )
    needs_sort = jnp.any((sampler.temperature > 0) & ((sampler.top_k > 0) | (sampler.top_p < 1.0)))

    def full(logits):
        return jax.vmap(sample_token)(logits, sampler.temperature, sampler.top_k, sampler.top_p, keys)

    def plain(logits):  # no top-k/top-p anywhere: skip the sort over the vocabulary
        t = jnp.where(sampler.temperature > 0, sampler.temperature, 1.0)[:, None]
        drawn = jax.vmap(jax.random.categorical)(keys, logits / t)
        return jnp.where(sampler.temperature > 0, drawn, jnp.argmax(logits, -1)).astype(jnp.int32)

    tokens = jax.lax.cond(needs_sort, full, plain, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
