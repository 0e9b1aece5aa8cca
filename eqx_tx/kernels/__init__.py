"""Parameter-free computations: the attention kernels (blockwise, splash, xla, cuDNN,
ring, shared-prefix, paged), the one masking rule they share (`mask`), the one
dispatch that picks between them (`dispatch.select_attention`), the grouped expert
matmul, int8 vectors, sort-free top-k.

May import: `eqx_tx.core`."""
