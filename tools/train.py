"""Fine-tune (full or LoRA) or train from scratch, with resumable checkpoints.

With no arguments: trains the `tiny` Qwen3 preset from scratch on the stories
shipped in the package (about a minute on 2 CPU cores) and writes a Hugging Face
checkpoint to `runs/tiny/final`, which `tools/sample.py` samples from by default.

    python tools/train.py
    python tools/train.py --model Qwen/Qwen3-0.6B --data my.jsonl --lora-rank 32 --tp 8

The optimizer, micro-batching, LM-head chunking and compute flags (`--learning-rate`,
`--total-steps`, `--micro-batches`, `--remat`, `--attention`, ...) are the fields of
the library's own `TrainConfig`, `OptimizerConfig` and `ComputeConfig`.
"""

import dataclasses
import os
import time
from typing import Annotated, Literal

import tyro

from eqx_tx.cli import StopSignals, check_output_dir, check_resume, run_tool
from eqx_tx.core.distributed import DistributedArgs
from eqx_tx.layers.lora import ALL_TARGETS
from eqx_tx.train.data import LongSequences, Packing
from eqx_tx.train.training import OptimizerConfig, TrainConfig

# The tiny preset's run: 150 steps at 3e-3 learn the shipped stories in about a minute.
DEFAULT_TRAIN = TrainConfig(optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=10, total_steps=150))


@dataclasses.dataclass
class Args:
    model: str = "tiny"
    """A preset name (tiny, qwen3-4b, ...: random init), a local HF directory, or a hub repo id."""
    data: str | None = None
    """jsonl with a 'text', 'input_ids' or 'messages' (a chat: loss on the assistant's tokens) field per line;
    'arithmetic': the facts of tools/grpo.py's built-in task as text; None: the tiny stories shipped in the package."""
    output_dir: str = "runs/tiny"
    """Checkpoints go to OUTPUT_DIR/checkpoint, the final HF model to OUTPUT_DIR/final."""
    seq_len: int = 128
    """Tokens per training row."""
    batch_size: int = 16
    """Rows per optimizer step (split over the data-parallel devices and micro-batches)."""
    train: Annotated[TrainConfig, tyro.conf.OmitArgPrefixes, tyro.conf.AvoidSubcommands] = DEFAULT_TRAIN
    """The training step (cross entropy: tools/grpo.py trains the policy losses); the run lasts --total-steps steps."""
    lora_rank: int = 0
    """0 = full fine-tune; > 0 trains LoRA adapters of this rank on a frozen base."""
    lora_alpha: float = 16.0
    """LoRA scale numerator (scaling = alpha / rank)."""
    lora_targets: tuple[str, ...] = ALL_TARGETS
    """Projections that get adapters."""
    tp: int = 1
    """Tensor-parallel size; the remaining devices are data parallel."""
    sp: int = 1
    """Context-parallel size (ring attention over the sequence); the mesh is dp x sp x tp."""
    ep: int = 1
    """Expert-parallel size (MoE models: experts split over it); the mesh is dp x ep x sp x tp."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype (auto: float32 for presets, the checkpoint's dtype otherwise)."""
    packing: Packing = "segments"
    """segments: whole documents packed into rows with segment ids (each attends only to
    itself, as if alone; longer ones split); pack: documents joined with the end-of-text
    token and cut into windows (pretraining style, attention crosses documents); pad: one
    document per row."""
    long_sequences: LongSequences = "truncate"
    """In pad mode: truncate documents longer than seq_len+1 tokens, or stop with an error."""
    resume: bool = False
    """Continue from OUTPUT_DIR/checkpoint (same settings) where it stopped."""
    overwrite: bool = False
    """Write into an OUTPUT_DIR that already holds files (another run's are replaced)."""
    save_every: int = 50
    """Steps between checkpoints (one is always written at the end)."""
    stop_after: int | None = None
    """Stop (after saving a checkpoint) once this many steps ran in this process, as a
    preempted job would; rerun with --resume to continue."""
    seed: int = 0
    """Initialisation, adapter and data-order seed."""
    progress: bool = True
    """Show a progress bar (else print every 10 steps)."""
    distributed: Annotated[DistributedArgs, tyro.conf.OmitArgPrefixes] = dataclasses.field(
        default_factory=DistributedArgs
    )
    """Multi-host: --coordinator-address, --num-processes, --process-id (or JAX_* env vars)."""

    @property
    def steps(self) -> int:
        return self.train.optimizer.total_steps


def _check(args: Args) -> None:
    for name in ("seq_len", "batch_size", "tp", "sp", "ep", "save_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tune), got {args.lora_rank}")
    if args.lora_rank > 0 and not args.lora_alpha > 0:
        raise ValueError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    check_output_dir(args.output_dir, resume=args.resume, overwrite=args.overwrite)


