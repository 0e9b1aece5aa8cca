"""The Tinker API's wire formats: what the `tinker` SDK sends and expects back.

`forward_backward` bodies are the SDK's protobuf message (`tinker.proto`), zstd-
compressed when the server's client config asks for it; its `ForwardBackwardOutput`
and `SampleResponse` answers are protobuf too (the SDK asks with
`Accept: application/x-protobuf`). Everything else is JSON (the SDK's pydantic types).
Errors in what a client sent raise `BadRequest`, which names the field.
"""

import dataclasses

import numpy as np

from tinker.proto import tinker_public_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
MASK_LOGPROB = -99999.0  # the SDK's "no value" in top-k tables


class BadRequest(ValueError):
    """A request the client must fix (answered as a user error, nothing changed)."""


@dataclasses.dataclass(frozen=True)
class ForwardBackward:
    """A parsed `forward_backward` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    datums: list[tuple[np.ndarray, dict[str, np.ndarray]]]  # (tokens, loss_fn_inputs)


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard

    return zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 34)


def _tensor(msg, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: unsupported tensor dtype {msg.dtype}")
    shape = tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise BadRequest(f"{where}: a sparse tensor must be 2-D, got shape {shape}")
        values = np.frombuffer(msg.sparse_csr.values, dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, np.int64)
        dense = np.zeros(shape, dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    x = np.frombuffer(msg.dense, dtype)
    if shape and int(np.prod(shape)) != x.size:
        raise BadRequest(f"{where}: {x.size} values for shape {shape}")
    return x.reshape(shape) if shape else x


def _tokens(datum, where: str) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        if not chunk.HasField("encoded_text"):
            raise BadRequest(f"{where}: model_input holds an image or audio chunk; only text tokens are supported")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def parse_forward_backward(body: bytes) -> ForwardBackward:
    """The request in a (decompressed) `forward_backward` protobuf body."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - the protobuf library's own error types
        raise BadRequest(f"forward_backward body is not a ForwardBackwardRequest message: {e}") from None
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.HasField("text"):
            raise BadRequest(f"loss_fn_config[{k!r}] = {v.text!r}: only numbers are supported")
        config[k] = float(v.number)
    datums = []
    for i, d in enumerate(msg.data):
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        datums.append((_tokens(d, f"data[{i}]"), inputs))
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, datums)


def _batched(arrays: list[np.ndarray], dtype, proto_dtype) -> "pb.BatchedTensor":
    arrays = [np.ascontiguousarray(a, dtype) for a in arrays]
    sizes = np.asarray([a.nbytes for a in arrays], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=proto_dtype)


def forward_backward_output(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput` of float32 per-datum arrays (`outputs[name][datum]`)."""
    n = len(next(iter(outputs.values()))) if outputs else 0
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=n)
    for name, arrays in outputs.items():
        record.fields[name].CopyFrom(_batched(arrays, np.float32, pb.DTYPE_FLOAT32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


@dataclasses.dataclass
class Sequence:
    """One sampled sequence of a `SampleResponse`."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"
    top: list[tuple[tuple[int, float], ...]] | None = None  # per token, when top-k was asked


def _topk(rows: list[tuple[tuple[int, float], ...] | None], k: int) -> "pb.TopkLogprobs":
    ids = np.zeros((len(rows), k), np.int32)
    logp = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        for j, (t, lp) in enumerate((row or ())[:k]):
            ids[i, j], logp[i, j] = t, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logp.tobytes(), k=k, length=len(rows))


def sample_response(sequences: list[Sequence], *, topk_sample: int = 0, prompt_logprobs: np.ndarray | None = None,
                    topk_prompt: list | None = None, topk_prompt_k: int = 0, cached_tokens: int = 0) -> bytes:
    """A `SampleResponse`: the sequences (with their tokens' `topk_sample` alternatives
    if asked), and the prompt's log-probs (NaN where not scored) and `topk_prompt_k`
    alternatives (`None` rows where not scored) if asked."""
    stops = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse(prompt_cache_hit_tokens=cached_tokens)
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = stops[s.stop_reason]
        seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
        if s.top is not None and topk_sample:
            seq.topk_sampled_logprobs.CopyFrom(_topk(list(s.top), topk_sample))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    if topk_prompt is not None and topk_prompt_k:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, topk_prompt_k))
    return out.SerializeToString()
