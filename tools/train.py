"""Fine-tune (full or LoRA) or train from scratch, with resumable checkpoints.

With no arguments: trains the `tiny` Qwen3 preset from scratch on the stories
shipped in the package (about a minute on 2 CPU cores) and writes a Hugging Face
checkpoint to `runs/tiny/final`, which `tools/sample.py` samples from by default.

    python tools/train.py
    python tools/train.py --model Qwen/Qwen3-0.6B --data my.jsonl --lora-rank 32 --tp 8
"""

import dataclasses
import os
import sys
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.distributed import DistributedArgs
from eqx_tx.layers.lora import ALL_TARGETS


@dataclasses.dataclass
class Args:
    model: str = "tiny"
    """A preset name (tiny, qwen3-4b: random init), a local HF directory, or a hub repo id."""
    data: str | None = None
    """jsonl with a 'text' or 'input_ids' field per line (default: the shipped tiny stories)."""
    output_dir: str = "runs/tiny"
    """Checkpoints go to OUTPUT_DIR/checkpoint, the final HF model to OUTPUT_DIR/final."""
    seq_len: int = 128
    batch_size: int = 16
    micro_batches: int = 1
    steps: int = 150
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_rank: int = 0
    """0 = full fine-tune; > 0 trains LoRA adapters of this rank on a frozen base."""
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ALL_TARGETS
    tp: int = 1
    """Tensor-parallel size; the remaining devices are data parallel."""
    sp: int = 1
    """Context-parallel size (ring attention over the sequence); the mesh is dp x sp x tp."""
    sequence_parallel: bool = False
    """Also split activations between blocks over the sequence on the tp devices."""
    ep: int = 1
    """Expert-parallel size (MoE models: experts split over it); the mesh is dp x ep x sp x tp."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype (auto: float32 for presets, the checkpoint's dtype otherwise)."""
    attention: Literal["auto", "cudnn", "blockwise", "xla"] = "auto"
    remat: Literal["none", "full", "dots"] = "full"
    loss_chunk_size: int = 8192
    packing: Literal["pack", "pad"] = "pack"
    long_sequences: Literal["truncate", "error"] = "truncate"
    """In pad mode: truncate documents longer than seq_len+1 tokens, or stop with an error."""
    resume: bool = False
    """Continue from OUTPUT_DIR/checkpoint (same settings) where it stopped."""
    save_every: int = 50
    stop_after: int | None = None
    """Stop (after saving a checkpoint) once this many steps ran in this process, as a
    preempted job would; rerun with --resume to continue."""
    seed: int = 0
    progress: bool = True
    distributed: Annotated[DistributedArgs, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=DistributedArgs
    )
    """Multi-host: --coordinator-address, --num-processes, --process-id (or JAX_* env vars)."""


