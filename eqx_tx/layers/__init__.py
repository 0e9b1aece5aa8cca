"""Modules with parameters: linear projections, norms, rotary embeddings, attention, MLPs, MoE, the
decoder block and its scan, the KV cache, LoRA."""
