#!/usr/bin/env bash
# int4 prefills on the GPU machine, repository root, one call: the dequantizing kernels and
# dequantize + cuBLAS per llama2-7b layer and rows (scripts/int4_prefill_probe.py), then bench's time to the
# first token for bf16 and int4 at 128-, 512- and 2,048-token prompts (batch 1, graphs), then the
# int4 GPU tests. Files: gpu.txt, probe.json, ttft.json, log.txt, tests.txt.
# Usage: [ROWS=144,...] [PROMPTS=128,512,2048] bash scripts/gpu_int4_prefill.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_int4_prefill.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
log="$out/log.txt"
timeout 300 python scripts/int4_prefill_probe.py "$out/probe.json" --dequant ${ROWS:+--rows $ROWS} 2>&1 | tee -a "$log"
timeout 240 python -m llamactl bench --synthetic llama2-7b --dtype bfloat16 --synthetic-quant none,int4 --mode graphs \
  --batch 1 --prompt-len "${PROMPTS:-128,512,2048}" --gen-len 16 --warmup 1 --repeat 3 --format json \
  -o "$out/ttft.json" > /dev/null 2>> "$log" || tail -5 "$log"
[ -f "$out/ttft.json" ] && md "$out/ttft.json"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "int4" > "$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
