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


def length_bucket(n: int, multiple: int, *, per_octave: int = 2) -> int:
    """The smallest bucket `>= n`: `multiple * u` with `u` in `1..per_octave`, or
    `u = 2**k * (1 + i / per_octave)` (`2**k >= per_octave`, `0 <= i < per_octave`).
    With `per_octave=2` that is `multiple * 2**k` or `multiple * 3 * 2**k`. A length
    padded to its bucket is at most `1 + 1 / per_octave` times the length (above
    `per_octave * multiple`), and lengths up to `L` fall into about
    `per_octave * log2(L / multiple)` buckets (shapes to compile).

    `per_octave`: a power of two."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    units = ceil_div(max(n, 1), multiple)
    if units <= per_octave:
        return units * multiple
    step = (1 << (units.bit_length() - 1)) // per_octave  # an octave [2**k, 2**(k+1)) in per_octave steps
    return ceil_div(units, step) * step * multiple


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
