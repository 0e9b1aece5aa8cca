#!/usr/bin/env bash
# The Tinker API's figures on one TPU chip (benchmarks/results/tinker_api_tpu_v5e.md): the
# adapter bank's device bytes with the moments on the device and in host memory, and the
# service layer's training tokens/s beside train_step at 4k and 8k tokens per sequence.
# Usage: bash benchmarks/tinker_tpu.sh OUT_DIR [NAME ...]  (NAMEs: run only those)
set -u
out=${1:-/tmp/tinker-tpu}
shift || true
only=" $* "
mkdir -p "$out"
run() {  # name, then the command: its output to OUT/name.txt; a failure (e.g. out of memory) is recorded, not fatal
    local name=$1; shift
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
    echo "== $name: $*" | tee "$out/$name.txt"
    timeout 900 "$@" >> "$out/$name.txt" 2>&1 || echo "== exit $?" >> "$out/$name.txt"
    grep -v "^WARNING\|^I[0-9]" "$out/$name.txt" | tail -20
}
run bank32 python benchmarks/bank_memory.py --preset qwen3-0.6b --slots 32 --rank 32
run bank32_offload python benchmarks/bank_memory.py --preset qwen3-0.6b --slots 32 --rank 32 --offload-moments
run train_4k python benchmarks/tinker_api_speed.py --preset qwen3-0.6b --dtype bfloat16 --batch 8 --seq-len 4096 \
    --repeats 3 --tokens-per-call 32768 --offload-moments
run train_8k python benchmarks/tinker_api_speed.py --preset qwen3-0.6b --dtype bfloat16 --batch 4 --seq-len 8192 \
    --repeats 3 --tokens-per-call 32768 --offload-moments
run service_4k_b32 python benchmarks/tinker_api_speed.py --preset qwen3-0.6b --dtype bfloat16 --batch 32 \
    --seq-len 4096 --repeats 2 --tokens-per-call 32768 --offload-moments --skip-train-step
run service_32k python benchmarks/tinker_api_speed.py --preset qwen3-0.6b --dtype bfloat16 --batch 1 \
    --seq-len 32768 --repeats 2 --tokens-per-call 32768 --offload-moments --skip-train-step
