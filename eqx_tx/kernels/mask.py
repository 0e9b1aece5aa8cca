"""The masking rule every attention kernel takes, and the mask a model passes down.

Key `j` of sequence `b` is visible to query `i` iff

- `j < kv_lengths[b]` (the keys that exist),
- `j <= q_position[b, i]` (causal),
- with segment ids (packed documents: `0` padding, `1..k` documents in order along
  the row): key and query belong to the same document, and it is not padding.

`visible` evaluates the rule on arrays the caller lays out for its own tiles (they
broadcast against each other): the xla, blockwise and paged kernels call it; the
splash kernel, whose mask is static, maps the rule onto a causal mask and segment ids
(`eqx_tx.kernels.splash`); cuDNN onto its causal mask and key lengths.
"""

from typing import Literal

import equinox as eqx
from jaxtyping import Array, Bool, Int


def visible(
    q_pos: Int[Array, "..."] | None,
    k_pos: Int[Array, "..."],
    kv_lengths: Int[Array, "..."],
    *,
    causal: bool = True,
    q_segments: Int[Array, "..."] | None = None,
    k_segments: Int[Array, "..."] | None = None,
    layout: Literal["broadcast", "rows"] = "broadcast",
) -> Bool[Array, "..."]:
    """Whether the key at `k_pos` is visible to the query at `q_pos` (the rule above).

    **Arguments:** positions, key lengths and (optionally) segment ids, laid out by
    `layout`:

    - `"broadcast"`: each already shaped to broadcast against the others, e.g.
      `q_pos [B, T, 1]`, `k_pos [1, 1, S]`, `kv_lengths [B, 1, 1]`;
    - `"rows"`: per row, `q_pos [B, T]`, `k_pos [B, S]`, `kv_lengths [B]`, segments
      `[B, T]` and `[B, S]`; the key-only terms are evaluated per key, then spread
      over the queries (a tile's mask in `eqx_tx.kernels.flash`).

    **Returns:** the boolean mask (`[B, T, S]` for `"rows"`).
    """
    if layout == "rows":
        out = (k_pos < kv_lengths[:, None])[:, None, :]
        if causal:
            assert q_pos is not None, "a causal mask needs the query positions"
            out = out & (k_pos[:, None, :] <= q_pos[:, :, None])
        if q_segments is not None and k_segments is not None:
            out = out & (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments != 0)[:, None, :]
        return out
    out = k_pos < kv_lengths
    if causal:
        assert q_pos is not None, "a causal mask needs the query positions"
        out = out & (k_pos <= q_pos)
    if q_segments is not None and k_segments is not None:
        out = out & (q_segments == k_segments) & (k_segments != 0)
    return out


class AttentionMask(eqx.Module):
    """Which keys each query of a model call sees, by the rule of this module.

    `kv_lengths` bounds the keys; queries are causal from `q_offset` (the Python int
    `0` when queries start at position 0 — training, the first prefill chunk — which
    lets cuDNN and splash run). With `segment_ids` (packed documents, without a
    cache) a key is visible only to queries of its own document.
    """

    kv_lengths: Int[Array, " batch"] | None
    q_offset: int | Int[Array, " batch"] = eqx.field(default=0)
    segment_ids: Int[Array, "batch seq"] | None = None

    @classmethod
    def decode(cls, positions: Int[Array, " batch"]) -> "AttentionMask":
        """One new token per sequence at `positions`: it sees keys `[0, positions]`."""
        return cls(kv_lengths=positions + 1, q_offset=positions)

    @property
    def from_start(self) -> bool:
        """Whether the queries statically start at position 0."""
        return isinstance(self.q_offset, int) and self.q_offset == 0
