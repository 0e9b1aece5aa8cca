"""`Linear` under a mesh (`jax.set_mesh`): a dp-sharded batch and an sp-sharded sequence stay sharded."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqx_tx.core.sharding import make_mesh
from eqx_tx.layers.linear import Linear


def test_projection_keeps_batch_and_sequence_sharded():
    mesh = make_mesh(dp=2, sp=4, tp=1, devices=jax.devices()[:8])
    layer = Linear(64, (4, 16), axes=(None, None, None), key=jax.random.key(0))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (4, 32, 64)), NamedSharding(mesh, P("dp", "sp", None)))
    step = jax.jit(lambda layer, x: layer(x), out_shardings=NamedSharding(mesh, P("dp", "sp", None, None)))
    with jax.set_mesh(mesh):  # as the library runs sharded models
        hlo = step.lower(layer, x).compile().as_text()
    assert hlo is not None
    # Merging [batch, seq] into one axis made GSPMD gather the sequence on every device.
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    expected = jnp.einsum("btd,hkd->bthk", x, layer.weight)
    np.testing.assert_allclose(step(layer, x), expected, rtol=1e-5, atol=1e-5)
