"""On an accelerator: bf16 decode against the bandwidth roofline, and training MFU.

A model of a preset's shape (default `qwen3-0.6b`), random weights in bfloat16 (no
checkpoint needed), everything measured in one process:

- **limits**: memory bandwidth (the best of sums and a copy of 1 GiB arrays) and
  matmul peak (bf16 products of the model's own training shapes), printed beside
  the chip's data-sheet figures where the chip is known (on a TPU v5e XLA's sums and
  copies reach only ~540 of its 819 GB/s, less than decode itself reads at: there
  the data-sheet roofline is the one to read);
- **decode**: tokens/s of `generate` at each batch (a step is the time of `n` new
  tokens less that of one, over `n - 1`: prefill and the host's work cancel), and
  at batch 1 the share of the bandwidth roofline: the bytes a step must read (every
  weight once, the keys and values cached so far) at the measured bandwidth;
- **prefill**: time to first token (`generate` of one new token) of `B` prompts of
  `T` tokens, with each attention of `prefill_attentions`, and its model-FLOP
  utilisation (forward pass, last-token logits);
- **train**: tokens/s of `train_step` (AdamW on bf16 weights, chunked loss) at each
  remat policy and attention implementation, and model-FLOP utilisation
  (6 · matmul params · tokens + causal attention, `model_flops.py`) of the measured
  matmul peak and of the data sheet. A setting that does not fit is reported as such.

Every figure is the median of `--repeats` timed runs after a warm-up; compilation is
excluded. Exits with a message on a CPU (`benchmark_speed.py` measures that, against
Hugging Face). Rows are printed (and appended to `--out`) as they are measured.

    python benchmarks/accelerator_speed.py --out benchmarks/results/accelerator_tpu_v5e.md
"""

import dataclasses
import itertools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from decode_batch_probe import traced
from model_flops import decode_bytes_per_token, matmul_params, prefill_flops, train_flops
from timing import median_times

import eqx_tx
from eqx_tx.infer.sampling import SamplingParams
from eqx_tx.models.presets import preset
from eqx_tx.train.training import Batch, OptimizerConfig, TrainConfig, init_train_state, train_step

# Data-sheet bf16 dense matmul peak (TFLOP/s) and memory bandwidth (GB/s), by a
# substring of `jax.Device.device_kind` (the first that matches).
DATA_SHEET = {
    "H100 PCIe": (756.0, 2000.0),
    "A100-SXM4-80GB": (312.0, 2039.0),
    "TPU v5 lite": (197.0, 819.0),
    "TPU v5p": (459.0, 2765.0),
    "TPU v4": (275.0, 1228.0),
    "H100": (989.0, 3350.0),
    "H200": (989.0, 4800.0),
    "A100": (312.0, 1555.0),
}
SAMPLED: dict[str, Any] = dict(temperature=0.7, top_k=20, top_p=0.95)


@dataclasses.dataclass
class Args:
    preset: str = "qwen3-0.6b"
    """Model shape (`eqx_tx.models.presets`); the weights are random."""
    decode_batches: tuple[int, ...] = (1, 16)
    decode_prompt: int = 128
    decode_tokens: int = 128
    decode_layers: tuple[str, ...] = ("auto",)
    """`ComputeConfig.decode_layers` settings to measure."""
    profile_dir: str | None = None
    """Write `jax.profiler` traces (with a Perfetto `perfetto_trace.json.gz`) of one
    batch-1 greedy decode, of one call of each prefill setting (its device ops that
    took the most time are reported) and of one step of the first train setting here."""
    prefill_batches: tuple[int, ...] = (1, 4)
    prefill_lens: tuple[int, ...] = (2048, 8192)
    prefill_attentions: tuple[str, ...] = ("auto", "blockwise")
    train_batches: tuple[int, ...] = (4,)
    train_seq_len: int = 2048
    remats: tuple[str, ...] = ("full", "dots")
    remat_names: tuple[str, ...] = ("attention",)
    """What `remat="names"` keeps (`eqx_tx.core.compute.CHECKPOINT_NAMES`)."""
    attentions: tuple[str, ...] = ("auto", "xla")
    tiles: tuple[int, ...] = ()
    """Attention tile sizes (block_q = block_kv) to train each tiled attention of
    `attentions` (not xla or cudnn) with, besides the platform's default
    (`eqx_tx.kernels.dispatch.DEFAULT_BLOCKS`)."""
    repeats: int = 5
    out: str | None = None
    """Also append the report to this markdown file."""


