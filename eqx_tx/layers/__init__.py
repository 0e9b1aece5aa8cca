"""Shared building blocks: linear projections, norms, rotary embeddings, attention."""