def _source(args: Args):
    """The model's config, its checkpoint directory (None for a preset) and its
    `tokenizer.json` (None if there is none)."""
    import eqx_tx
    from eqx_tx.io.loading import resolve_source
    from eqx_tx.models.config import read_hf_config
    from eqx_tx.models.presets import PRESETS, preset
    from eqx_tx.train.data import TINY_TOKENIZER

    if args.model in PRESETS:
        return preset(args.model), None, TINY_TOKENIZER if args.model == "tiny" else None
    try:
        directory = resolve_source(args.model)
    except FileNotFoundError as e:
        raise ValueError(f"--model {args.model!r} is not a preset ({', '.join(sorted(PRESETS))}): {e}") from None
    tokenizer_path = os.path.join(directory, "tokenizer.json")
    config = eqx_tx.config_from_hf(read_hf_config(directory))
    return config, directory, tokenizer_path if os.path.isfile(tokenizer_path) else None


def _examples(args: Args, config, tokenizer, main_process: bool):
    from eqx_tx.rl import arithmetic_facts
    from eqx_tx.train.data import TINY_STORIES, Examples, max_token_id, read_jsonl, tokenize

    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    if args.data == "arithmetic":  # a warm start for tools/grpo.py: each fact written out, many times over
        records = [{"text": f["prompt"] + f["answer"]} for f in arithmetic_facts()] * 40
    else:
        records = read_jsonl(args.data or TINY_STORIES)
    docs = tokenize(records, tokenizer, eos)
    if max_token_id(docs) >= config.vocab_size:
        raise ValueError(f"dataset has token ids >= the model's vocab_size {config.vocab_size}")
    examples = Examples(docs, args.seq_len, packing=args.packing, pad_id=eos or 0, long_sequences=args.long_sequences)
    if examples.truncated and main_process:
        print(f"note: truncated {examples.truncated} document(s) longer than {args.seq_len + 1} tokens")
    if examples.split and main_process:
        print(f"note: split {examples.split} document(s) longer than {args.seq_len + 1} tokens over several rows "
              "(each piece attends only to itself)")
    if main_process:
        print(f"data: {len(examples)} rows of {args.seq_len} tokens ({args.packing}), "
              f"{100 * examples.padding_fraction:.1f}% padding")
    return examples


def _model(args: Args, config, source_dir, mesh):
    import jax
    import jax.numpy as jnp

    import eqx_tx

    dtype = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    if source_dir is None:
        model = eqx_tx.init_model(config, key=jax.random.key(args.seed), dtype=dtype or jnp.float32, mesh=mesh)
    else:
        model = eqx_tx.load(source_dir, dtype=dtype, mesh=mesh, progress=args.progress)
    if args.lora_rank > 0:
        model = eqx_tx.apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets,
                                  key=jax.random.key(args.seed + 1))
        model = eqx_tx.shard(model, mesh)
    return model


def _run_metadata(args: Args) -> dict:
    from eqx_tx.train.data import TINY_STORIES

    data = args.data if args.data == "arithmetic" else os.path.abspath(args.data or TINY_STORIES)
    return {
        "model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "lora_rank": args.lora_rank,
        "lora_targets": list(args.lora_targets), "data": data, "seed": args.seed,
    }


def _train(args: Args, state, examples, mesh, checkpoint_dir: str, main_process: bool):
    """The step loop. **Returns** the final state, or `None` after `--stop-after`.

    Every step's loss and learning rate go to OUTPUT_DIR/metrics.jsonl (read from the
    device every 10 steps, so the loop does not wait for each step) and the curve to
    OUTPUT_DIR/loss.svg. Tokens/s are measured after the first step of this process,
    whose time is the compilation's and reported apart. SIGINT or SIGTERM finish the
    step, save a checkpoint and exit with how to resume."""
    from tqdm.auto import tqdm

    from eqx_tx.core.distributed import global_batch, local_rows, to_host
    from eqx_tx.core.runlog import MetricsLog, write_line_chart
    from eqx_tx.train.checkpoint import save_checkpoint
    from eqx_tx.train.training import train_step

    rows = local_rows(mesh, args.batch_size)  # this process's share of every batch
    start = int(to_host(state.step))
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=not (args.progress and main_process),
               desc="train")
    log = MetricsLog(os.path.join(args.output_dir, "metrics.jsonl"), start=start)
    pending: list[tuple[int, dict]] = []  # steps whose metrics are still on the device
    first_loss = last_loss = None
    t0, t0_step = time.perf_counter(), start

    def record(step: int) -> float:
        """Bring the pending metrics to the host, log them, and return tokens/s so far."""
        nonlocal last_loss
        values = [(s_, {k: float(to_host(v)) for k, v in metrics.items()}) for s_, metrics in pending]  # (waits)
        done = step + 1 - t0_step
        rate = done * tokens_per_step / max(time.perf_counter() - t0, 1e-9) if done > 0 else 0.0
        for s_, metrics in values:
            last_loss = metrics["loss"]
            log.add({"step": s_, "loss": last_loss, "learning_rate": metrics["learning_rate"],
                     "grad_norm": metrics.get("grad_norm"), "tokens_per_s": rate if s_ >= t0_step else None})
        pending.clear()
        if main_process:
            log.flush()
            write_line_chart(os.path.join(args.output_dir, "loss.svg"), {"loss": ("steelblue", log.series("loss"))},
                             title="training loss")
        return rate

    with StopSignals() as stop:
        for step in bar:
            batch = global_batch(examples.batch(step, args.batch_size, seed=args.seed, rows=rows), mesh,
                                 args.batch_size)
            state, metrics = train_step(state, batch, args.train)
            pending.append((step, metrics))
            if step == start:
                first_loss = float(to_host(metrics["loss"]))  # (waits for the step: compile + one step)
                compile_seconds = time.perf_counter() - t0
                t0, t0_step = time.perf_counter(), step + 1  # tokens/s from the next step on
                if main_process:
                    bar.write(f"first step {compile_seconds:.1f} s (compilation included; tokens/s counts the "
                              "steps after it)")
            stopping = args.stop_after is not None and step + 1 - start >= args.stop_after
            interrupted = stop.received is not None
            if (step + 1) % 10 == 0 or step + 1 == args.steps or stopping or interrupted:
                rate = record(step)
                lr = log.rows[-1]["learning_rate"]
                steady = f"{rate:,.0f}" if step + 1 > t0_step else "-"
                bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{lr:.2e}", tok_s=steady)
                if not args.progress and main_process:
                    print(f"step {step + 1}: loss {last_loss:.4f} lr {lr:.2e} tokens/s {steady}")
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stopping or interrupted:
                save_checkpoint(checkpoint_dir, state, metadata=dict(_run_metadata(args), data_position=step + 1))
            if interrupted:
                bar.close()
                stop.exit(step + 1, checkpoint_dir)
            if stopping:
                if main_process:
                    print(f"stopped after step {step + 1}; continue with --resume")
                return None
    bar.close()
    if main_process and first_loss is not None:
        print(f"loss {first_loss:.4f} -> {last_loss:.4f}")
    return state


