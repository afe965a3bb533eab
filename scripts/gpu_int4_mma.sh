#!/usr/bin/env bash
# int4 and int8 decode batches on the int8 MMA against the 16-bit MMA, one call on the GPU machine
# (issue 20): the GPU tests of the integer products, the products alone (scripts/skinny_probe.py,
# llama2-7b layer shapes at 8 and 32 rows), then `bench --synthetic llama2-7b --synthetic-quant
# none,int4,int8 --quant-inputs float,int16` at batch 1, 8, 32 (graphs, 128-token prompts, 256 new
# tokens): with float inputs the int4 layers' batches take skinny_int4 (16-bit MMA) and the int8
# ones the multirow kernel; with int16 inputs skinny_int4_i8 and skinny_int8 (the int8 MMA).
# Usage: bash scripts/gpu_int4_mma.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_int4_mma.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
timeout 100 python -m pytest -q tests/kernels/test_skinny.py -k "int4_i8 or int8 or int4-g" 2>&1 | tail -3 | tee "$out/tests.txt"
timeout 170 python scripts/skinny_probe.py "$out/probe.json" --kinds int4i8,int8 --rows 8,32 2>&1 | tail -20
TRITON_PRINT_AUTOTUNING=1 timeout 290 python -m llamactl bench --synthetic llama2-7b --synthetic-quant none,int4,int8 \
  --quant-inputs float,int16 --dtype bfloat16 --mode graphs --batch 1,8,32 --prompt-len 128 --gen-len 256 \
  --warmup 1 --repeat 3 --format json -o "$out/batch.json" > "$out/batch.log" 2>&1 || tail -5 "$out/batch.log"
python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/batch.json'))))"
