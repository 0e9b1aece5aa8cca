"""Micro-batches by token budget: pack a batch's sequences into rows of a fixed length.

RL rollouts are long-tailed: one 32k answer among many 1k ones. Padding every row to
the longest wastes most of the step; fixed row counts per micro-batch either waste
the same or run out of memory on the long one. `pack_by_tokens` instead places the
sequences (first-fit, longest first) into rows of `max_tokens` tokens, each a packed
row with segment ids, so every document is computed as if it ran alone (its own
attention and RoPE positions), and a micro-batch is one such row per data-parallel
device. The number of micro-batches is rounded up to a power of two, so a run
compiles the step for a handful of shapes only.
"""

import numpy as np

from ..core.util import ceil_div
from .batch import Batch


def _sequences(batch: Batch) -> list[tuple[int, int, int]]:
    """`(row, start, stop)` of every sequence: each row, or each packed document of a row."""
    lengths = np.asarray(batch.lengths)
    if batch.segment_ids is None:
        return [(b, 0, int(n)) for b, n in enumerate(lengths) if n > 0]
    seg = np.asarray(batch.segment_ids)
    found = []
    for b, n in enumerate(lengths):
        ids = seg[b, :n]
        starts = np.flatnonzero(np.diff(ids, prepend=-1) != 0)
        stops = np.append(starts[1:], n)
        found += [(b, int(s), int(e)) for s, e in zip(starts, stops)]
    return found


def pack_by_tokens(batch: Batch, max_tokens: int, *, rows_multiple: int = 1) -> tuple[Batch, int]:
    """The sequences of `batch` packed into rows of `max_tokens` tokens.

    **Arguments:**

    - `batch`: host (numpy) arrays; rows right-padded, possibly packed already.
    - `max_tokens`: tokens per packed row (the per-device micro-batch budget).
    - `rows_multiple`: rows per micro-batch (the data-parallel size).

    **Returns:** the packed batch (`micro_batches * rows_multiple` rows, segment ids
    set; empty rows have zero loss weight) and `micro_batches`, a power of two. With
    `adapter_ids`, a row holds sequences of one adapter only.
    """
    if max_tokens < 1 or rows_multiple < 1:
        raise ValueError(f"max_tokens and rows_multiple must be >= 1, got {max_tokens}, {rows_multiple}")
    sequences = _sequences(batch)
    longest = max((e - s for _, s, e in sequences), default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens does not fit max_tokens_per_micro_batch={max_tokens}")
    adapters = None if batch.adapter_ids is None else np.asarray(batch.adapter_ids)
    bins: list[tuple[int | None, int, list]] = []  # (adapter, tokens used, sequences)
    for b, s, e in sorted(sequences, key=lambda x: x[1] - x[2]):  # longest first
        adapter = None if adapters is None else int(adapters[b])
        for i, (a, used, members) in enumerate(bins):
            if a == adapter and used + e - s <= max_tokens:
                bins[i] = (a, used + e - s, members + [(b, s, e)])
                break
        else:
            bins.append((adapter, e - s, [(b, s, e)]))
    micro_batches = 1 << max(0, (ceil_div(max(len(bins), 1), rows_multiple) - 1).bit_length())
    rows = micro_batches * rows_multiple
    per_token = batch.per_token_fields()  # what moves with each sequence's tokens
    out = {}
    for name in per_token:
        x = getattr(batch, name)
        out[name] = None if x is None else np.zeros((rows, max_tokens), np.asarray(x).dtype)
    segments = np.zeros((rows, max_tokens), np.int32)
    lengths = np.ones((rows,), np.int32)  # an empty row: one padding token of segment 1, weight 0
    segments[:, 0] = 1
    adapter_ids = None if adapters is None else np.zeros((rows,), adapters.dtype)
    for r, (adapter, used, members) in enumerate(bins):
        at = 0
        for k, (b, s, e) in enumerate(members, 1):
            for name in per_token:
                if out[name] is not None:
                    out[name][r, at : at + e - s] = np.asarray(getattr(batch, name))[b, s:e]
            segments[r, at : at + e - s] = k
            at += e - s
        lengths[r] = used
        if adapter_ids is not None:
            adapter_ids[r] = adapter
    packed = type(batch)(**out, lengths=lengths, segment_ids=segments, adapter_ids=adapter_ids)
    return packed, micro_batches
