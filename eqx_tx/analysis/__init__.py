"""Compile-time analysis of the real jitted workflows (`memory`: per-device bytes of a
train step, `generate` and the engine's steps for abstract sharded inputs, on local
or compile-only GPU devices) and the host allocator XLA:CPU runs best with
(`host_memory`).

May import: everything below it: `core` .. `models`, `io`, `train`, `infer`."""
