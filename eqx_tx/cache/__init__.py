"""The key/value caches a model reads and writes while sampling: one abstract `Cache`
(`base`) with a dense (`dense.KVCache`), a paged (`paged.PagedKVCache`, the engine's
page pool) and a shared-prompt (`shared_prefix.SharedPrefixCache`) implementation;
how keys and values are stored (`storage`: as is, or int8 with scales) and how empty
caches are allocated in their shardings (`allocate`). Each cache writes itself and
names the attention kernel that reads it.

May import: `eqx_tx.core`, `eqx_tx.kernels`."""
