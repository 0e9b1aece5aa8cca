"""The Tinker API's settings (embedded by `tools/serve.py`: each field is a flag)."""

import dataclasses

from ..core.compute import RematPolicy


@dataclasses.dataclass(frozen=True)
class TinkerConfig:
    """The Tinker API's settings (`tools/serve.py` flags)."""

    max_adapters: int = 4
    """Training runs held at once: the slots of the training adapter bank (each with
    its own AdamW state); creating one more is refused until a run is unloaded."""
    max_lora_rank: int = 32
    """The largest LoRA rank a run may ask for (the bank's rank)."""
    lora_alpha: float = 32.0
    """LoRA alpha: adapters compute `alpha / max_lora_rank * B A x`."""
    sampler_adapters: int = 4
    """Sampler weights the engine holds at once besides the base model."""
    snapshots_per_run: int = 4
    """The newest `save_weights_and_get_sampling_client` snapshots of a run kept for sampling
    (each holds one adapter in device memory; an RL loop makes one per step)."""
    state_dir: str = "runs/tinker"
    """Where checkpoints and their SQLite index live (kept across restarts)."""
    tokens_per_call: int = 16384
    """About how many tokens one compiled training call scores (packed rows)."""
    remat: RematPolicy = "auto"
    """The training programs' remat policy (auto: the fastest that fits the device's memory,
    chosen per shape of call, as `tools/train.py --remat auto`)."""
    offload_moments: bool | None = None
    """Keep each run's AdamW moments in host memory between its steps (the device holds
    one run's at a time); None: on an accelerator with pinned host memory (TPU, GPU)."""
    session_timeout_s: float = 300.0
    """When every slot is taken, runs whose session sent no heartbeat for this long
    (their client is gone) are unloaded to make room (their checkpoints stay)."""

    def __post_init__(self):
        for name in ("max_adapters", "max_lora_rank", "sampler_adapters", "tokens_per_call", "snapshots_per_run"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha (--lora-alpha) must be > 0, got {self.lora_alpha}")
