"""Parameter-free computations: attention kernels and the one dispatch that picks
between them, ring attention, the grouped expert matmul, int8 vectors."""
