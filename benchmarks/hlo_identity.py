"""Compiled programs before and after a refactor: instruction by instruction.

`dump DIR` compiles the real jitted train step (full, LoRA, a bank of 4 LoRA
adapters; cross entropy, micro-batches, a policy loss), `generate`'s prefill and
decode (xla and blockwise attention, bf16 and int8 caches, n=1 and a shared prompt
for n=2) and the engine's two steps for the tiny preset, on one device or, with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, on a 4x2 (dp x tp) mesh, and
writes each program's optimised HLO. `compare A B` reads two dumps and reports the
programs that differ, comparing instructions only: metadata (source lines, op
names, stack frames) is dropped and names are numbered by first appearance, so a
moved file or a renumbered instruction is not a difference.

    python benchmarks/hlo_identity.py dump /tmp/after     # (and /tmp/before on the old commit)
    python benchmarks/hlo_identity.py compare /tmp/before /tmp/after
"""

import dataclasses
import os
import re
import sys

KEEP = re.compile(r"^\s*(ROOT\s+)?%|^ENTRY|^\}")
NAME = re.compile(r"%[\w.\-]+|\b[A-Za-z_][\w\-]*\.\d+\b")


def instructions(path: str) -> list[str]:
    """The instruction lines of an HLO dump, metadata dropped, names canonicalised."""
    ids: dict[str, str] = {}
    out = []
    for line in open(path):
        if not KEEP.match(line):
            continue
        line = re.sub(r",? metadata=\{[^}]*\}", "", line.rstrip())
        line = re.sub(r", stack_frame_id=\d+", "", line)
        out.append(NAME.sub(lambda m: ids.setdefault(m.group(0), f"%v{len(ids)}"), line))
    return out


def compare(a: str, b: str) -> int:
    same = differ = 0
    for name in sorted(os.listdir(a)):
        if not os.path.exists(os.path.join(b, name)):
            print(f"only in {a}: {name}")
            differ += 1
            continue
        x, y = instructions(os.path.join(a, name)), instructions(os.path.join(b, name))
        if x == y:
            same += 1
        else:
            differ += 1
            k = next(i for i, (p, q) in enumerate(zip(x + [""], y + [""])) if p != q)
            print(f"DIFF {name}: {len(x)} vs {len(y)} instructions, first at {k}:\n  {x[k:k + 1]}\n  {y[k:k + 1]}")
    print(f"{same} programs identical, {differ} differ")
    return differ


def dump(out: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import eqx_tx
    from eqx_tx.analysis.memory import (
        abstract_sharded_model,
        abstract_train_inputs,
        compile_engine_step,
        compile_sampling,
        compile_train_step,
    )
    from eqx_tx.infer.config import EngineConfig
    from eqx_tx.models.presets import preset
    from eqx_tx.train.training import train_step_jit

    os.makedirs(out, exist_ok=True)

    def write(name, compiled):
        with open(os.path.join(out, f"{name}.hlo"), "w") as f:
            f.write(compiled.as_text())
        print(name, flush=True)

    devices = len(jax.devices())
    mesh = eqx_tx.make_mesh(tp=2) if devices >= 8 else eqx_tx.make_mesh()
    tag = f"d{devices}"
    compute = eqx_tx.ComputeConfig
    for lora, adapters in [(0, None), (8, None), (8, 4)] if devices == 1 else [(8, None)]:
        model = abstract_sharded_model(preset("tiny"), mesh, jnp.bfloat16, lora_rank=lora, lora_adapters=adapters)
        cases = [("ce", eqx_tx.TrainConfig(compute=compute(attention="blockwise"))),
                 ("ce_xla_mb2", eqx_tx.TrainConfig(micro_batches=2, loss_chunk_size=64,
                                                   compute=compute(attention="xla", remat="dots"))),
                 ("ppo", eqx_tx.TrainConfig(policy_loss=eqx_tx.PolicyLoss(loss="ppo"),
                                            compute=compute(attention="blockwise")))]
        for name, config in cases:
            if adapters and name == "ppo":
                continue
            prefix = f"{tag}_train_l{lora}_a{adapters}_{name}"
            if name == "ppo":  # the abstract batch with the policy fields
                args = list(abstract_train_inputs(model, mesh, 4, 128, config))
                args[-1] = dataclasses.replace(args[-1], sampler_logprobs=args[-1].loss_weights,
                                               advantages=args[-1].loss_weights)
                with jax.set_mesh(mesh):
                    write(prefix, train_step_jit.lower(*args, config).compile())
            else:
                write(prefix, compile_train_step(model, mesh, 4, 128, config))
        for dtype in (jnp.bfloat16, jnp.int8):
            for n in ([] if adapters else [1, 2]):
                for attention in ("xla", "blockwise"):
                    programs = compile_sampling(model, mesh, 4, 40, 16, compute=compute(attention=attention),
                                                cache_dtype=dtype, prefill_chunk=16, n=n)
                    for step, compiled in programs.items():
                        write(f"{tag}_sample_l{lora}_a{adapters}_{dtype.__name__}_n{n}_{attention}_{step}", compiled)
            engine = EngineConfig(max_seqs=4, max_tokens_in_cache=512, max_seq_len=128, page_size=16, prefill_chunk=32,
                                  prefill_rows=2, kv_cache_dtype="int8" if dtype == jnp.int8 else "bfloat16")
            for step, compiled in compile_engine_step(model, mesh, engine, compute=compute()).items():
                write(f"{tag}_engine_l{lora}_a{adapters}_{dtype.__name__}_{step}", compiled)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
    else:
        sys.exit(__doc__)
