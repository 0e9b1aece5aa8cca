"""Training data: jsonl records -> token sequences -> fixed-length, resumable batches.

Records are JSON lines with `text` (tokenized with the checkpoint's
`tokenizer.json`), `input_ids` (token ids as they are) or `messages` (a chat,
rendered with the checkpoint's chat template; the loss is on the assistant's tokens
only). A document of `n` tokens gives `n - 1` (input, target) pairs, each weighted
by whether its target is trained on. Rows of `seq_len` pairs are built in one of
three ways (`Packing`):

- `"segments"` (exact packing): whole documents fill rows greedily (best fit,
  longest first) and carry segment ids, so attention stays inside each document and
  RoPE positions restart: every document is scored as if it ran alone, with almost
  no padding. A document longer than a row is split into row-sized pieces (counted
  in `Examples.split`).
- `"pack"` (pretraining style): documents joined with the end-of-text token and cut
  into windows; attention crosses document boundaries. No padding, no truncation.
- `"pad"`: one document per row; documents longer than `seq_len + 1` tokens are
  truncated, or refused with `long_sequences="error"`.

Batch `s` is a pure function of `(seed, s)`: a new permutation of the rows each
epoch, so resuming at a data position reproduces the same stream.
"""

import bisect
import json
import os
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from .batch import Batch

Packing = Literal["segments", "pack", "pad"]
PACKINGS: tuple[Packing, ...] = ("segments", "pack", "pad")
LongSequences = Literal["truncate", "error"]

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # eqx_tx/data
TINY_STORIES = os.path.join(DATA_DIR, "tiny_stories.jsonl")
TINY_CHAT_TEMPLATE = os.path.join(DATA_DIR, "tiny_chat_template.jinja")  # plain "User: ..." turns
TINY_TOKENIZER = os.path.join(DATA_DIR, "tiny_tokenizer.json")


RECORD_FIELDS = ("text", "input_ids", "messages")


def read_jsonl(path: str | os.PathLike, *, fields: Sequence[str] = RECORD_FIELDS, what: str = "dataset") -> list[dict]:
    """All records of a jsonl file, each an object with at least one of `fields`, with
    errors naming the file (`what`: how to call it) and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} does not exist")
    names = ", ".join(f"'{f}'" for f in fields[:-1]) + f" or '{fields[-1]}'" if len(fields) > 1 else f"'{fields[0]}'"
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not (set(fields) & record.keys()):
                raise ValueError(f"{path}:{n}: expected an object with {names}")
            records.append(record)
    if not records:
        raise ValueError(f"{what} {path} is empty")
    return records


Document = list[int] | tuple[list[int], np.ndarray]  # ids, or ids and a 0/1 "train on this token" mask


def tokenize(records: list[dict], tokenizer, eos_id: int | None) -> list[Document]:
    """Token ids of each record: `text` encoded with `eos_id` appended, `input_ids` as
    they are, or `messages` rendered by the chat template with the assistant's tokens
    marked (`tokenizer`: an `eqx_tx.infer.text.Tokenizer`)."""
    docs: list[Document] = []
    for n, r in enumerate(records):
        if "input_ids" in r:
            docs.append([int(t) for t in r["input_ids"]])
        elif "messages" in r:
            if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f"record {n} has 'messages' but the model has no chat template")
            docs.append(tokenizer.chat_for_training(r["messages"]))
        else:
            if tokenizer is None:
                raise ValueError("dataset has 'text' records but no tokenizer.json was found")
            docs.append(tokenizer.encode(r["text"]) + ([eos_id] if eos_id is not None else []))
    docs = [d for d in docs if len(_Tokens.of(d)) >= 2]
    if not docs:
        raise ValueError("dataset has no sequence of at least 2 tokens")
    return docs


class _Tokens(NamedTuple):
    """Token ids and each token's weight as a target."""

    ids: np.ndarray
    weights: np.ndarray

    @classmethod
    def of(cls, doc: Document) -> "_Tokens":
        if isinstance(doc, tuple):
            return cls(np.asarray(doc[0], np.int32), np.asarray(doc[1], np.float32))
        return cls(np.asarray(doc, np.int32), np.ones(len(doc), np.float32))

    def __len__(self) -> int:
        return len(self.ids)

    def cut(self, start: int, stop: int) -> "_Tokens":
        return _Tokens(self.ids[start:stop], self.weights[start:stop])


def max_token_id(docs: Sequence[Document]) -> int:
    return max(int(_Tokens.of(d).ids.max()) for d in docs)