def _export(args: Args, model, source_dir, tokenizer_path, main_process: bool) -> None:
    """The final HF checkpoint (LoRA: merged, plus the PEFT adapter)."""
    import eqx_tx
    from eqx_tx.io.saving import tokenizer_files
    from eqx_tx.train.data import TINY_CHAT_TEMPLATE, TINY_TOKENIZER

    final_dir = os.path.join(args.output_dir, "final")
    if args.lora_rank > 0:
        eqx_tx.save_adapter(model, os.path.join(args.output_dir, "adapter"), base_model_name_or_path=args.model)
        model = eqx_tx.merge_lora(model)
    extra = tokenizer_files(source_dir)
    if tokenizer_path is not None:
        extra["tokenizer.json"] = tokenizer_path
    if tokenizer_path == TINY_TOKENIZER:  # the tiny preset: a plain-text chat format, so --chat can be tried
        extra["chat_template.jinja"] = TINY_CHAT_TEMPLATE
    eqx_tx.save(model, final_dir, extra_files=extra)
    if main_process:
        print(f"saved {final_dir}" + (f" and {args.output_dir}/adapter" if args.lora_rank > 0 else ""))


def main(args: Args) -> None:
    from eqx_tx.core.distributed import initialize

    initialize(args.distributed)  # before anything touches a device
    import jax

    import eqx_tx
    from eqx_tx.core.distributed import is_main_process
    from eqx_tx.infer.text import Tokenizer
    from eqx_tx.train.checkpoint import has_checkpoint, restore_checkpoint

    eqx_tx.enable_console_logging()
    main_process = is_main_process()
    _check(args)
    mesh = eqx_tx.make_mesh(ep=args.ep, sp=args.sp, tp=args.tp)
    args.train.check_batch(args.batch_size, mesh.shape["dp"] * mesh.shape["ep"])  # the batch splits over dp x ep
    config, source_dir, tokenizer_path = _source(args)
    if args.seq_len > config.max_position_embeddings and not config.rope.extends_past_max_position:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    if source_dir is not None and tokenizer_path is not None:
        tokenizer = Tokenizer.from_directory(source_dir)  # with its chat template, for 'messages' records
    else:
        tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path is not None else None
    examples = _examples(args, config, tokenizer, main_process)
    model = _model(args, config, source_dir, mesh)
    with jax.set_mesh(mesh):
        state = eqx_tx.init_train_state(model, args.train)
    del model
    checkpoint_dir = os.path.join(args.output_dir, "checkpoint")
    if args.resume and has_checkpoint(checkpoint_dir):
        check_resume(checkpoint_dir, _run_metadata(args))
        state, meta = restore_checkpoint(checkpoint_dir, state)
        if main_process:
            print(f"resumed from {checkpoint_dir} at step {meta['step']}")
    elif args.resume and main_process:
        print(f"--resume: no checkpoint in {checkpoint_dir} yet; starting at step 0")
    os.makedirs(args.output_dir, exist_ok=True)
    state = _train(args, state, examples, mesh, checkpoint_dir, main_process)
    if state is not None:
        _export(args, state.model, source_dir, tokenizer_path, main_process)


if __name__ == "__main__":
    run_tool(main, Args)
