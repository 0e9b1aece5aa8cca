"""Per-sequence sampling: greedy, temperature, top-k, top-p, a seed per request.

Top-k and top-p never sort the vocabulary (`filter_logits_batch`): an exact
two-stage top-k (`eqx_tx.kernels.topk`, about the cost of an argmax) takes a window
of the largest logits (at least the largest requested `top_k`); the
top-k threshold and, almost always, the top-p threshold are found inside it, and
only when the window's probability mass falls short of `top_p` is the threshold
found by bisection over the float values (33 masked sums over the vocabulary). The
kept set equals the sort-based `filter_logits` (the reference the tests compare with).

A token is drawn by the Gumbel-max rule with noise that is a pure function of the
request's key and the token id (`token_gumbel`), so when every kept token lies in
the window only the window's noise is computed (a few dozen hashes instead of one
per vocabulary entry), and the drawn token is the one the reference draws from the
whole vocabulary with the same key.
"""

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..kernels.topk import argmax
from ..kernels.topk import top_k as window_top_k


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

    def keys(self, index: Int[Array, " batch"]) -> PRNGKeyArray:
        """The key of token `index[b]` of every sequence:
        `fold_in(fold_in(key(seed), sample), index)` (see `SamplingParams.seed`)."""
        return jax.vmap(lambda s, j, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), j), i))(
            self.seed, self.sample, index
        )


def candidate_window(top_k: int, vocab_size: int) -> int:
    """How many of the largest logits the top-k window takes: the largest requested `top_k`
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


class _Window(NamedTuple):
    """What the top-k window of each row says about its top-k/top-p set."""

    x: Float[Array, "batch vocab"]  # the temperature-scaled logits
    values: Float[Array, "batch window"]  # the window's logits, descending (ties included)
    ids: Int[Array, "batch window"]  # their token ids
    kth: Float[Array, " batch"]  # the top-k threshold (meaningless where top_k == 0)
    threshold: Float[Array, " batch"]  # keep x >= threshold (-inf: keep all), exact where `decided`
    short: Bool[Array, " batch"]  # the whole window holds less than top_p of the mass

    @property
    def decided(self) -> Bool[Array, " batch"]:
        """Rows whose threshold lies strictly above the window's smallest value: no
        token outside the window is kept, so the window alone holds the kept set."""
        return self.threshold > self.values[:, -1]


def _window(logits, temperature, top_k, top_p, window: int) -> _Window:
    """The candidates (the `window` largest scaled logits) and the threshold they imply."""
    K = min(window, logits.shape[-1])
    scale = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    x = logits / scale
    # The window of the raw logits, scaled: the same values as the window of `x` (a
    # positive scale keeps the order), without a pass over `x` unless a rare path needs it.
    values, ids = window_top_k(logits, K)
    values = values / scale
    # The barrier keeps XLA from folding the slices below into the top-k, which turns
    # its TopK into a sort on CPU.
    values = jax.lax.optimization_barrier(values)
    use_k, use_p = top_k > 0, top_p < 1.0
    kth = jnp.take_along_axis(values, jnp.clip(top_k - 1, 0, K - 1)[:, None], axis=-1)[:, 0]
    top = values[:, :1]
    mass = jnp.where(~use_k[:, None] | (values >= kth[:, None]), jnp.exp(values - top), 0.0)
    # Top-p normalises over the top-k set: the window's mass when the set lies inside it,
    # else a sum over the vocabulary (only for the rows that need it).
    outside = use_p & ~(use_k & (values[:, -1] < kth))
    total = jax.lax.cond(
        jnp.any(outside),
        lambda: jnp.where(outside, jnp.sum(jnp.where(~use_k[:, None] | (x >= kth[:, None]), jnp.exp(x - top), 0.0), -1),
                          jnp.sum(mass, -1)),
        lambda: jnp.sum(mass, -1),
    )
    probs = mass / total[:, None]
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass above each candidate
    kept = before < top_p[:, None]
    p_threshold = jnp.min(jnp.where(kept, values, jnp.inf), axis=-1)
    threshold = jnp.maximum(jnp.where(use_k, kth, -jnp.inf), jnp.where(use_p, p_threshold, -jnp.inf))
    return _Window(x, values, ids, kth, threshold, jnp.all(kept, axis=-1))


def _filter(w: _Window, top_k, top_p) -> Float[Array, "batch vocab"]:
    """The scaled logits with everything outside each row's kept set at `-inf`; where
    the window's mass falls short of `top_p` before the top-k set ends, the top-p
    threshold is found below the window by bisection."""
    use_k, use_p = top_k > 0, top_p < 1.0
    kept_k = ~use_k[:, None] | (w.x >= w.kth[:, None])
    beyond = w.short & (jnp.sum(kept_k, axis=-1) > w.values.shape[-1]) & use_p

    def below_window(threshold):
        top = w.values[:, :1]
        probs = jnp.where(kept_k, jnp.exp(w.x - top), 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        bisected = _top_p_by_bisection(w.x, probs, top_p, w.values[:, -1])
        return jnp.where(beyond, jnp.maximum(jnp.where(use_k, w.kth, -jnp.inf), bisected), threshold)

    threshold = jax.lax.cond(jnp.any(beyond), below_window, lambda t: t, w.threshold)
    return jnp.where(w.x >= threshold[:, None], w.x, -jnp.inf)


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
    return _filter(_window(logits, temperature, top_k, top_p, window), top_k, top_p)


def token_gumbel(key: PRNGKeyArray, ids: Int[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Standard Gumbel noise for each token id under `key` (a threefry key): a pure
    function of `(key, id)` (one threefry hash of the id), so the noise of a few
    candidates equals their entries in the noise of the whole vocabulary."""
    k0, k1 = jax.random.key_data(key)
    ids = ids.astype(jnp.uint32)
    bits, _ = threefry2x32_p.bind(k0, k1, ids, jnp.zeros_like(ids))
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
    return -jnp.log(-jnp.log(jnp.maximum(u, jnp.finfo(jnp.float32).tiny)))


