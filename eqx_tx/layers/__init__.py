"""Modules with parameters: linear projections, norms, rotary embeddings, attention, MLPs,
MoE, LoRA, the decoder block and the scan over a stack of them, and `LayerInputs`
(`inputs`: what every layer receives besides its hidden states).

May import: `eqx_tx.core`, `eqx_tx.kernels`, `eqx_tx.cache`."""
