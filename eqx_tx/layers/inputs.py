"""What every layer of a model call receives besides its hidden states."""

import dataclasses

import equinox as eqx
from jaxtyping import Array, Float, Int

from ..cache.base import AbstractCache
from ..core.compute import ComputeConfig
from ..core.sharding import AnyMesh
from ..kernels.mask import AttentionMask


class LayerInputs(eqx.Module):
    """The per-call inputs of a decoder layer, built once by the model.

    - `positions`: each token's slot in its row (the causal order, the cache slot).
    - `cos`, `sin`: rotary angles of each position (`eqx_tx.layers.rope`).
    - `mask`: which keys each query sees (`eqx_tx.kernels.mask`).
    - `compute`: attention implementation, tile sizes, remat policy.
    - `mesh`: the mesh being run on (`None`: one device); with `sp > 1` and no cache,
      attention runs as a ring over `sp`.
    - `cache`: the cache this layer writes its keys/values into and attention reads
      (`None`: attention over this call's own tokens).
    - `layer`: the index of the layer in the stack (set per layer by `run_stack`).
    """

    positions: Int[Array, "batch seq"]
    cos: Float[Array, "batch seq head_dim"]
    sin: Float[Array, "batch seq head_dim"]
    mask: AttentionMask
    compute: ComputeConfig = eqx.field(static=True)
    mesh: AnyMesh | None = eqx.field(static=True, default=None)
    cache: AbstractCache | None = None
    layer: Int[Array, ""] | None = None

    def at_layer(self, layer: Int[Array, ""], cache: AbstractCache | None) -> "LayerInputs":
        """The inputs of layer `layer`, reading and writing `cache`."""
        return dataclasses.replace(self, layer=layer, cache=cache)
