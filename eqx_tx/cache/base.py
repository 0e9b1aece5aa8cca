"""The abstract cache: what every kind of key/value cache offers the attention layer.

A cache kind is an `eqx.Module` subclass of `AbstractCache` (abstract or final, as
Equinox recommends): it stores itself (its `write`), names itself to the one
dispatch that picks an attention kernel (`kind`, read by
`eqx_tx.kernels.dispatch.select_attention`), and runs that kernel over its own
storage (`attend`). The attention layer calls `attend` and knows no kind by name.
"""

import abc
from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Float, Int

from ..core.compute import ComputeConfig
from ..core.sharding import AnyMesh
from ..kernels.dispatch import CacheKind
from ..kernels.mask import AttentionMask


class AbstractCache(eqx.Module):
    """Keys and values of every layer, read and written one layer at a time."""

    # Whether the mask of a model call covers each sequence's own completion slots
    # only (a shared prompt before them is visible whole), not positions from 0.
    masks_completion_only: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def kind(self) -> CacheKind:
        """What `select_attention` is told is being read."""

    @abc.abstractmethod
    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        *,
        layer: Int[Array, ""],
        positions: Int[Array, "batch seq"],
        mask: AttentionMask,
        compute: ComputeConfig,
        mesh: AnyMesh | None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "AbstractCache"]:
        """Write layer `layer`'s new keys/values `k, v` at `positions`, then attend.

        **Arguments:** the rotated queries and new keys/values of one layer, its index,
        the positions of the new tokens, the mask of this call, and how to run.

        **Returns:** the attention output (before the output projection) and the cache
        with the new keys/values written.
        """
