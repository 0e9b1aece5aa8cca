"""The engine's settings, one frozen config that the tools and benchmarks embed."""

import dataclasses
from typing import Literal

CacheDtype = Literal["auto", "float32", "bfloat16", "int8"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How `eqx_tx.Engine` batches requests over its page pool."""

    max_seqs: int = 16
    """Sequences decoded at once (engine slots)."""
    max_tokens_in_cache: int = 65536
    """The KV page pool's size in tokens, shared by all requests (rounded down to whole pages)."""
    page_size: int = 16
    """Tokens per KV page."""
    prefill_chunk: int = 256
    """Prompt positions prefilled per request and engine step (shorter remainders run in
    the smallest power-of-two chunk, at least `min_prefill_chunk`, that holds them)."""
    min_prefill_chunk: int | None = None
    """The smallest chunk a prefill remainder is padded to (a power of two). Default:
    16 on CPU, where a pass costs its FLOPs; 128 on an accelerator, where a pass of up
    to ~128 tokens per row costs about what reading the weights once does (Qwen3-0.6B
    on a TPU v5e: 128 tokens are 0.15 TFLOP, 0.8 ms at the data sheet's 197 TFLOP/s,
    against 1.5 ms for its 1.2 GB of weights at 819 GB/s), so smaller chunks would only
    add compiled shapes (`Engine.warmup` compiles each)."""
    prefill_rows: int = 4
    """Requests prefilled together in one engine step (a power of two)."""
    min_decode_rows: int | None = None
    """The fewest rows a decode step is padded to (a power of two). Default: 1 on CPU;
    8 on an accelerator, where a step of up to 8 rows is bound by its weights, so fewer
    rows would only add compiled shapes."""
    max_seq_len: int | None = None
    """The longest prompt + max_new_tokens a request may have (default: the pool, or the
    model's position limit if smaller)."""
    kv_cache_dtype: CacheDtype = "auto"
    """The page pool's dtype (auto: the model's; int8: int8 with a float32 scale per token and kv head)."""
    mixed_steps: bool = False
    """Run a step's prefill chunk and decode rows in one pass through the model, so the
    weights are read once (the decode rows padded to `max_seqs` in such steps; a
    context's first token is sampled the step after its prefill ends). False: a
    prefill pass, then a decode pass that samples it in the same step: the default,
    measured faster. On a TPU v5e (Qwen3-0.6B shape, a 4 x 256 chunk beside 64 decode
    rows of 1k tokens; `benchmarks/engine_step_time.py`) one mixed pass took 64.7 ms
    against 39.8 for the two: the passes are bound by the chunk's FLOPs and the rows'
    keys/values, not by the weights, and the padding rows cost. On CPU separate
    passes are faster too (`benchmarks/benchmark_engine.py`)."""
    shared_decode_rows: int | None = None
    """Lay each decode step out in runs of this many rows (a power of two; 0: off) of
    requests whose first page is one page (the `n` samples of a prompt, requests of
    one cached system prompt), padded, so that the TPU decode kernel reads the leading
    pages a run shares once for the whole run (`decode_attention_blocks_shared`)
    instead of once per row. For RL's samples of long prompts this cuts a step's bytes
    by nearly the prompt's share of them; a run holds at least half its rows (padding
    rows cost MLP, LM head and sampler rows). Default: on a TPU, the most rows whose
    query heads fit the kernel's 128-row tile (128 // query heads per device, a power
    of two: 8 for Qwen3-0.6B), elsewhere 0 (other attention paths read row by row).
    On a TPU v5e the RL workload (`benchmarks/rl_workload.py`, 90 s of it, steps one
    by one) ran at 51% of its roofline with 8 against 45% without."""
    overlap_steps: bool = True
    """Launch each step before recording the tokens of the one before it, so that the
    host's planning, dispatch and bookkeeping (a few ms a step) run while the device
    computes instead of between its steps; `Engine.step` then returns the tokens of
    the step before. A request that a token turns out to stop has one more token
    computed and dropped. Results equal those without. On a TPU v5e the RL workload's
    device sat idle for 4.0 of every 19.5 ms between steps without
    (`benchmarks/rl_workload.py --profile-dir`)."""
    max_top_logprobs: int = 0
    """Each generated token also reports this many most likely alternatives and their
    log-probs (0: none; a top-k over the vocabulary in every decode step)."""

    def __post_init__(self):
        for name in ("max_seqs", "page_size", "prefill_chunk", "prefill_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_rows", "min_prefill_chunk", "min_decode_rows"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")
        share = self.shared_decode_rows
        if share is not None and (share < 0 or share & (share - 1)):
            raise ValueError(f"shared_decode_rows must be 0 or a power of two, got {self.shared_decode_rows}")
        if self.max_tokens_in_cache < self.page_size:
            raise ValueError(f"max_tokens_in_cache {self.max_tokens_in_cache} holds no page of {self.page_size} tokens")
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")

    def decode_run_rows(self, platform: str, query_heads: int) -> int:
        """`shared_decode_rows` in effect on `platform` (`"tpu"`, `"gpu"`, `"cpu"`) for a
        model with `query_heads` query heads per device."""
        if self.shared_decode_rows is not None:
            return self.shared_decode_rows
        fit = 128 // query_heads  # a run's query heads in the TPU kernel's 128-row tile
        return 1 << (fit.bit_length() - 1) if platform == "tpu" and fit >= 2 else 0

    @property
    def num_pages(self) -> int:
        return self.max_tokens_in_cache // self.page_size