def _gumbel_max(scores: Float[Array, "batch n"], ids: Int[Array, "batch n"], keys) -> Int[Array, " batch"]:
    """Per row the id maximising `score + token_gumbel(key, id)` (ties: the smallest
    id, whatever the order of `ids`): a draw from `softmax(scores)`."""
    noisy = scores + jax.vmap(token_gumbel)(keys, ids)
    best = jnp.max(noisy, axis=-1, keepdims=True)
    return jnp.min(jnp.where(noisy == best, ids, jnp.iinfo(jnp.int32).max), axis=-1).astype(jnp.int32)


def sample_token(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    key,
) -> Int[Array, ""]:
    """One token: argmax when `temperature == 0`, else a draw from the filtered softmax
    (sorting the vocabulary: the reference for `sample_batch`)."""
    filtered = filter_logits(logits, temperature, top_k, top_p)
    ids = jnp.arange(logits.shape[0], dtype=jnp.int32)
    drawn = _gumbel_max(filtered[None], ids[None], key[None])[0]
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


def _draw_filtered(logits: Float[Array, "batch vocab"], sampler: SamplerArrays, keys) -> Int[Array, " batch"]:
    """Top-k/top-p draws: from the window alone when it decides every sampled row's
    kept set, else from the whole filtered vocabulary."""
    V = logits.shape[-1]
    w = _window(logits, sampler.temperature, sampler.top_k, sampler.top_p, sampler.window)

    def window_only():
        return _gumbel_max(jnp.where(w.values >= w.threshold[:, None], w.values, -jnp.inf), w.ids, keys)

    def whole_vocabulary():
        ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), logits.shape)
        return _gumbel_max(_filter(w, sampler.top_k, sampler.top_p), ids, keys)

    return jax.lax.cond(jnp.all(w.decided | (sampler.temperature <= 0)), window_only, whole_vocabulary)


def sample_batch(
    logits: Float[Array, "batch vocab"], sampler: SamplerArrays, index: Int[Array, " batch"]
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Sample token `index[b]` of every sequence; returns tokens and their log-probabilities
    under the model's unmodified distribution (`log_softmax` of the raw logits).

    The drawn tokens equal `sample_token` on each row with the same key."""
    B, V = logits.shape
    keys = sampler.keys(index)
    sampled = sampler.temperature > 0
    needs_filter = jnp.any(sampled & ((sampler.top_k > 0) | (sampler.top_p < 1.0)))

    def filtered(logits):
        return _draw_filtered(logits, sampler, keys)

    def plain(logits):  # no top-k/top-p anywhere: draw from the whole tempered softmax
        t = jnp.where(sampled, sampler.temperature, 1.0)[:, None]
        return _gumbel_max(logits / t, jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V)), keys)

    most_likely, top = argmax(logits)

    def greedy(logits):  # no draw anywhere: no random numbers over the vocabulary
        return most_likely

    branch = jnp.where(needs_filter, 2, jnp.where(jnp.any(sampled), 1, 0))
    drawn = jax.lax.switch(branch, (greedy, plain, filtered), logits)
    tokens = jnp.where(sampled, drawn, most_likely)
    # log_softmax at the token, reusing the argmax's maximum: one more pass over the vocabulary.
    log_total = top + jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
    logp = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_total
    return tokens, logp