class Examples:
    """Fixed-length training rows: `inputs`, `targets`, `weights` and `segment_ids`
    (`[N, seq_len]`; segment ids only with `packing="segments"`, else `None`) and the
    number of real pairs per row, `lengths [N]`."""

    def __init__(
        self,
        docs: Sequence[Document],
        seq_len: int,
        *,
        packing: Packing = "segments",
        pad_id: int = 0,
        long_sequences: LongSequences = "truncate",
    ):
        """**Arguments:**

        - `docs`: token ids of each document (at least 2 tokens each), or ids with a
          0/1 mask of the tokens to train on (chats: the assistant's).
        - `seq_len`: pairs per row.
        - `packing`: how documents become rows (see the module docstring).
        - `pad_id`: the id written into padding.
        - `long_sequences`: `"pad"` mode: truncate documents longer than a row, or raise.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.truncated = 0  # documents cut short ("pad")
        self.split = 0  # documents split over rows ("segments")
        self.segment_ids: np.ndarray | None = None
        pieces = [_Tokens.of(d) for d in docs]
        if packing == "segments":
            rows = self._segments(pieces)
        elif packing == "pack":
            rows = self._windows(pieces)
        elif packing == "pad":
            rows = self._one_per_row(pieces, long_sequences)
        else:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self._fill(rows, pad_id, segmented=packing == "segments")

    def _windows(self, docs: list[_Tokens]) -> list[list[_Tokens]]:
        window = self.seq_len + 1
        stream = _Tokens(np.concatenate([d.ids for d in docs]), np.concatenate([d.weights for d in docs]))
        n = len(stream) // window
        if n == 0:
            raise ValueError(f"dataset has {len(stream)} tokens, fewer than one window of seq_len+1 = {window}")
        return [[stream.cut(i * window, (i + 1) * window)] for i in range(n)]

    def _one_per_row(self, docs: list[_Tokens], long_sequences: LongSequences) -> list[list[_Tokens]]:
        window = self.seq_len + 1
        too_long = [i for i, d in enumerate(docs) if len(d) > window]
        if too_long and long_sequences == "error":
            raise ValueError(
                f"{len(too_long)} sequence(s) are longer than seq_len+1 = {window} tokens "
                f"(first: record {too_long[0]}, {len(docs[too_long[0]])} tokens); "
                "use long_sequences='truncate' or packing"
            )
        self.truncated = len(too_long)
        return [[d.cut(0, window)] for d in docs]

    def _segments(self, docs: list[_Tokens]) -> list[list[_Tokens]]:
        """Best-fit decreasing: each piece goes to the fullest row it fits in."""
        L = self.seq_len
        pieces = []
        for d in docs:
            if len(d) - 1 > L:
                self.split += 1
                pieces += [d.cut(i, i + L + 1) for i in range(0, len(d) - 1, L)]
            else:
                pieces.append(d)
        rows: list[list[int]] = []  # piece indices per row
        free: list[tuple[int, int]] = []  # (free pairs, row), sorted
        for i in sorted(range(len(pieces)), key=lambda i: (-len(pieces[i]), i)):
            need = len(pieces[i]) - 1
            at = bisect.bisect_left(free, (need, -1))
            if at < len(free):
                room, r = free.pop(at)
            else:
                room, r = L, len(rows)
                rows.append([])
            rows[r].append(i)
            if room - need:
                bisect.insort(free, (room - need, r))
        return [[pieces[i] for i in sorted(row)] for row in rows]

    def _fill(self, rows: list[list[_Tokens]], pad_id: int, *, segmented: bool) -> None:
        N, L = len(rows), self.seq_len
        self.inputs = np.full((N, L), pad_id, np.int32)
        self.targets = np.full((N, L), pad_id, np.int32)
        self.weights = np.zeros((N, L), np.float32)
        self.lengths = np.zeros((N,), np.int32)
        segments = np.zeros((N, L), np.int32)
        for r, pieces in enumerate(rows):
            at = 0
            for s, piece in enumerate(pieces, 1):
                n = len(piece) - 1
                self.inputs[r, at:at + n], self.targets[r, at:at + n] = piece.ids[:-1], piece.ids[1:]
                self.weights[r, at:at + n] = piece.weights[1:]  # a pair is trained on as its target is
                segments[r, at:at + n] = s
                at += n
            self.lengths[r] = at
        if segmented:
            self.segment_ids = segments

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def padding_fraction(self) -> float:
        """The share of row slots that hold no token."""
        return 1.0 - float(self.lengths.sum()) / self.inputs.size

    def batch(self, step: int, batch_size: int, *, seed: int = 0, rows: slice = slice(None)) -> Batch:
        """Batch number `step` (every epoch reshuffled by `seed`), as numpy arrays;
        `rows` selects this process's share of a multi-host batch (the same rows a
        single process would put there)."""
        n = len(self.inputs)
        idx = np.arange(step * batch_size, (step + 1) * batch_size)[rows]
        epochs, pos = idx // n, idx % n
        order = np.empty_like(idx)
        for e in np.unique(epochs):
            perm = np.random.default_rng([seed, int(e)]).permutation(n)
            order[epochs == e] = perm[pos[epochs == e]]
        return Batch(  # host (numpy) arrays: place them with eqx_tx.core.distributed.global_batch
            input_ids=self.inputs[order],
            target_ids=self.targets[order],
            loss_weights=self.weights[order],
            lengths=self.lengths[order],
            segment_ids=None if self.segment_ids is None else self.segment_ids[order],
        )
