"""eqx_tx vs Hugging Face transformers (PyTorch eager), and vs this machine's limits.

One process, same model, same CPU, float32. For each configuration (by default the
small Qwen3 at vocabulary 32000 with an untied head, and the same at Qwen3's real
vocabulary 151936 with a tied head):

- **limits**, measured here first: streaming bandwidth (best of numpy and jax sums of
  a 256 MiB array) and matmul peak (`jnp.dot` on the model's own training shapes);
- **train step** (forward, backward, AdamW): eqx_tx `remat="full"` vs HF with
  `gradient_checkpointing_enable()`, and `remat="none"` vs HF eager; model-FLOP
  utilisation (6 · matmul params · tokens + causal attention) of the matmul peak;
- **prefill / time to first token** of `prefill_batch` x `seq_len` prompts (last-token
  logits only on both sides: HF with `logits_to_keep=1`);
- **decode** tokens/s at each batch, greedy and top_k=20 / top_p=0.95 / temperature
  0.7; batch 1 against the bandwidth roofline (weight bytes read per token /
  bandwidth).

The last column bounds what any implementation could show against this HF run: the
ratio at 100% of the limit (train and prefill at the matmul peak, counting the
forward pass `remat="full"` runs twice; batch-1 decode at the bandwidth roofline).

Every figure is the median of `--repeats` timed runs after a warm-up, eqx_tx and HF
interleaved. Compilation is excluded (reported separately). The process runs with
the retaining allocator of `eqx_tx.analysis.host_memory` (as the tools do), which both sides
share; `EQX_TX_SYSTEM_MALLOC=1` runs with glibc's defaults instead.

    python benchmarks/benchmark_speed.py
"""

import dataclasses
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from model_flops import decode_bytes_per_token, prefill_flops, train_flops
from timing import median_times

import eqx_tx
from eqx_tx.analysis.host_memory import reexec_with_retaining_malloc, retaining_malloc_active
from eqx_tx.cache.allocate import new_cache
from eqx_tx.infer.generation import generate, prefill
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.train.training import Batch, OptimizerConfig, TrainConfig, init_train_state, train_step

SAMPLED = dict(temperature=0.7, top_k=20, top_p=0.95)


@dataclasses.dataclass
class Args:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    vocabs: tuple[int, ...] = (32000, 151936)
    """One configuration per vocabulary; the head is tied from 100k on (as Qwen3's small models)."""
    seq_len: int = 1024
    train_batch: int = 2
    prefill_batch: int = 4
    decode_prompt: int = 128
    decode_tokens: int = 64
    decode_batches: tuple[int, ...] = (1, 16)
    repeats: int = 3
    skip_train: bool = False


def bandwidth_gbs(repeats: int) -> float:
    """Streaming read bandwidth: the best of numpy and jax sums of a 256 MiB array."""
    host = np.ones(64 * 2**20, np.float32)
    device = jnp.asarray(host)
    total = jax.jit(jnp.sum)
    t = median_times({"numpy": lambda: host.sum(), "jax": lambda: total(device).block_until_ready()}, 3 * repeats)
    return host.nbytes / min(t.values()) / 1e9


def matmul_peak_gflops(cfg, tokens: int, repeats: int) -> float:
    """FLOP-weighted `jnp.dot` throughput on the model's training matmul shapes."""
    D, F, Q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    shapes = [(tokens, D, Q), (tokens, Q, D), (tokens, D, F), (tokens, F, D), (tokens, D, 4096)]
    dot = jax.jit(jnp.dot)
    flops, seconds = 0, 0.0
    for m, k, n in shapes:
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        t = median_times({"dot": lambda: dot(a, b).block_until_ready()}, 3 * repeats)["dot"]
        flops += 2 * m * k * n
        seconds += t
    return flops / seconds / 1e9


