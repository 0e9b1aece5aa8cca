"""Integer helpers shared by the kernels, the cache sizing and the data layout."""


def ceil_div(a, b):
    """`ceil(a / b)` for positive `b` (Python ints or integer arrays)."""
    return -(-a // b)


def round_up(a, b):
    """The smallest multiple of `b` that is `>= a` (Python ints or integer arrays)."""
    return ceil_div(a, b) * b
