"""One prompt's keys/values stored once for its `n` samples."""

from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..core.compute import ComputeConfig
from ..core.sharding import AnyMesh
from ..kernels.decode_tpu import (
    DENSE_BLOCK,
    decode_attention_dense_with_lse,
    decode_attention_shared_with_lse,
    dense_block,
    kernel_options,
)
from ..kernels.dispatch import CacheKind, select_attention
from ..kernels.flash import merge_partials
from ..kernels.mask import AttentionMask
from ..kernels.shared_prefix import shared_prefix_attention
from .base import AbstractCache
from .dense import KVCache


@final
class SharedPrefixCache(AbstractCache):
    """The keys/values of `P` prompts stored once, and of their `P * n` completions.

    Sample `s` continues prompt `s // n`. Its attention reads the shared prompt
    cache and its own completion cache and merges the two by their log-sum-exp,
    which is exact. Completion slot `t` holds position `prompt_lengths[p] + t`; the
    mask of a model call covers the completion slots.
    """

    prompt: KVCache  # [layers, P, prompt_len, ...]
    completion: KVCache  # [layers, P * n, max_new, ...]
    prompt_lengths: Int[Array, " prompts"]

    masks_completion_only: ClassVar[bool] = True

    @property
    def n(self) -> int:
        return self.completion.k.shape[1] // self.prompt.k.shape[1]

    @property
    def kind(self) -> CacheKind:
        return "shared_prefix" if self.prompt.scales is None else "shared_prefix_int8"

    @property
    def block(self) -> int:
        """The blocks the TPU decode kernel reads both parts in (each part's dense block)."""
        return min(dense_block(part.k.shape[2], DENSE_BLOCK) for part in (self.prompt, self.completion))

    def attend(self, q, k, v, *, layer, positions, mask: AttentionMask, compute: ComputeConfig,
               mesh: AnyMesh | None):
        """Write the completion slots, then attend over prompt and completion.

        Decoding where `select_attention` takes the TPU decode kernel, both parts are
        read in place (`_attend_in_place`); otherwise each part's layer is sliced out
        of its stack and attended blockwise."""
        assert mask.kv_lengths is not None
        choice = select_attention(q.shape, self.prompt.k.shape[1:], q.dtype, cache=self.kind, q_offset=mask.q_offset,
                                  mesh=mesh, compute=compute, segmented=mask.segment_ids is not None,
                                  page_size=self.block)
        if choice.backend == "decode_tpu":
            return self._attend_in_place(q, k, v, layer=layer, positions=positions, mask=mask, compute=compute)
        assert choice.backend == "shared_prefix"
        completion = self._write(layer, k, v, positions)
        k_own, v_own = completion.layer(layer)
        k_prompt, v_prompt = self.prompt.layer(layer)
        o = shared_prefix_attention(
            q, k_own, v_own, k_prompt, v_prompt, own_lengths=mask.kv_lengths, own_offset=mask.q_offset,
            prompt_lengths=self.prompt_lengths, block_q=choice.block_q, block_kv=choice.block_kv,
        )
        return o, eqx.tree_at(lambda c: c.completion, self, completion)

    def _write(self, layer, k, v, positions) -> KVCache:
        """The completion cache with these keys/values written: completion slot `t`
        holds position `prompt_length + t`."""
        slots = positions - jnp.repeat(self.prompt_lengths, self.n)[:, None]
        with jax.named_scope("cache_write"):
            return self.completion.write(layer, k, v, slots)

    def _attend_in_place(self, q, k, v, *, layer, positions, mask: AttentionMask, compute: ComputeConfig):
        """One decoding query per sample on the TPU decode kernel: its own completion
        read in place, and its prompt's row read in place once for a group of the
        prompt's samples (`decode_attention_shared_with_lse`), merged by their
        log-sum-exps."""
        assert mask.kv_lengths is not None
        completion = self._write(layer, k, v, positions)
        options = kernel_options(compute, quantized=completion.scales is not None)
        o_own, lse_own = decode_attention_dense_with_lse(q, *completion.values(), layer, mask.kv_lengths,
                                                         scales=completion.scales, **options)
        o_pre, lse_pre = decode_attention_shared_with_lse(q, *self.prompt.values(), layer, self.prompt_lengths,
                                                          samples=self.n, scales=self.prompt.scales, **options)
        o, _ = merge_partials(o_own, lse_own, o_pre, lse_pre)
        return o.astype(q.dtype), eqx.tree_at(lambda c: c.completion, self, completion)
