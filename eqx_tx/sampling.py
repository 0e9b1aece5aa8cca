"""Per-sequence sampling: greedy, temperature, top-k, top-p, a seed per request.

Top-k and top-p never sort the vocabulary (`filter_logits_batch`): `lax.top_k`
takes a window of the largest logits (at least the largest requested `top_k`); the
top-k threshold and, almost always, the top-p threshold are found inside it, and
only when the window's probability mass falls short of `top_p` is the threshold
found by bisection over the float values (33 masked sums over the vocabulary). The
kept set equals the sort-based `filter_logits` (the reference the tests compare with).
"""

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
    window: int = eqx.field(static=True, default=64)  # candidates for top-k/top-p (>= every top_k)

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
            window=candidate_window(max(p.top_k for p in params), vocab_size),
        )


def candidate_window(top_k: int, vocab_size: int) -> int:
    """How many of the largest logits `lax.top_k` takes: the largest requested `top_k`
    rounded up to a power of two, at least 64 (so nothing recompiles for small
    changes), at most the vocabulary."""
    return min(vocab_size, max(64, 1 << max(top_k - 1, 0).bit_length()))


def filter_logits(
    logits: Float[Array, " vocab"], temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""]
) -> Float[Array, " vocab"]:
    """Temperature, then top-k, then top-p, as masks to `-inf` (one sequence), by
    sorting the vocabulary: the reference for `filter_logits_batch`."""
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


def _ordered(x: Float[Array, "*shape"]) -> Int[Array, "*shape"]:
    """float32 -> int32 keys in the same order (-0.0 and 0.0 alike)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i >= 0, i, -(i & 0x7FFFFFFF))


def _from_ordered(key: Int[Array, "*shape"]) -> Float[Array, "*shape"]:
    bits = jnp.where(key >= 0, key, (-key) | jnp.int32(-(2**31)))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _top_p_by_bisection(x, probs, top_p, hi_value):
    """Per row the smallest logit `v` whose strictly larger logits hold less than
    `top_p` of the mass, known to be at most `hi_value`: a binary search over the
    float32 keys (33 steps cover them all); each step is one masked sum."""
    lo = jnp.full(hi_value.shape, _ordered(jnp.float32(-jnp.inf)) - 1, jnp.int32)
    hi = _ordered(hi_value)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        above = jnp.sum(jnp.where(x > _from_ordered(mid)[:, None], probs, 0.0), axis=-1)
        ok = above < top_p
        moved = mid != lo  # else converged: hi = lo + 1
        return jnp.where(ok | ~moved, lo, mid), jnp.where(ok & moved, mid, hi)

    _, hi = jax.lax.fori_loop(0, 33, step, (lo, hi))
    return _from_ordered(hi)


def filter_logits_batch(
    logits: Float[Array, "batch vocab"],
    temperature: Float[Array, " batch"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
    *,
    window: int,
) -> Float[Array, "batch vocab"]:
    """`filter_logits` for every row, without sorting the vocabulary.

    **Arguments:** per-row settings as `SamplingParams`; `window` (static): how many
    of the largest logits to take as candidates, at least the largest `top_k`.

    **Returns:** the temperature-scaled logits with the filtered-out ones at `-inf`.
    """
    B, V = logits.shape
    K = min(window, V)
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # [B, K], descending, ties included. The barrier keeps XLA from folding the slices
    # below into the top-k, which turns its TopK into a sort of the whole vocabulary on CPU.
    values = jax.lax.optimization_barrier(jax.lax.top_k(x, K)[0])
    use_k = top_k > 0
    kth = jnp.take_along_axis(values, jnp.clip(top_k - 1, 0, K - 1)[:, None], axis=-1)  # [B, 1]
    kept_k = ~use_k[:, None] | (x >= kth)
    # Probabilities over the top-k set (normalised by `total`), the candidates' in descending order.
    top = values[:, :1]

    def unnormalised():
        return jnp.where(kept_k, jnp.exp(x - top), 0.0)

    total = jnp.sum(unnormalised(), axis=-1, keepdims=True)
    cand = jnp.where(~use_k[:, None] | (values >= kth), jnp.exp(values - top), 0.0) / total
    before = jnp.cumsum(cand, axis=-1) - cand  # the mass above each candidate
    kept_c = before < top_p[:, None]
    threshold = jnp.min(jnp.where(kept_c, values, jnp.inf), axis=-1)
    # The threshold lies below the window when the window is all kept and the top-k
    # set reaches past it.
    beyond = jnp.all(kept_c, axis=-1) & (jnp.sum(kept_k, axis=-1) > K) & (top_p < 1.0)
    threshold = jax.lax.cond(
        jnp.any(beyond),
        lambda t: jnp.where(beyond, _top_p_by_bisection(x, unnormalised() / total, top_p, values[:, -1]), t),
        lambda t: t,
        threshold,
    )
    keep = kept_k & (~(top_p < 1.0)[:, None] | (x >= threshold[:, None]))
    return jnp.where(keep, x, -jnp.inf)


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
    needs_filter = jnp.any((sampler.temperature > 0) & ((sampler.top_k > 0) | (sampler.top_p < 1.0)))

    def full(logits):
        filtered = filter_logits_batch(logits, sampler.temperature, sampler.top_k, sampler.top_p,
                                       window=sampler.window)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered)
        return jnp.where(sampler.temperature > 0, drawn, jnp.argmax(logits, -1)).astype(jnp.int32)

    def plain(logits):  # no top-k/top-p anywhere: no filter
        t = jnp.where(sampler.temperature > 0, sampler.temperature, 1.0)[:, None]
        drawn = jax.vmap(jax.random.categorical)(keys, logits / t)
        return jnp.where(sampler.temperature > 0, drawn, jnp.argmax(logits, -1)).astype(jnp.int32)

    def greedy(logits):  # no draw anywhere: no random numbers over the vocabulary
        return jnp.argmax(logits, -1).astype(jnp.int32)

    sampled = jnp.any(sampler.temperature > 0)
    branch = jnp.where(needs_filter, 2, jnp.where(sampled, 1, 0))
    tokens = jax.lax.switch(branch, (greedy, plain, full), logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
