#!/usr/bin/env bash
# Batched decoding and serving on the GPU machine (issues 20 and 21), repository root, one call:
# the batch sweep (bf16/int4/int8, batch 1, 8, 32), the kernels of a decode step at each batch
# (scripts/step_profile.py), load tests of `llamactl serve` (bf16 and int4, concurrency 1, 8, 32),
# then the GPU tests named (`-k`; "-": none). Each part has a time limit; seven files in OUTDIR
# (JSON a part, log.txt, tests.txt, gpu.txt).
# Usage: bash scripts/gpu_serve.sh OUTDIR [pytest -k expression | -]
# Needs starlette and uvicorn there: carry .whl (see scripts/README.md).
set -uo pipefail
out=${1:?usage: gpu_serve.sh OUTDIR}; tests=${2:-served or own_positions}
. "$(dirname "$0")/device_env.sh"
log="$out/log.txt"
common="--synthetic llama2-7b --dtype bfloat16 --prompt-len 128 --gen-len 256"
md() { python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$1'))))"; }
timeout 240 python -m llamactl bench $common --synthetic-quant none,int4,int8 --mode graphs --batch 1,8,32 \
  --warmup 1 --repeat 3 --format json -o "$out/batch.json" > /dev/null 2>> "$log" || tail -5 "$log"
[ -f "$out/batch.json" ] && md "$out/batch.json"
timeout 90 python scripts/step_profile.py "$out/prof.json" --batch 1,8,32 2>&1 | tee -a "$log"
for q in none int4; do
  timeout 150 python -m llamactl bench --serve embedded $common --synthetic-quant $q --concurrency 1,8,32 --requests 32 \
    --format json -o "$out/serve-$q.json" > /dev/null 2>> "$log" || tail -5 "$log"
  [ -f "$out/serve-$q.json" ] && md "$out/serve-$q.json"
done
[ "$tests" = "-" ] || { timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "$tests" > "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt"; }
