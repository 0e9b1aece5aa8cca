"""One prompt's keys/values stored once for its `n` samples."""

from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..core.compute import ComputeConfig
from ..core.sharding import AnyMesh
from ..kernels.dispatch import CacheKind, select_attention
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
        return "shared_prefix"

    def attend(self, q, k, v, *, layer, positions, mask: AttentionMask, compute: ComputeConfig,
               mesh: AnyMesh | None):
        """Write the completion slots, then attend over prompt and completion."""
        choice = select_attention(q.shape, k.shape, q.dtype, cache=self.kind, q_offset=mask.q_offset, mesh=mesh,
                                  compute=compute, segmented=mask.segment_ids is not None)
        assert choice.backend == "shared_prefix" and mask.kv_lengths is not None
        # Completion slot t holds position prompt_length + t.
        slots = positions - jnp.repeat(self.prompt_lengths, self.n)[:, None]
        with jax.named_scope("cache_write"):
            completion = self.completion.write(layer, k, v, slots)
        k_own, v_own = completion.layer(layer)
        k_prompt, v_prompt = self.prompt.layer(layer)
        o = shared_prefix_attention(
            q, k_own, v_own, k_prompt, v_prompt, own_lengths=mask.kv_lengths, own_offset=mask.q_offset,
            prompt_lengths=self.prompt_lengths, block_q=choice.block_q, block_kv=choice.block_kv,
        )
        return o, eqx.tree_at(lambda c: c.completion, self, completion)
