"""What every subsystem stands on, with no model knowledge: the package logger (`log`),
small helpers (`util`, `tree`, `fileio`), how a model is run (`compute`), one call
over groups of rows of different lengths laid out as one row (`ragged`), the
logical-axis sharding rules and the mesh (`sharding`), multi-host launch
(`distributed`), and reading compiled programs (`flops`, `hlo`, `memory_figures`).

May import: nothing else of eqx_tx."""
