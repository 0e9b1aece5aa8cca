"""Device bytes of the Tinker API's adapter bank: `--slots` training runs of LoRA rank
`--rank` over one base model, their AdamW moments on the device or in host memory.

Builds the base (bf16 on an accelerator), a `BankTrainer` of `--slots` slots, starts
every slot (`init_slot`), runs one `forward_backward` + `adamw_step` on each of the
first `--steps-slots`, and reads the device's own counters (`memory_stats`: bytes in use
now, and the peak), beside what the arrays should take: base weights, the bank
(float32), its gradient buffer, and the moments (two banks' worth, or one slot's).

    python benchmarks/bank_memory.py --preset qwen3-0.6b --slots 32 --rank 32
    python benchmarks/bank_memory.py --preset qwen3-0.6b --slots 32 --rank 32 --offload-moments
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import eqx_tx
from eqx_tx.models.presets import preset
from eqx_tx.train.bank_training import AdamWParams, BankTrainer, Datum


@dataclasses.dataclass
class Args:
    preset: str = "qwen3-0.6b"
    slots: int = 32
    rank: int = 32
    offload_moments: bool = False
    seq_len: int = 2048
    steps_slots: int = 2
    """How many slots take a step (each brings its moments to the device and back)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(args: Args) -> None:
    config = preset(args.preset)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    base = eqx_tx.init_model(config, key=jax.random.key(0), dtype=dtype)
    bank = eqx_tx.apply_lora(base, rank=args.rank, alpha=32.0, adapters=args.slots, key=jax.random.key(1))
    trainer = BankTrainer(bank, offload_moments=args.offload_moments)
    del bank  # the trainer holds the bank now (its first write donates these arrays)
    for slot in range(args.slots):
        trainer.init_slot(slot, rank=args.rank, seed=slot)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, args.seq_len + 1)
    datum = Datum(tokens[:-1], tokens[1:], np.ones(args.seq_len, np.float32), np.zeros(args.seq_len, np.float32),
                  np.zeros(args.seq_len, np.float32))
    for slot in range(args.steps_slots):
        trainer.forward_backward(slot, [datum], "cross_entropy", {})
        trainer.adamw_step(slot, AdamWParams())
    jax.block_until_ready(trainer.params)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    bank_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    moments = 2 * bank_bytes if not args.offload_moments else 2 * bank_bytes // args.slots
    stats = jax.devices()[0].memory_stats() or {}
    print(f"{args.preset}, {args.slots} slots of LoRA rank {args.rank}, moments "
          f"{'in host memory' if args.offload_moments else 'on the device'}; {jax.devices()[0].device_kind}")
    print("| what | bytes |")
    print("|---|---|")
    print(f"| base weights ({jnp.dtype(dtype).name}) | {_gib(base_bytes)} |")
    print(f"| bank (float32, {args.slots} slots) | {_gib(bank_bytes)} |")
    print(f"| gradient buffer (float32) | {_gib(bank_bytes)} |")
    print(f"| AdamW moments on the device | {_gib(moments)} |")
    print(f"| expected resident: base + bank + gradients + moments | {_gib(base_bytes + 2 * bank_bytes + moments)} |")
    if stats:
        print(f"| device bytes in use (memory_stats) | {_gib(stats.get('bytes_in_use', 0))} |")
        print(f"| device peak bytes (memory_stats) | {_gib(stats.get('peak_bytes_in_use', 0))} |")
        print(f"| device limit | {_gib(stats.get('bytes_limit', 0))} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
