"""Sampling: the jitted steps shared by `generate` and the engine (`steps`), the static
batch `generate` (`generation`), continuous batching (`engine`: a `scheduler` that
plans each step on the host and a `runner` that executes the plan, configured by
`config.EngineConfig`), the host-side page allocator and prefix cache (`page_pool`),
the sampler (`sampling`), and text in and out (`text`, `chat`).

May import: `eqx_tx.core`, `kernels`, `cache`, `layers`, `models` (not `io` or `train`)."""