def main(args: Args) -> None:
    from eqx_tx.distributed import initialize

    initialize(args.distributed)  # before anything touches a device
    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer
    from tqdm.auto import tqdm

    import eqx_tx
    from eqx_tx.adapters import save_adapter
    from eqx_tx.checkpoint import read_metadata, restore_checkpoint, save_checkpoint
    from eqx_tx.data import TINY_STORIES, TINY_TOKENIZER, Examples, read_jsonl, tokenize
    from eqx_tx.distributed import global_batch, is_main_process, local_rows, to_host
    from eqx_tx.layers.lora import apply_lora, merge_lora
    from eqx_tx.presets import PRESETS, preset
    from eqx_tx.saving import tokenizer_files
    from eqx_tx.training import OptimizerConfig, TrainConfig, init_train_state, train_step

    main_process = is_main_process()
    for name in ("seq_len", "batch_size", "micro_batches", "steps", "tp", "sp", "ep", "save_every", "loss_chunk_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size % args.micro_batches:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --micro-batches {args.micro_batches}")

    mesh = eqx_tx.make_mesh(ep=args.ep, sp=args.sp, tp=args.tp)
    dp = mesh.shape["dp"] * mesh.shape["ep"]  # the batch is split over dp and ep
    if args.batch_size % (dp * args.micro_batches):
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by the batch-parallel size {dp} "
            f"({len(mesh.devices.flat)} devices / (sp {args.sp} x tp {args.tp})) x --micro-batches {args.micro_batches}"
        )
    dtype = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    is_preset = args.model in PRESETS
    if is_preset:
        config = preset(args.model)
        tokenizer_path = TINY_TOKENIZER if args.model == "tiny" else None
        source_dir = None
    else:
        if not os.path.isdir(args.model) and args.model.count("/") != 1:
            raise ValueError(
                f"--model {args.model!r} is not a preset ({', '.join(sorted(PRESETS))}), "
                "an existing directory, or a hub repo id"
            )
        source_dir = eqx_tx.loading.resolve_source(args.model)
        config = eqx_tx.config_from_hf(eqx_tx.models.config.read_hf_config(source_dir))
        tokenizer_path = os.path.join(source_dir, "tokenizer.json")
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )

    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path and os.path.isfile(tokenizer_path) else None
    records = read_jsonl(args.data or TINY_STORIES)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    docs = tokenize(records, tokenizer, eos)
    if max(max(d) for d in docs) >= config.vocab_size:
        raise ValueError(f"dataset has token ids >= the model's vocab_size {config.vocab_size}")
    examples = Examples(docs, args.seq_len, packing=args.packing, pad_id=eos or 0, long_sequences=args.long_sequences)
    if examples.truncated and main_process:
        print(f"note: truncated {examples.truncated} document(s) longer than {args.seq_len + 1} tokens")

    if is_preset:
        model = eqx_tx.init_model(config, key=jax.random.key(args.seed), dtype=dtype or jnp.float32, mesh=mesh)
    else:
        model = eqx_tx.load(source_dir, dtype=dtype, mesh=mesh, progress=args.progress)
    if args.lora_rank > 0:
        model = apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets,
                           key=jax.random.key(args.seed + 1))
        model = eqx_tx.shard(model, mesh)

    train_config = TrainConfig(
        optimizer=OptimizerConfig(
            learning_rate=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps,
            min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        ),
        micro_batches=args.micro_batches,
        loss_chunk_size=args.loss_chunk_size,
        compute=eqx_tx.ComputeConfig(attention=args.attention, remat=args.remat,
                                     sequence_parallel=args.sequence_parallel),
    )
    with jax.set_mesh(mesh):
        state = init_train_state(model, train_config)
    del model
    checkpoint_dir = os.path.join(args.output_dir, "checkpoint")
    run_meta = {
        "model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "lora_rank": args.lora_rank,
        "lora_targets": list(args.lora_targets), "data": os.path.abspath(args.data or TINY_STORIES), "seed": args.seed,
    }
    if args.resume:
        meta = read_metadata(checkpoint_dir)
        changed = {k: (meta.get(k), v) for k, v in run_meta.items() if meta.get(k) != v}
        if changed:
            raise ValueError(f"--resume with different settings than the checkpoint: {changed}")
        state, meta = restore_checkpoint(checkpoint_dir, state)
        if main_process:
            print(f"resumed from {checkpoint_dir} at step {meta['step']}")

    rows = local_rows(mesh, args.batch_size)  # this process's share of every batch
    start = int(to_host(state.step))
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=not (args.progress and main_process),
               desc="train")
    first_loss = last_loss = None
    t0 = None
    for step in bar:
        batch = global_batch(examples.batch(step, args.batch_size, seed=args.seed, rows=rows), mesh, args.batch_size)
        state, metrics = train_step(state, batch, train_config)
        if step == start:
            first_loss = float(to_host(metrics["loss"]))
            t0, t0_step = time.perf_counter(), step + 1  # exclude the compile step from tokens/s
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            loss = last_loss = float(to_host(metrics["loss"]))
            lr = float(to_host(metrics["learning_rate"]))
            done = step + 1 - t0_step
            rate = done * tokens_per_step / max(time.perf_counter() - t0, 1e-9) if done else 0.0
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}")
            if not args.progress and main_process:
                print(f"step {step + 1}: loss {loss:.4f} lr {lr:.2e} tokens/s {rate:,.0f}")
        stopping = args.stop_after is not None and step + 1 - start >= args.stop_after
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stopping:
            save_checkpoint(checkpoint_dir, state, metadata=dict(run_meta, data_position=step + 1))
        if stopping:
            if main_process:
                print(f"stopped after step {step + 1}; continue with --resume")
            return
    bar.close()

    final_dir = os.path.join(args.output_dir, "final")
    model = state.model
    if args.lora_rank > 0:
        save_adapter(model, os.path.join(args.output_dir, "adapter"), base_model_name_or_path=args.model)
        model = merge_lora(model)
    extra = tokenizer_files(source_dir)
    if tokenizer is not None:
        extra["tokenizer.json"] = tokenizer_path
    eqx_tx.save(model, final_dir, extra_files=extra)
    if main_process:
        if first_loss is not None:
            print(f"loss {first_loss:.4f} -> {last_loss:.4f}")
        print(f"saved {final_dir}" + (f" and {args.output_dir}/adapter" if args.lora_rank > 0 else ""))


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except (ValueError, FileNotFoundError, KeyError, NotADirectoryError, RuntimeError) as e:
        if os.environ.get("EQX_TX_DEBUG"):
            raise
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        sys.exit(2)
