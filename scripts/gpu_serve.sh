#!/usr/bin/env bash
# Batched decoding and serving on the GPU machine (issues 20 and 21), repository root:
# the batch sweep, the load tests of `llamactl serve` (bf16 and int4), then the GPU tests named.
# Usage: bash scripts/gpu_serve.sh OUTDIR [pytest -k expression]
# Needs starlette and uvicorn there: carry .whl (see scripts/README.md).
set -uo pipefail
out=${1:?usage: gpu_serve.sh OUTDIR}; tests=${2:-served or own_positions}
. "$(dirname "$0")/device_env.sh"
common="--synthetic llama2-7b --dtype bfloat16 --prompt-len 128 --gen-len 256"
python -m llamactl bench $common --synthetic-quant none,int4,int8 --mode graphs --batch 1,8,32 --warmup 1 --repeat 3 \
  --format json -o "$out/batch.json" > /dev/null 2> "$out/batch.err" || tail -20 "$out/batch.err"
python -m llamactl bench --compare "$out/batch.json" "$out/batch.json" > /dev/null  # the JSON is well formed
for q in none int4; do
  python -m llamactl bench --serve embedded $common --synthetic-quant $q --concurrency 1,8,32 --requests 32 \
    --format json -o "$out/serve-$q.json" > /dev/null 2> "$out/serve-$q.err" || tail -20 "$out/serve-$q.err"
done
for f in batch serve-none serve-int4; do
  python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$out/$f.json'))))" \
    | tee "$out/$f.md"
done
python -m pytest -m gpu -q -p no:cacheprovider -s tests/test_gpu.py -k "$tests" > "$out/tests.txt" 2>&1; tail -5 "$out/tests.txt"
