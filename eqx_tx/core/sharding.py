"""One table of sharding rules and the one place the device mesh is built.

Every weight declares the *logical* name of each of its axes next to its shape
(see `eqx_tx.layers.linear.Linear.axes`); activations are constrained with logical
names too. The leading axes of stacked modules (the decoder's layers, an MoE
layer's experts) are named by the field that holds them (`eqx_tx.core.tree.stacked`).
`RULES` maps logical names to mesh axes, and `logical_to_spec` turns a tuple of
logical names into a `PartitionSpec`, refusing a name with no rule and two logical
axes on one mesh axis, and leaving a dimension unsharded (logged once) when it does
not divide.

The mesh has the axes `("dp", "ep", "sp", "tp")`: data parallel, expert parallel
(MoE experts split over it; the batch too, outside the experts), sequence/context
parallel, tensor parallel. Functions that run the model pick the mesh up from
JAX's context (`jax.set_mesh`) once, in `CausalLM.hidden_states`, and pass it down,
so the model itself holds only arrays.
"""

import abc
import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .log import log_once
from .tree import stacking_along

MESH_AXES = ("dp", "ep", "sp", "tp")

MeshAxes = str | tuple[str, ...] | None
AnyMesh = Mesh | AbstractMesh

# logical axis -> mesh axis (or axes; None: replicated). Every logical name used by a
# weight or an activation is listed: an unknown name is an error, not a replica.
RULES: Mapping[str, MeshAxes] = {
    # weights (Megatron layout: column-parallel in, row-parallel out)
    "layers": None,
    "vocab": "tp",
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    "lora_rank": None,
    "adapters": None,  # a LoRA bank's adapter slots (replicated: each row may use any)
    "experts": "ep",
    "router": None,
    # activations
    "batch": ("dp", "ep"),
    "seq": "sp",
    # Sequence parallelism: between blocks (norms, residual adds, the saved carry) the
    # sequence is also split over the tensor-parallel devices.
    "seq_parallel": ("sp", "tp"),
    "act_embed": None,
    "act_heads": "tp",
    "act_kv_heads": "tp",
    "act_mlp": "tp",
    "act_vocab": "tp",
    "cache_batch": ("dp", "ep"),
    "cache_seq": None,
    "cache_kv_heads": "tp",
    # a paged cache's pool and page tables (`eqx_tx.cache.paged`)
    "cache_pages": None,
    "cache_table": None,
}


@dataclasses.dataclass(frozen=True)
class Axes:
    """The logical axis names of one array (a pytree leaf)."""

    names: tuple[str | None, ...]


def make_mesh(
    *, dp: int = -1, sp: int = 1, tp: int = 1, ep: int = 1, devices: Sequence | None = None
) -> Mesh:
    """Build the `("dp", "ep", "sp", "tp")` device mesh.

    **Arguments:**

    - `dp`, `ep`, `sp`, `tp`: axis sizes; `dp=-1` takes all remaining devices.
    - `devices`: the devices to use (default: `jax.devices()`). Consecutive devices go
      to `tp` first, so a tensor-parallel group stays inside a host.

    **Returns:** a `jax.sharding.Mesh` with automatic (GSPMD) axis types.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    inner = ep * sp * tp
    platform = devices[0].platform if devices else "?"
    more = (f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={inner * max(dp, 1)} before JAX "
            "starts gives that many devices)" if platform == "cpu" else "")
    if dp == -1:
        if n % inner:
            raise ValueError(f"{n} {platform} device(s) are not divisible by ep*sp*tp = {ep}*{sp}*{tp}{more}")
        dp = n // inner
    if dp * inner != n:
        raise ValueError(f"mesh dp*ep*sp*tp = {dp}*{ep}*{sp}*{tp} = {dp * inner} != {n} {platform} device(s){more}")
    grid = np.asarray(devices, dtype=object).reshape(dp, ep, sp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_axis_size(mesh: AnyMesh | None, mesh_axes: MeshAxes) -> int:
    """The number of devices along `mesh_axes` (1 without a mesh or for an axis it lacks)."""
    if mesh is None or mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    return math.prod(mesh.shape.get(a, 1) for a in names)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh,
    rules: Mapping[str, MeshAxes] = RULES,
) -> P:
    """Resolve logical axis names to a `PartitionSpec` on `mesh`.

    A dimension whose size does not divide by its mesh axes is left unsharded
    (logged once); a logical name missing from `rules` and two dimensions mapped to
    the same mesh axis are errors.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    unknown = [n for n in names if n is not None and n not in rules]
    if unknown:
        raise KeyError(f"logical axis name(s) {unknown} in {tuple(names)} have no sharding rule; "
                       f"known: {', '.join(sorted(rules))}")
    used: set[str] = set()
    spec = []
    for name, size in zip(names, shape):
        mesh_axes = rules[name] if name is not None else None
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        if mesh_axes is not None:
            mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1)
        if not mesh_axes:
            spec.append(None)
            continue
        if used.intersection(mesh_axes):
            raise ValueError(
                f"logical axes {tuple(names)}: mesh axis {mesh_axes} used twice in one array"
            )
        n = mesh_axis_size(mesh, mesh_axes)
        if size % n:
            log_once(
                f"sharding: '{name}' of size {size} does not divide over mesh axes "
                f"{mesh_axes} (size {n}); it stays replicated"
            )
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*spec)


