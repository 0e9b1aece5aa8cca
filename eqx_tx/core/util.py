"""Small helpers: integer arithmetic shared by the kernels, the cache sizing and the
data layout; reading a value on the host when it is known there; whether the device
has pinned host memory."""

import jax
import numpy as np


def ceil_div(a, b):
    """`ceil(a / b)` for positive `b` (Python ints or integer arrays)."""
    return -(-a // b)


def round_up(a, b):
    """The smallest multiple of `b` that is `>= a` (Python ints or integer arrays)."""
    return ceil_div(a, b) * b


def length_bucket(n: int, multiple: int) -> int:
    """The smallest of `multiple * 2**k` and `multiple * 3 * 2**k` (k >= 0) that is
    `>= n`: a length padded to it is at most 1.5x the length (above `2 * multiple`),
    and lengths up to `L` fall into about `2 * log2(L / multiple)` buckets (shapes to
    compile)."""
    if n <= multiple:
        return multiple
    units = ceil_div(n, multiple)
    power = 1 << (units - 1).bit_length()  # the power of two >= units
    return multiple * (3 * power // 4 if 3 * power // 4 >= units else power)


def concrete_value(x) -> np.ndarray | None:
    """`x` as numpy if its value is known on this host (not a tracer, not sharded across hosts)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def has_pinned_host(device=None) -> bool:
    """Whether `device` (default: the first) has pinned host memory to put arrays in
    (TPUs and GPUs do; so does XLA:CPU, where it is the device's own RAM)."""
    device = jax.devices()[0] if device is None else device
    return any(m.kind == "pinned_host" for m in device.addressable_memories())
