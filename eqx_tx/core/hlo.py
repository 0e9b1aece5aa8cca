"""Reading compiled HLO: what crosses devices per layer, and which buffers exist.

Layer loops are found as `while` loops whose known trip count equals the number of
layers (the forward scan and its transpose); collectives inside their bodies run
once per layer. `materialized` lists the instructions that get a buffer of their
own (everything outside fusion bodies), e.g. to check that no layer weight is
copied.
"""

import collections
import dataclasses
import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_OP = re.compile(r"= (?P<type>.*) (?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_WHILE = re.compile(r" while\(.*body=%(?P<body>[\w.\-]+).*?known_trip_count\":\{\"n\":\"(?P<n>\d+)\"")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{\s*$")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}


@dataclasses.dataclass
class Collective:
    op: str
    bytes: int
    computation: str


def _result_bytes(type_str: str, op: str, is_async: bool) -> int:
    shapes = _SHAPE.findall(type_str)
    if is_async and op != "all-reduce":  # (operands..., results...): keep the results
        shapes = shapes[len(shapes) // 2 :]
    return int(sum(_BYTES.get(dt, 4) * np.prod([int(d) for d in dims.split(",") if d] or [1]) for dt, dims in shapes))


def collectives(hlo_text: str) -> tuple[list[Collective], dict[str, int]]:
    """All collectives (op, result bytes, enclosing computation) and each while body's trip count."""
    found, trips, current = [], {}, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group("name")
            continue
        w = _WHILE.search(line)
        if w:
            trips[w.group("body")] = int(w.group("n"))
        c = _OP.search(line)
        if c and current is not None:
            found.append(Collective(c.group("op"), _result_bytes(c.group("type"), c.group("op"), bool(c.group("start"))), current))
    return found, trips


def per_layer_summary(hlo_text: str, num_layers: int) -> dict[str, dict[str, tuple[int, int]]]:
    """`{"per_layer": {op: (count, bytes)}, "outside": {op: (count, bytes)}}`.

    `per_layer` sums the forward and backward layer loops (one iteration each).
    """
    ops, trips = collectives(hlo_text)
    layer_bodies = {body for body, n in trips.items() if n == num_layers}
    out = {"per_layer": collections.defaultdict(lambda: [0, 0]), "outside": collections.defaultdict(lambda: [0, 0])}
    for c in ops:
        where = "per_layer" if c.computation in layer_bodies else "outside"
        out[where][c.op][0] += 1
        out[where][c.op][1] += c.bytes
    return {k: {op: (v[0], v[1]) for op, v in d.items()} for k, d in out.items()}


def format_summary(summary) -> str:
    lines = []
    for where in ("per_layer", "outside"):
        items = summary[where]
        text = ", ".join(f"{op} x{n} ({b / 2**20:,.1f} MiB)" for op, (n, b) in sorted(items.items())) or "none"
        lines.append(f"{where.replace('_', ' ')}: {text}")
    return "; ".join(lines)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]\S* (?P<op>[\w\-]+)\(")
_FUSION_BODY = re.compile(r" fusion\(.*?calls=%(?P<body>[\w.\-]+)")
_NOT_NEW = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")


@dataclasses.dataclass
class Buffer:
    name: str
    op: str  # the instruction's opcode (`fusion` for a fused kernel)
    shape: tuple[int, ...]
    dtype: str
    computation: str


def materialized(hlo_text: str) -> list[Buffer]:
    """Array-valued instructions outside fusion bodies that write a new buffer
    (parameters, tuple plumbing, bitcasts and constants left out)."""
    bodies = {m.group("body") for m in _FUSION_BODY.finditer(hlo_text)}
    found, current = [], None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group("name")
            continue
        if current in bodies:
            continue
        i = _INSTRUCTION.match(line)
        if i and i.group("op") not in _NOT_NEW and current is not None:
            shape = tuple(int(d) for d in i.group("dims").split(",") if d)
            found.append(Buffer(i.group("name"), i.group("op"), shape, i.group("dtype"), current))
    return found


# A host-memory buffer (memory space 5) allocated by the program, e.g. the saved
# layer inputs of `remat="offload"`.
_HOST_BUFFER = re.compile(
    r"= (?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]\{[0-9,]*:S\(5\)\} custom-call\(.*custom_call_target=\"AllocateBuffer\""
)


def host_buffers(hlo_text: str) -> list[int]:
    """Sizes in bytes of the host-memory buffers a compiled program allocates (the
    offloaded activations: each written once in the forward pass and read once in
    the backward, so a step moves twice their sum between device and host)."""
    sizes = []
    for m in _HOST_BUFFER.finditer(hlo_text):
        dims = [int(d) for d in m["dims"].split(",") if d]
        sizes.append(int(np.prod(dims, dtype=np.int64)) * _BYTES[m["dtype"]])
    return sizes
