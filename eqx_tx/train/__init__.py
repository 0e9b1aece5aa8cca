"""Training: the `Batch` (`batch`), data files and packing (`data`), micro-batches by
token budget (`token_budget`), the forward pass and full logits (`forward`), the
chunked LM-head loss (`loss`), the policy-gradient objectives (`policy`), the jitted
step and its optimizer (`training`), `remat="auto"` (`remat_auto`), one optimizer per
adapter of a bank (`bank_optimizer`) and resumable checkpoints (`checkpoint`).

May import: `eqx_tx.core`, `kernels`, `cache`, `layers`, `models` (not `io` or `infer`)."""
