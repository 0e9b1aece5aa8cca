"""HTTP services over the sampling engine: the engine's thread and its typed inbox
(`loop.EngineLoop`) and the OpenAI-compatible API (`openai`).

May import: `eqx_tx.core` .. `models`, `eqx_tx.infer` (and `eqx_tx.train` for a
training API)."""