class Report:
    """Lines printed at once (flushed) and appended to a file, so a run cut short keeps
    what it measured."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def data_sheet(kind: str) -> tuple[float, float] | None:
    return next((v for k, v in DATA_SHEET.items() if k in kind), None)


def bandwidth_gbs(repeats: int) -> tuple[float, str]:
    """Memory bandwidth: the best of reading a 1 GiB array (summed, bf16 and f32) and
    copying one (`x + 1`: 0.5 GiB read and written); the best figure and every
    probe's, as text. One probe's array is alive at a time."""
    n = 2**29
    probes = {
        "sum bf16": (lambda a: jnp.sum(a, dtype=jnp.float32), (n,), jnp.bfloat16),
        "sum f32": (jnp.sum, (n // 2,), jnp.float32),
        "copy bf16": (lambda a: a + 1, (n // 2,), jnp.bfloat16),
    }
    rates = {}
    for name, (fn, shape, dtype) in probes.items():
        fn, x = jax.jit(fn), jnp.ones(shape, dtype)
        fn(x).block_until_ready()
        best = float("inf")
        for _ in range(3 * repeats):
            t = time.perf_counter()
            fn(x).block_until_ready()
            best = min(best, time.perf_counter() - t)
        rates[name] = 2 * n / best / 1e9
        del x
    return max(rates.values()), ", ".join(f"{k} {v:.0f}" for k, v in rates.items())


def matmul_peak_tflops(cfg, tokens: int, repeats: int) -> float:
    """FLOP-weighted bf16 matmul throughput on the model's training shapes (`tokens`
    rows), eight products of each shape per call so that dispatch does not count."""
    D, F, Q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    shapes = [(tokens, D, Q), (tokens, Q, D), (tokens, D, F), (tokens, F, D), (tokens, D, cfg.vocab_size // 8)]
    products = jax.jit(lambda a, b: jax.lax.map(lambda x: x @ b, a))
    flops, seconds = 0, 0.0
    for m, k, n in shapes:
        a, b = jnp.ones((8, m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
        t = median_times({"dot": lambda: products(a, b).block_until_ready()}, 3 * repeats)["dot"]
        flops += 8 * 2 * m * k * n
        seconds += t
    return flops / seconds / 1e12


def decode_rows(model, cfg, args: Args, bandwidth: float, sheet: tuple[float, float] | None, report: Report) -> None:
    rng = np.random.default_rng(0)
    report("| decode | tokens/s | ms/step | % of measured bandwidth roofline | % of data-sheet roofline |")
    report("|---|---|---|---|---|")
    mean_kv = args.decode_prompt + args.decode_tokens // 2
    need = decode_bytes_per_token(cfg, 2, kv_length=mean_kv, kv_bytes=2)
    for layers in args.decode_layers:
        compute = eqx_tx.ComputeConfig(decode_layers=layers)  # type: ignore[arg-type]
        for b in args.decode_batches:
            prompts = rng.integers(0, cfg.vocab_size, (b, args.decode_prompt)).tolist()
            for label, sampling in (("greedy", {}), ("top_k=20 top_p=0.95 T=0.7", SAMPLED)):
                full = SamplingParams(max_new_tokens=args.decode_tokens, stop_token_ids=(), **sampling)
                one = SamplingParams(max_new_tokens=1, stop_token_ids=(), **sampling)
                t = median_times({"full": lambda: eqx_tx.generate(model, prompts, full, compute=compute),
                                  "one": lambda: eqx_tx.generate(model, prompts, one, compute=compute)}, args.repeats)
                step = (t["full"] - t["one"]) / (args.decode_tokens - 1)
                roof = sheet_roof = "-"
                if b == 1:
                    roof = f"{100 * need / step / (bandwidth * 1e9):.0f}% ({need / 1e9:.2f} GB/step: {need / bandwidth / 1e6:.2f} ms)"
                    if sheet is not None:
                        sheet_roof = f"{100 * need / step / (sheet[1] * 1e9):.0f}%"
                report(f"| b={b} {label}, decode_layers={layers} | {b / step:,.0f} | {1e3 * step:.2f} | {roof} | {sheet_roof} |")
                if b == 1 and not sampling and args.profile_dir is not None and layers == args.decode_layers[0]:
                    with jax.profiler.trace(f"{args.profile_dir}/decode", create_perfetto_trace=True):
                        eqx_tx.generate(model, prompts, full, compute=compute)


def prefill_rows(model, cfg, args: Args, peak: float, sheet: tuple[float, float] | None, report: Report) -> None:
    report("| time to first token | ms | prompt tokens/s | MFU of measured peak | MFU of data sheet |")
    report("|---|---|---|---|---|")
    one = SamplingParams(max_new_tokens=1, stop_token_ids=())
    for T, B, attention in itertools.product(args.prefill_lens, args.prefill_batches, args.prefill_attentions):
        prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (B, T)).tolist()
        compute = eqx_tx.ComputeConfig(attention=attention)  # type: ignore[arg-type]
        name = f"B={B} x T={T} attention={attention}"
        try:
            seconds = median_times({"ttft": lambda: eqx_tx.generate(model, prompts, one, compute=compute)},
                                   args.repeats)["ttft"]
        except Exception as e:  # out of device memory, chiefly: report it and go on
            report(f"| {name} | did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | |")
            continue
        tflops = prefill_flops(cfg, B, T) / seconds / 1e12
        sheet_mfu = "-" if sheet is None else f"{100 * tflops / sheet[0]:.0f}%"
        report(f"| {name} | {1e3 * seconds:,.1f} | {B * T / seconds:,.0f} | {100 * tflops / peak:.0f}% | {sheet_mfu} |")
        if args.profile_dir is not None:
            path, top = traced(f"{args.profile_dir}/prefill_{B}x{T}_{attention}",
                               lambda: eqx_tx.generate(model, prompts, one, compute=compute), 20)
            if path is not None:
                report(f"|   device ops of one call (ms): {', '.join(f'{op} {ms:.1f}' for op, ms in top)} | | | | |")


def train_rows(cfg, args: Args, peak: float, sheet: tuple[float, float] | None, report: Report) -> None:
    T = args.train_seq_len
    report(f"| train, T={T} | tokens/s | step (ms) | MFU of measured peak | MFU of data sheet | compile (s) |")
    report("|---|---|---|---|---|---|")
    tiled = [a for a in args.attentions if a not in ("xla", "cudnn")]
    settings = [(a, None) for a in args.attentions] + [(a, tile) for a in tiled for tile in args.tiles]
    for B in args.train_batches:
        ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T + 1))
        batch = Batch(jnp.asarray(ids[:, :-1], jnp.int32), jnp.asarray(ids[:, 1:], jnp.int32), jnp.ones((B, T)),
                      jnp.full((B,), T, jnp.int32))
        flops = train_flops(cfg, B, T)
        for remat, (attention, tile) in itertools.product(args.remats, settings):
            names = args.remat_names if remat == "names" else ()
            compute = eqx_tx.ComputeConfig(remat=remat, remat_names=names, attention=attention, block_q=tile,  # type: ignore[arg-type]
                                           block_kv=tile)
            config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-5), compute=compute)
            name = (f"B={B} remat={remat}" + (f"({','.join(names)})" if names else "") + f" attention={attention}"
                    + ("" if tile is None else f" tiles {tile}x{tile}"))
            # a fresh model each time: train_step donates (and so deletes) the weights
            state = [init_train_state(eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16), config)]

            def step():
                state[0], metrics = train_step(state[0], batch, config)
                jax.block_until_ready(metrics)

            try:
                t0 = time.perf_counter()
                step()
                compile_s = time.perf_counter() - t0
                seconds = median_times({"step": step}, args.repeats)["step"]
                if args.profile_dir is not None and (B, remat, attention, tile) == (
                        args.train_batches[0], args.remats[0], *settings[0]):
                    with jax.profiler.trace(f"{args.profile_dir}/train", create_perfetto_trace=True):
                        step()
            except Exception as e:  # out of device memory, chiefly: report it and go on
                report(f"| {name} | did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | | |")
                continue
            finally:
                del state[:]
            sheet_mfu = "-" if sheet is None else f"{100 * flops / seconds / 1e12 / sheet[0]:.0f}%"
            report(f"| {name} | {B * T / seconds:,.0f} | {1e3 * seconds:.0f} | "
                   f"{100 * flops / seconds / 1e12 / peak:.0f}% | {sheet_mfu} | {compile_s:.0f} |")


def main(args: Args) -> None:
    device = jax.devices()[0]
    if device.platform == "cpu":
        print("no accelerator here (JAX backend: cpu); benchmarks/benchmark_speed.py measures the CPU",
              file=sys.stderr)
        sys.exit(2)
    eqx_tx.enable_console_logging()  # which attention path and decode layout ran, and why
    report = Report(args.out)
    cfg = preset(args.preset)
    sheet = data_sheet(device.device_kind)
    model = eqx_tx.init_model(cfg, key=jax.random.key(0), dtype=jnp.bfloat16)
    params = matmul_params(cfg, head=True)
    bandwidth, probes = bandwidth_gbs(args.repeats)
    rows = max(args.train_batches, default=4) * args.train_seq_len
    peak = matmul_peak_tflops(cfg, rows, args.repeats)
    report(f"\n## {args.preset} ({params / 1e9:.2f} B matmul params), bfloat16, on {device.device_kind} "
           f"({jax.device_count()} device(s), jax {jax.__version__}); median of {args.repeats}")
    sheet_note = "" if sheet is None else f" (data sheet: {sheet[1]:.0f} GB/s, {sheet[0]:.0f} TFLOP/s)"
    report(f"measured in this run: memory bandwidth {bandwidth:.0f} GB/s (best of: {probes} GB/s), bf16 matmul peak {peak:.0f} TFLOP/s "
           f"on the model's shapes at {rows} rows{sheet_note}\n")
    decode_rows(model, cfg, args, bandwidth, sheet, report)
    report()
    prefill_rows(model, cfg, args, peak, sheet, report)
    del model
    report()
    train_rows(cfg, args, peak, sheet, report)


if __name__ == "__main__":
    main(tyro.cli(Args))
