"""One model call over groups of rows of different lengths, laid out as one row.

The engine runs a prefill chunk (`P` rows of `C` tokens) and a decode step (`R`
rows of one token) through the model in one call, so that the weights are read
once per step. The call's tokens are one row `[1, P * C + R]`: everything that
works token by token (projections, norms, RoPE, the MLP) needs no change. What
works row by row (attention over each row's cache, each row's LoRA adapter) splits
the row back into its rectangular groups, `RowGroups ((P, C), (R, 1))`, runs on
each, and joins the results.
"""

from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array

RowGroups = tuple[tuple[int, int], ...]
"""`(rows, tokens per row)` of each group, in the order their tokens are laid out."""


def check_groups(groups: RowGroups) -> RowGroups:
    """`groups` as a tuple of int pairs; `ValueError` unless each is positive."""
    groups = tuple((int(rows), int(length)) for rows, length in groups)
    if not groups or any(rows < 1 or length < 1 for rows, length in groups):
        raise ValueError(f"row groups must be non-empty (rows, tokens) pairs of positive ints, got {groups}")
    return groups


def group_tokens(groups: RowGroups) -> int:
    """Tokens in all groups: the length of the one row they are laid out in."""
    return sum(rows * length for rows, length in groups)


def split_tokens(x: Array, groups: RowGroups) -> list[Array]:
    """`[1, tokens, ...]` -> one `[rows, length, ...]` per group."""
    assert x.shape[:2] == (1, group_tokens(groups)), (x.shape, groups)
    out, start = [], 0
    for rows, length in groups:
        out.append(x[0, start : start + rows * length].reshape(rows, length, *x.shape[2:]))
        start += rows * length
    return out


def join_tokens(parts: Sequence[Array]) -> Array:
    """The inverse of `split_tokens`: `[rows, length, ...]` per group -> `[1, tokens, ...]`."""
    return jnp.concatenate([p.reshape(-1, *p.shape[2:]) for p in parts])[None]


def split_rows(x: Array, groups: RowGroups) -> list[Array]:
    """`[rows of all groups, ...]` (one entry per row, e.g. a page table) -> one per group."""
    assert x.shape[0] == sum(rows for rows, _ in groups), (x.shape, groups)
    out, start = [], 0
    for rows, _ in groups:
        out.append(x[start : start + rows])
        start += rows
    return out
