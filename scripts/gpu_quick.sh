#!/usr/bin/env bash
# The shortest call that checks the GPU paths and one goal of each of issues 52 and 53, for a
# session with little device time left (the full runs: gpu_kv8.sh, gpu_fp8.sh, gpu_paged.sh):
#   gpu-tests.log    tests/test_gpu.py's 8-bit cache and FP8 tests, tests/serve/test_engine_gpu.py, test_kv8
#   kv8-7b-16k.json  llama2-7b-32k, int4 weights, batch 1 after 16,384 tokens, --kv-dtype auto,int8,fp8
#   fp8-8b-b1.json   llama3-8b bf16 and FP8, batch 1 after 2,048 tokens (TTFT, batch-1 decode)
# Usage: bash scripts/gpu_quick.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_quick.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/serve/test_engine_gpu.py tests/kernels/test_kv8.py \
  -k "8bit or fp8 or paged or served or kv8 or graphs or grammar" > "$out/gpu-tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/gpu-tests.log" | tail -8
bench() {  # NAME SECONDS BENCH_ARGS...
  local name=$1 s=$2; shift 2
  timeout "$s" python -m llamactl bench "$@" --format json -o "$out/$name.json" > /dev/null 2> "$out/$name.err" \
    || tail -3 "$out/$name.err"
  [ -f "$out/$name.json" ] && md "$out/$name.json" | cut -c1-260
}
bench kv8-7b-16k 85 --synthetic llama2-7b-32k --synthetic-quant int4 --batch 1 --prompt-len 16384 --gen-len 128 \
  --warmup 1 --repeat 2 --kv-dtype auto,int8,fp8
bench fp8-8b-b1 80 --synthetic llama3-8b --synthetic-quant none,fp8 --dtype bfloat16 --batch 1 --prompt-len 2048 \
  --gen-len 128 --warmup 1 --repeat 2
