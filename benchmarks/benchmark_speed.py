"""eqx_tx vs Hugging Face transformers (PyTorch), same model, same CPU, float32.

Train-step tokens/s (forward + backward + AdamW), prefill tokens/s (last-token
logits only on both sides: HF with `logits_to_keep=1`), and greedy decode tokens/s
at batch 1 and 16. Throughput excludes compilation (reported separately); each
figure is the best of `--repeats` timed runs after a warm-up.

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

import eqx_tx
from eqx_tx.generation import generate, prefill
from eqx_tx.models.transformer import new_cache
from eqx_tx.sampling import SamplingParams
from eqx_tx.training import Batch, OptimizerConfig, TrainConfig, init_train_state, train_step


@dataclasses.dataclass
class Args:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 32000
    seq_len: int = 1024
    train_batch: int = 2
    prefill_batch: int = 4
    decode_prompt: int = 128
    decode_tokens: int = 64
    decode_batches: tuple[int, ...] = (1, 16)
    repeats: int = 2


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def eqx_figures(path, args: Args, rng) -> dict:
    out = {}
    compute = eqx_tx.ComputeConfig()
    ids = jnp.asarray(rng.integers(0, args.vocab, (args.train_batch, args.seq_len + 1)), jnp.int32)
    batch = Batch(ids[:, :-1], ids[:, 1:], jnp.ones((args.train_batch, args.seq_len)),
                  jnp.full((args.train_batch,), args.seq_len))
    # train step: the memory-first defaults, then without per-layer recomputation
    for label, train_compute in [("train", compute), ("train, remat=none", eqx_tx.ComputeConfig(remat="none"))]:
        config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-4), compute=train_compute)
        holder = [init_train_state(eqx_tx.load(path, progress=False), config)]

        def step():
            holder[0], m = train_step(holder[0], batch, config)
            jax.block_until_ready(m)

        t = time.perf_counter()
        step()
        out[f"{label} compile+first (s)"] = time.perf_counter() - t
        out[f"{label} tokens/s"] = args.train_batch * args.seq_len / best(step, args.repeats)
    model = eqx_tx.load(path, progress=False)
    # prefill
    B, T = args.prefill_batch, args.seq_len
    tokens = jnp.asarray(rng.integers(0, args.vocab, (B, T)), jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32)

    def run_prefill():
        cache = new_cache(model.config, B, T, model.dtype)
        jax.block_until_ready(prefill(model, cache, tokens, lengths, chunk=T, compute=compute))

    t = time.perf_counter()
    run_prefill()
    out["prefill compile+first (s)"] = time.perf_counter() - t
    out["prefill tokens/s"] = B * T / best(run_prefill, args.repeats)
    # decode
    for b in args.decode_batches:
        prompts = rng.integers(0, args.vocab, (b, args.decode_prompt)).tolist()
        params = SamplingParams(max_new_tokens=args.decode_tokens, stop_token_ids=())
        short = SamplingParams(max_new_tokens=1, stop_token_ids=())
        generate(model, prompts, params)  # compile
        generate(model, prompts, short)
        full = best(lambda: generate(model, prompts, params), args.repeats)
        first = best(lambda: generate(model, prompts, short), args.repeats)
        out[f"decode b={b} tokens/s"] = b * (args.decode_tokens - 1) / (full - first)
    return out


def hf_figures(path, args: Args, rng) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    out = {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.as_tensor(rng.integers(0, args.vocab, (args.train_batch, args.seq_len + 1)))

    def step():
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()

    model.train()
    step()
    out["train tokens/s"] = args.train_batch * args.seq_len / best(step, args.repeats)
    model.eval()
    tokens = torch.as_tensor(rng.integers(0, args.vocab, (args.prefill_batch, args.seq_len)))

    def run_prefill():
        with torch.no_grad():
            model(input_ids=tokens, logits_to_keep=1, use_cache=True)

    run_prefill()
    out["prefill tokens/s"] = args.prefill_batch * args.seq_len / best(run_prefill, args.repeats)
    for b in args.decode_batches:
        prompt = torch.as_tensor(rng.integers(0, args.vocab, (b, args.decode_prompt)))

        def gen(n):
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        gen(2)
        full = best(lambda: gen(args.decode_tokens), args.repeats)
        first = best(lambda: gen(1), args.repeats)
        out[f"decode b={b} tokens/s"] = b * (args.decode_tokens - 1) / (full - first)
    return out


def main(args: Args) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                          max_position_embeddings=4 * args.seq_len)
        Qwen3ForCausalLM(cfg).save_pretrained(tmp)
        ours = eqx_figures(tmp, args, np.random.default_rng(0))
        theirs = hf_figures(tmp, args, np.random.default_rng(0))
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, CPU "
          f"({os.cpu_count()} cores); train B={args.train_batch} x T={args.seq_len}, "
          f"prefill B={args.prefill_batch} x T={args.seq_len}, decode {args.decode_tokens} tokens "
          f"after {args.decode_prompt}")
    print("| measure | eqx_tx | HF transformers | eqx_tx / HF |")
    print("|---|---|---|---|")
    for key, value in theirs.items():
        print(f"| {key} | {ours[key]:,.0f} | {value:,.0f} | {ours[key] / value:.2f} |")
    key = "train, remat=none tokens/s"
    print(f"| {key} | {ours[key]:,.0f} | {theirs['train tokens/s']:,.0f} | {ours[key] / theirs['train tokens/s']:.2f} |")
    for key in ("train compile+first (s)", "prefill compile+first (s)"):
        print(f"| {key} | {ours[key]:.1f} | - | - |")


if __name__ == "__main__":
    main(tyro.cli(Args))