class HasAxes(eqx.Module):
    """A module owning parameter arrays, each with declared logical axes."""

    @abc.abstractmethod
    def param_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Map each array field's name to its logical axes, without the leading axes
        of the stacked fields the module sits in (those are added by `logical_axes`)."""


def logical_axes(tree) -> object:
    """Replace every array in `tree` with its `Axes`.

    Arrays with more dimensions than their module declares get one leading axis per
    stacked field (`eqx_tx.core.tree.stacked`) they sit in, outermost first.
    """

    def visit(path, node):
        if not isinstance(node, HasAxes):
            if eqx.is_array(node) or isinstance(node, jax.ShapeDtypeStruct):
                raise ValueError(f"array of shape {node.shape} is not owned by a HasAxes module")
            return node
        declared = node.param_axes()
        fields = [k for k, v in declared.items() if getattr(node, k) is not None]
        if not fields:
            return node
        leading = tuple(axis for _, axis in stacking_along(tree, path))
        leaves = []
        for k in fields:
            arr = getattr(node, k)
            if arr.ndim != len(leading) + len(declared[k]):
                raise ValueError(f"{type(node).__name__}.{k}: shape {arr.shape} does not match its axes "
                                 f"{declared[k]} under the stacked axes {leading}")
            leaves.append(Axes(leading + tuple(declared[k])))
        return eqx.tree_at(lambda m: [getattr(m, k) for k in fields], node, leaves)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=lambda x: isinstance(x, HasAxes))


def tree_shardings(tree, mesh: AnyMesh, rules: Mapping[str, MeshAxes] = RULES):
    """The `NamedSharding` of every array in `tree` (arrays or `ShapeDtypeStruct`s)."""
    axes = logical_axes(tree)
    return jax.tree.map(
        lambda ax, x: NamedSharding(mesh, logical_to_spec(ax.names, x.shape, mesh, rules)),
        axes,
        tree,
        is_leaf=lambda x: isinstance(x, Axes),
    )


def abstract_with_shardings(tree, mesh: AnyMesh, rules: Mapping[str, MeshAxes] = RULES):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s carrying their rule-given shardings."""
    shardings = tree_shardings(tree, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def shard(tree, mesh: Mesh, rules: Mapping[str, MeshAxes] = RULES):
    """Place every array of `tree` on `mesh` as the rules say."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    shardings = tree_shardings(arrays, mesh, rules)
    return eqx.combine(jax.device_put(arrays, shardings), static)


def current_mesh():
    """The mesh set with `jax.set_mesh`, or `None` outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def context_parallel_size() -> int:
    """Size of the `sp` axis of the context mesh (1 outside a mesh)."""
    return mesh_axis_size(current_mesh(), "sp")


def constrain(x: jax.Array, names: Sequence[str | None], rules: Mapping[str, MeshAxes] = RULES):
    """`with_sharding_constraint` by logical names; a no-op outside a mesh."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(names, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` live on (`None` if they are not on a named mesh)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def mesh_context(tree):
    """A context setting the mesh `tree`'s arrays live on (no-op if none, or already set)."""
    mesh = mesh_of(tree)
    if mesh is None or current_mesh() is not None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def commit(tree):
    """`tree` with every uncommitted array committed to where it already is.

    A jitted function is compiled once for uncommitted and once more for committed
    inputs of the same shapes; its outputs are committed. State that a loop feeds
    back into the same function (a decode state, an engine's page pool) is committed
    from the start, so the first call's compilation is the only one."""
    return jax.tree.map(lambda x: x if not isinstance(x, jax.Array) or x.committed else jax.device_put(x, x.sharding),
                        tree)
