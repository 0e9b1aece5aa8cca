"""The correspondence between a model's arrays and Hugging Face tensor names.

Module attribute names follow HF, so an array's pytree path is its HF key; arrays
under a stacked field (`eqx_tx.core.tree.stacked`: the decoder's `layers`, an MoE
layer's `experts`) stand for one HF tensor per index, the index inserted after
that field's name. Sharding names play no part here. A `Linear` weight
stored `[*out, *in]` is HF's `[out_features, in_features]` reshaped.
"""

import dataclasses
import itertools
import math
from collections.abc import Iterator

import jax
import numpy as np

from ..core.sharding import HasAxes
from ..core.tree import path_names, stacking_along
from ..layers.linear import Linear


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One array of the model and the HF tensor(s) it is made of.

    - `path`: the pytree path of the array in the model.
    - `name`: the HF key, with a `{}` for each stacked axis (layer, then expert index).
    - `shape`: the array's shape, stacked axes included.
    - `groups`: how the per-tensor dimensions merge into HF dimensions, as
      `(start, stop)` ranges over the per-tensor shape.
    - `n_stacked`: how many leading axes index separate HF tensors.
    """

    path: tuple
    name: str
    shape: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]
    n_stacked: int

    @property
    def stacked(self) -> bool:
        return self.n_stacked > 0

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of one HF tensor's worth of the array (stacked axes dropped)."""
        return self.shape[self.n_stacked :]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        s = self.layer_shape
        return tuple(math.prod(s[a:b]) for a, b in self.groups)

    def indices(self) -> list[tuple[int, ...]]:
        """Every stacked index, in HF order (layer-major)."""
        return list(itertools.product(*(range(n) for n in self.shape[: self.n_stacked])))

    def hf_names(self) -> list[str]:
        return [self.name.format(*i) for i in self.indices()]

    def items(self, array):
        """`(hf_name, hf_array)` for each HF tensor of `array` (a host numpy array)."""
        for idx in self.indices():
            yield self.name.format(*idx), self.to_hf(np.asarray(array)[idx])

    def get(self, model):
        """This array of `model`."""
        for key in self.path:
            model = getattr(model, key.name)
        return model

    def to_hf(self, layer_array: np.ndarray) -> np.ndarray:
        """A per-layer array in HF layout."""
        return layer_array.reshape(self.hf_shape)

    def read(self, get_hf_slice, index: tuple[slice, ...]) -> np.ndarray:
        """Assemble `array[index]` from HF tensors, reading only what the index covers.

        `get_hf_slice(hf_name, hf_index)` returns `hf_tensor[hf_index]` as numpy.
        Each group of merged dimensions is read as one contiguous range when only its
        first dimension is sliced (always the case for the sharding rules here), and
        in full otherwise.
        """
        index = tuple(_normalise(s, n) for s, n in zip(index, self.shape))
        ns = self.n_stacked
        stacked = list(itertools.product(*(range(*s.indices(n)) for s, n in zip(index[:ns], self.shape[:ns]))))
        counts = [len(range(*s.indices(n))) for s, n in zip(index[:ns], self.shape[:ns])]
        per_layer = index[ns:]
        shape = self.layer_shape
        hf_index, post, read_shape = [], [], []
        for a, b in self.groups:
            dims, sl = shape[a:b], per_layer[a:b]
            rest = math.prod(dims[1:])
            if all(s == slice(0, n, 1) for s, n in zip(sl[1:], dims[1:])) and sl[0].step == 1:
                hf_index.append(slice(sl[0].start * rest, sl[0].stop * rest))
                read_shape += [sl[0].stop - sl[0].start, *dims[1:]]
                post += [slice(None)] * (b - a)
            else:
                hf_index.append(slice(0, math.prod(dims)))
                read_shape += list(dims)
                post += list(sl)
        parts = []
        for idx in stacked:
            part = np.asarray(get_hf_slice(self.name.format(*idx), tuple(hf_index))).reshape(read_shape)
            parts.append(part[tuple(post)])
        if not ns:
            return parts[0]
        return np.stack(parts).reshape(*counts, *parts[0].shape)


def _normalise(s, n) -> slice:
    start, stop, step = s.indices(n)
    return slice(start, stop, step)


def hf_tensors(model) -> Iterator[HFTensor]:
    """Every array of `model` (concrete or abstract) as an `HFTensor`, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, HasAxes))
    for path, module in flat:
        if not isinstance(module, HasAxes):
            continue
        names = path_names(path)
        stacked_in_path = [i for i, _ in stacking_along(model, path)]
        declared = module.param_axes()
        for field, axes in declared.items():
            arr = getattr(module, field)
            if arr is None:
                continue
            extra = arr.ndim - len(axes)
            if extra < 0:
                raise ValueError(f"{'.'.join(names)}.{field}: shape {arr.shape} does not match axes {axes}")
            layer_ndim = len(axes)
            if isinstance(module, Linear) and field == "weight":
                split = layer_ndim - module.in_ndim
                groups = ((0, split), (split, layer_ndim))
            elif isinstance(module, Linear) and field == "bias":
                groups = ((0, layer_ndim),)
            else:
                groups = tuple((i, i + 1) for i in range(layer_ndim))
            # One "{}" after each stacked field in the path: model.layers.{}.mlp.experts.{}...
            if len(stacked_in_path) != extra:
                raise ValueError(f"{'.'.join(names)}.{field}: {extra} stacked axes but the path has "
                                 f"{len(stacked_in_path)} stacked submodules")
            parts = [n + (".{}" if i in stacked_in_path else "") for i, n in enumerate(names)]
            name = ".".join(parts + [field])
            yield HFTensor(tuple(path) + (jax.tree_util.GetAttrKey(field),), name, tuple(arr.shape), groups, extra)
