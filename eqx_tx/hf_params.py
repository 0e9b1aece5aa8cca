"""The correspondence between a model's arrays and Hugging Face tensor names.

Module attribute names follow HF, so an array's pytree path is its HF key; arrays
of the stacked `model.layers` stand for one HF tensor per layer. A `Linear` weight
stored `[*out, *in]` is HF's `[out_features, in_features]` reshaped.
"""

import dataclasses
import math
from collections.abc import Iterator

import jax
import numpy as np

from .layers.linear import Linear
from .sharding import HasAxes

STACKED_PREFIX = "model.layers"


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One array of the model and the HF tensor(s) it is made of.

    - `path`: the pytree path of the array in the model.
    - `name`: the HF key, with `{}` in place of the layer index when `stacked`.
    - `shape`: the array's shape (leading layer axis included when `stacked`).
    - `groups`: how the per-layer dimensions merge into HF dimensions, as
      `(start, stop)` ranges over the per-layer shape.
    """

    path: tuple
    name: str
    shape: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]
    stacked: bool

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        s = self.layer_shape
        return tuple(math.prod(s[a:b]) for a, b in self.groups)

    @property
    def num_layers(self) -> int:
        return self.shape[0] if self.stacked else 1

    def hf_names(self) -> list[str]:
        return [self.name.format(i) for i in range(self.num_layers)] if self.stacked else [self.name]

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
        layers = range(*index[0].indices(self.shape[0])) if self.stacked else [None]
        per_layer = index[1:] if self.stacked else index
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
        for layer in layers:
            name = self.name.format(layer) if self.stacked else self.name
            part = np.asarray(get_hf_slice(name, tuple(hf_index))).reshape(read_shape)
            parts.append(part[tuple(post)])
        return np.stack(parts) if self.stacked else parts[0]


def _normalise(s, n) -> slice:
    start, stop, step = s.indices(n)
    return slice(start, stop, step)


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def hf_tensors(model) -> Iterator[HFTensor]:
    """Every array of `model` (concrete or abstract) as an `HFTensor`, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, HasAxes))
    for path, module in flat:
        if not isinstance(module, HasAxes):
            continue
        prefix = _path_str(path)
        declared = module.param_axes()
        for field, axes in declared.items():
            arr = getattr(module, field)
            if arr is None:
                continue
            stacked = arr.ndim == len(axes) + 1
            if not stacked and arr.ndim != len(axes):
                raise ValueError(f"{prefix}.{field}: shape {arr.shape} does not match axes {axes}")
            layer_ndim = len(axes)
            if isinstance(module, Linear) and field == "weight":
                split = layer_ndim - module.in_ndim
                groups = ((0, split), (split, layer_ndim))
            elif isinstance(module, Linear) and field == "bias":
                groups = ((0, layer_ndim),)
            else:
                groups = tuple((i, i + 1) for i in range(layer_ndim))
            name = f"{prefix}.{field}"
            if stacked:
                if not name.startswith(STACKED_PREFIX + "."):
                    raise ValueError(f"{name}: stacked array outside {STACKED_PREFIX}")
                name = f"{STACKED_PREFIX}.{{}}.{name[len(STACKED_PREFIX) + 1:]}"
            yield HFTensor(tuple(path) + (jax.tree_util.GetAttrKey(field),), name, tuple(arr.shape), groups, stacked)
