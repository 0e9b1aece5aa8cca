"""Small helpers: integer arithmetic shared by the kernels, the cache sizing and the
data layout; reading a value on the host when it is known there."""

import jax
import numpy as np


def ceil_div(a, b):
    """`ceil(a / b)` for positive `b` (Python ints or integer arrays)."""
    return -(-a // b)


def round_up(a, b):
    """The smallest multiple of `b` that is `>= a` (Python ints or integer arrays)."""
    return ceil_div(a, b) * b


def concrete_value(x) -> np.ndarray | None:
    """`x` as numpy if its value is known on this host (not a tracer, not sharded across hosts)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None
