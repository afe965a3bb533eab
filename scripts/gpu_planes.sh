#!/usr/bin/env bash
# 3-, 5- and 6-bit layers (kernels.planes) against int4 and bf16 on the GPU machine (issue 26): one
# bench run, llama2-7b shape, RTN g128, batch 1 and 8, so the ratios come from the same run.
# Usage: bash scripts/gpu_planes.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_planes.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
python -m llamactl bench --synthetic llama2-7b --synthetic-quant none,int4,int5,int6,int3 --dtype bfloat16 \
  --batch 1,8 --prompt-len 128 --gen-len 128 --format json -o "$out/planes.json" 2> "$out/planes.err" > /dev/null \
  || tail -20 "$out/planes.err"
echo "planes $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
[ -f "$out/planes.json" ] && python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/planes.json'))))"
