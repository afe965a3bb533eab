#!/usr/bin/env bash
# Batched decoding, CUDA graphs against torch.compile + graphs at B > 1 (issue 20), on the GPU
# machine, repository root. One JSON a run (so a call cut short keeps what finished), with each
# run's wall time (compile included) in times.txt.
# Usage: bash scripts/gpu_batch_modes.sh OUTDIR [QUANT:MODE:BATCHES ...]
set -uo pipefail
out=${1:?usage: gpu_batch_modes.sh OUTDIR [QUANT:MODE:BATCHES ...]}; shift
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(none:graphs:1,8,32 none:compile:8 none:compile:32 int8:compile:8 int4:compile:8 int4:compile:32)
. "$(dirname "$0")/device_env.sh"
common="--synthetic llama2-7b --dtype bfloat16 --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3"
for run in "${runs[@]}"; do
  IFS=: read -r q mode batches <<< "$run"
  name="$q-$mode-${batches//,/_}"
  t0=$(date +%s)
  python -m llamactl bench $common --synthetic-quant "$q" --mode "$mode" --batch "$batches" \
    --format json -o "$out/$name.json" > /dev/null 2> "$out/$name.err" || tail -20 "$out/$name.err"
  echo "$name $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
  [ -f "$out/$name.json" ] && python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/$name.json'))))" | tee "$out/$name.md"
done
