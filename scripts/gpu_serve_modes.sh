#!/usr/bin/env bash
# `llamactl serve --mode compile` against `--mode graphs` under the same load test (issues 20, 21),
# on the GPU machine, repository root; one JSON a run, wall times (start-up and compiles included)
# in times.txt. Needs starlette and uvicorn there: carry .whl (see scripts/README.md).
# Usage: bash scripts/gpu_serve_modes.sh OUTDIR [QUANT:MODE ...]
set -uo pipefail
out=${1:?usage: gpu_serve_modes.sh OUTDIR [QUANT:MODE ...]}; shift
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(none:compile none:graphs)
. "$(dirname "$0")/device_env.sh"
common="--synthetic llama2-7b --dtype bfloat16 --prompt-len 128 --gen-len 256 --concurrency 1,8,32 --requests 32"
for run in "${runs[@]}"; do
  IFS=: read -r q mode <<< "$run"
  t0=$(date +%s)
  python -m llamactl bench --serve embedded $common --synthetic-quant "$q" --mode "$mode" \
    --format json -o "$out/serve-$q-$mode.json" > /dev/null 2> "$out/serve-$q-$mode.err" || tail -20 "$out/serve-$q-$mode.err"
  echo "serve-$q-$mode $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
  grep -i "compiled\|serving" "$out/serve-$q-$mode.err" | head -3
  [ -f "$out/serve-$q-$mode.json" ] && python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/serve-$q-$mode.json'))))"
done