def measure(path: str, cfg, args: Args, rng) -> list[tuple]:
    """Rows `(measure, eqx value, HF value, unit, limit note)`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rows = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = eqx_tx.load(path, progress=False)
    if not args.skip_train:
        B, T = args.train_batch, args.seq_len
        ids = rng.integers(0, cfg.vocab_size, (B, T + 1))
        batch = Batch(jnp.asarray(ids[:, :-1], jnp.int32), jnp.asarray(ids[:, 1:], jnp.int32), jnp.ones((B, T)),
                      jnp.full((B,), T))
        ids_t = torch.as_tensor(ids)
        optim = torch.optim.AdamW(hf.parameters(), lr=1e-4)

        def hf_step():
            logits = hf(input_ids=ids_t[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids_t[:, 1:].reshape(-1))
            optim.zero_grad()
            loss.backward()
            optim.step()

        hf.train()
        for remat, checkpointing in (("full", True), ("none", False)):
            config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-4), compute=eqx_tx.ComputeConfig(remat=remat))
            state = [init_train_state(eqx_tx.load(path, progress=False), config)]

            def eqx_step():
                state[0], m = train_step(state[0], batch, config)
                jax.block_until_ready(m)

            t = time.perf_counter()
            eqx_step()
            compile_s = time.perf_counter() - t
            if checkpointing:
                hf.gradient_checkpointing_enable()
            else:
                hf.gradient_checkpointing_disable()
            t = median_times({"eqx": eqx_step, "hf": hf_step}, args.repeats)
            partner = "HF gradient checkpointing" if checkpointing else "HF eager"
            # remat="full" runs the forward pass twice: 8 of every 6 model FLOPs.
            executed = 8 / 6 if remat == "full" else 1.0
            rows.append((f"train remat={remat} tokens/s (vs {partner})", B * T / t["eqx"], B * T / t["hf"], "tok/s",
                         ("MFU", train_flops(cfg, B, T) / t["eqx"] / 1e9, train_flops(cfg, B, T) / t["hf"] / 1e9,
                          executed)))
            rows.append((f"train remat={remat} compile + first step (s)", compile_s, None, "s", None))
            del state
        hf.gradient_checkpointing_disable()
    hf.eval()
    # prefill: time to first token
    B, T = args.prefill_batch, args.seq_len
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    tokens_j, lengths = jnp.asarray(tokens, jnp.int32), jnp.full((B,), T, jnp.int32)
    tokens_t = torch.as_tensor(tokens)
    compute = eqx_tx.ComputeConfig()

    def eqx_prefill():
        cache = new_cache(ours.config, B, T, ours.dtype)
        jax.block_until_ready(prefill(ours, cache, tokens_j, lengths, chunk=T, compute=compute))

    def hf_prefill():
        with torch.no_grad():
            hf(input_ids=tokens_t, logits_to_keep=1, use_cache=True)

    t0 = time.perf_counter()
    eqx_prefill()
    compile_s = time.perf_counter() - t0
    t = median_times({"eqx": eqx_prefill, "hf": hf_prefill}, args.repeats)
    flops = prefill_flops(cfg, B, T)
    rows.append((f"time to first token, {B} x {T} prompts (ms)", 1e3 * t["eqx"], 1e3 * t["hf"], "ms",
                 ("MFU", flops / t["eqx"] / 1e9, flops / t["hf"] / 1e9, 1.0)))
    rows.append(("prefill compile + first (s)", compile_s, None, "s", None))
    # decode
    for b in args.decode_batches:
        prompts = rng.integers(0, cfg.vocab_size, (b, args.decode_prompt))
        prompt_t = torch.as_tensor(prompts)
        for label, sampling in (("greedy", {}), ("top_k=20 top_p=0.95 T=0.7", SAMPLED)):
            full = SamplingParams(max_new_tokens=args.decode_tokens, stop_token_ids=(), **sampling)
            one = SamplingParams(max_new_tokens=1, stop_token_ids=(), **sampling)

            def hf_gen(n):
                with torch.no_grad():
                    hf.generate(prompt_t, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                do_sample=bool(sampling), **sampling)

            t = median_times({"eqx_full": lambda: generate(ours, prompts.tolist(), full),
                               "eqx_one": lambda: generate(ours, prompts.tolist(), one),
                               "hf_full": lambda: hf_gen(args.decode_tokens), "hf_one": lambda: hf_gen(1)},
                              args.repeats)
            steps = args.decode_tokens - 1
            rate = lambda who: b * steps / (t[f"{who}_full"] - t[f"{who}_one"])  # noqa: E731
            rows.append((f"decode b={b} {label} tokens/s", rate("eqx"), rate("hf"), "tok/s",
                         ("roofline", decode_bytes_per_token(cfg, 4), None) if b == 1 else None))
    return rows


def main(args: Args) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"CPU ({os.cpu_count()} cores), float32, jax {jax.__version__}, torch {torch.__version__}; "
          f"median of {args.repeats}, eqx_tx and HF interleaved; "
          f"{'retaining' if retaining_malloc_active() else 'system'} malloc")
    for vocab in args.vocabs:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            hf_cfg = Qwen3Config(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                 num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                                 max_position_embeddings=4 * args.seq_len, tie_word_embeddings=vocab >= 100_000)
            Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp)
            cfg = eqx_tx.load(tmp, progress=False).config
            bandwidth = bandwidth_gbs(args.repeats)
            peak = matmul_peak_gflops(cfg, args.train_batch * args.seq_len, args.repeats)
            rows = measure(tmp, cfg, args, np.random.default_rng(0))
        print(f"\nQwen3 hidden {args.hidden}, {args.layers} layers, vocab {vocab} "
              f"({'tied' if cfg.tie_word_embeddings else 'untied'} head); train B={args.train_batch} x "
              f"T={args.seq_len}, decode {args.decode_tokens} tokens after {args.decode_prompt}")
        print(f"limits measured in this run: streaming bandwidth {bandwidth:.1f} GB/s, "
              f"matmul peak {peak:.0f} GFLOP/s (jnp.dot, the model's shapes at {args.train_batch * args.seq_len} rows)")
        print("| measure | eqx_tx | HF transformers | eqx_tx / HF | eqx_tx vs limit | HF vs limit | eqx_tx / HF at the limit |")
        print("|---|---|---|---|---|---|---|")
        greedy = {}
        for name, ours, theirs, unit, limit in rows:
            fmt = (lambda v: f"{v:,.1f}") if unit == "s" else (lambda v: f"{v:,.0f}")
            ratio = "-" if theirs is None else f"{(theirs / ours if unit == 'ms' else ours / theirs):.2f}x"
            # The last column: the ratio eqx_tx would show running at 100% of the limit
            # (every executed FLOP at the matmul peak; every weight byte at the bandwidth).
            lim_ours = lim_theirs = ceiling = "-"
            if limit is not None and limit[0] == "MFU":
                lim_ours, lim_theirs = f"{100 * limit[1] / peak:.0f}% MFU", f"{100 * limit[2] / peak:.0f}% MFU"
                ceiling = f"{peak / limit[3] / limit[2]:.2f}x"
            elif limit is not None:  # decode roofline: tokens/s at the bandwidth
                roof = bandwidth * 1e9 / limit[1]
                lim_ours, lim_theirs = f"{100 * ours / roof:.0f}% of {roof:.0f}", f"{100 * theirs / roof:.0f}%"
                ceiling = f"{roof / theirs:.2f}x"
            print(f"| {name} | {fmt(ours)} | {'-' if theirs is None else fmt(theirs)} | {ratio} | {lim_ours} | {lim_theirs} "
                  f"| {ceiling} |")
            if name.startswith("decode"):
                greedy[name] = ours
        for b in args.decode_batches:
            g = greedy[f"decode b={b} greedy tokens/s"]
            s = greedy[f"decode b={b} top_k=20 top_p=0.95 T=0.7 tokens/s"]
            print(f"eqx_tx decode b={b}: a top_k/top_p step takes {g / s:.2f}x a greedy step")


if __name__ == "__main__":
    reexec_with_retaining_malloc()
    main(tyro.cli(Args))
