"""Training data: jsonl records -> token sequences -> fixed-length, resumable batches.

Records are JSON lines with `text` (tokenized with the checkpoint's
`tokenizer.json`) or `input_ids` (token ids as they are). Sequences are either
*packed* (documents joined with the end-of-text token and cut into windows of
`seq_len + 1` tokens: no padding, no truncation) or *padded* (one document per row;
documents longer than `seq_len + 1` tokens are truncated, or refused with
`long_sequences="error"`).

Batch `s` is a pure function of `(seed, s)`: a new permutation of the examples each
epoch, so resuming at a data position reproduces the same stream.
"""

import json
import os
from typing import Literal

import numpy as np

from .batch import Batch

Packing = Literal["pack", "pad"]
LongSequences = Literal["truncate", "error"]

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
TINY_STORIES = os.path.join(DATA_DIR, "tiny_stories.jsonl")
TINY_TOKENIZER = os.path.join(DATA_DIR, "tiny_tokenizer.json")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a jsonl file, with errors naming the file and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path} does not exist")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not ({"text", "input_ids"} & record.keys()):
                raise ValueError(f"{path}:{n}: expected an object with 'text' or 'input_ids'")
            records.append(record)
    if not records:
        raise ValueError(f"dataset {path} is empty")
    return records


def tokenize(records: list[dict], tokenizer, eos_id: int | None) -> list[list[int]]:
    """Token ids of each record (`text` encoded, with `eos_id` appended; or `input_ids`)."""
    docs = []
    for r in records:
        if "input_ids" in r:
            docs.append([int(t) for t in r["input_ids"]])
        else:
            if tokenizer is None:
                raise ValueError("dataset has 'text' records but no tokenizer.json was found")
            ids = tokenizer.encode(r["text"]).ids
            docs.append(ids + ([eos_id] if eos_id is not None else []))
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise ValueError("dataset has no sequence of at least 2 tokens")
    return docs


class Examples:
    """Fixed-length training examples: `tokens [N, seq_len + 1]` and valid `lengths [N]`."""

    def __init__(
        self,
        docs: list[list[int]],
        seq_len: int,
        *,
        packing: Packing = "pack",
        pad_id: int = 0,
        long_sequences: LongSequences = "truncate",
    ):
        window = seq_len + 1
        if packing == "pack":
            stream = np.concatenate([np.asarray(d, np.int32) for d in docs])
            n = len(stream) // window
            if n == 0:
                raise ValueError(f"dataset has {len(stream)} tokens, fewer than one window of seq_len+1 = {window}")
            self.tokens = stream[: n * window].reshape(n, window)
            self.lengths = np.full((n,), window, np.int32)
            self.truncated = 0
        elif packing == "pad":
            too_long = [i for i, d in enumerate(docs) if len(d) > window]
            if too_long and long_sequences == "error":
                raise ValueError(
                    f"{len(too_long)} sequence(s) are longer than seq_len+1 = {window} tokens "
                    f"(first: record {too_long[0]}, {len(docs[too_long[0]])} tokens); "
                    "use long_sequences='truncate' or packing"
                )
            self.truncated = len(too_long)
            self.tokens = np.full((len(docs), window), pad_id, np.int32)
            self.lengths = np.zeros((len(docs),), np.int32)
            for i, d in enumerate(docs):
                d = d[:window]
                self.tokens[i, : len(d)] = d
                self.lengths[i] = len(d)
        else:
            raise ValueError(f"packing must be 'pack' or 'pad', got {packing!r}")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch_size: int, *, seed: int = 0, rows: slice = slice(None)) -> Batch:
        """Batch number `step` (every epoch reshuffled by `seed`), as numpy arrays;
        `rows` selects this process's share of a multi-host batch (the same rows a
        single process would put there)."""
        n = len(self.tokens)
        idx = np.arange(step * batch_size, (step + 1) * batch_size)[rows]
        epochs, pos = idx // n, idx % n
        order = np.empty_like(idx)
        for e in np.unique(epochs):
            perm = np.random.default_rng([seed, int(e)]).permutation(n)
            order[epochs == e] = perm[pos[epochs == e]]
        tokens, lengths = self.tokens[order], self.lengths[order]
        inputs_len = lengths - 1  # the last token of each row is only a target
        valid = np.arange(self.seq_len)[None, :] < inputs_len[:, None]
        return Batch(  # host (numpy) arrays: place them with eqx_tx.distributed.global_batch
            input_ids=np.where(valid, tokens[:, :-1], 0).astype(np.int32),
            target_ids=np.where(valid, tokens[:, 1:], 0).astype(np.int32),
            loss_weights=valid.astype(np.float32),
            lengths=inputs_len.astype(np.int32),
        )
