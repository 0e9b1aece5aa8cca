"""Stacked submodules, declared where they are stacked, and pytree path helpers.

A module built with `eqx.filter_vmap` holds arrays with extra leading axes (the
decoder's `layers`, an MoE layer's `experts`). The container declares it on the
field itself, `layers: DecoderBlock = eqx.field(metadata=stacked("layers"))`,
naming the logical axis of that leading dimension. Sharding (`eqx_tx.core.sharding`) reads the axis names and
the HF key mapping (`eqx_tx.io.hf_params`) reads where the stacking happens; neither
infers anything from attribute names.
"""

import dataclasses
from collections.abc import Sequence

_STACKED = "eqx_tx_stacked_axis"


def stacked(axis: str) -> dict[str, str]:
    """Field metadata: the field holds a stacked (vmapped) module whose leading axis
    is the logical axis `axis`."""
    return {_STACKED: axis}


def stacked_axis_of(module, field_name: str) -> str | None:
    """The stacked axis declared on `module.field_name`, if any."""
    if not dataclasses.is_dataclass(module):
        return None
    for f in dataclasses.fields(module):
        if f.name == field_name:
            return f.metadata.get(_STACKED)
    return None


def key_name(key) -> str:
    """The attribute name, dict key or sequence index of one pytree path entry."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path: Sequence) -> list[str]:
    return [key_name(k) for k in path]


def stacking_along(root, path: Sequence) -> list[tuple[int, str]]:
    """`(i, axis)` for every entry `path[i]` of a pytree path from `root` that enters a
    stacked field, outermost first."""
    found = []
    node = root
    for i, key in enumerate(path):
        name = key_name(key)
        axis = stacked_axis_of(node, name)
        if axis is not None:
            found.append((i, axis))
        if hasattr(key, "name"):
            node = getattr(node, key.name)
        elif hasattr(key, "key"):
            node = node[key.key]
        elif hasattr(key, "idx"):
            node = node[key.idx]
        else:
            break
    return found
