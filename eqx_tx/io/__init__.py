"""Moving models in and out of Hugging Face's formats: arrays <-> HF tensor names
(`hf_params`), loading checkpoints into sharded arrays (`loading`), saving them
atomically (`saving`), LoRA adapters in PEFT's layout (`adapters`). Safetensors only.

May import: `eqx_tx.core`, `kernels`, `cache`, `layers`, `models` (not `train` or `infer`)."""
