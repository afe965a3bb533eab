#!/usr/bin/env bash
# quantize --target-bpw on the embedded model at llama.cpp's file sizes (issue 26), RTN and GPTAQ,
# scored on the same eval tokens as scripts/bpw_table.sh. Usage: bash scripts/target_bpw_table.sh OUT [EVAL_TOKENS]
set -uo pipefail
out=${1:?usage: target_bpw_table.sh OUT [EVAL_TOKENS]}; tokens=${2:-16384}
mkdir -p "$out"
export GPTQMODEL_CPU_WORKERS=${GPTQMODEL_CPU_WORKERS:-2}
t0=$(date +%s)
python -m llamactl calibrate embedded -o "$out/stats.safetensors" --force --json > "$out/calibrate.json"
echo "calibrate $(( $(date +%s) - t0 )) s" | tee "$out/times.txt"
for bpw in 4.6 5.35 6.2 6.6 8.5; do
  for method in rtn gptq; do
    extra=(); [ "$method" = gptq ] && extra=(--gptq-variant gptaq)
    t0=$(date +%s)
    python -m llamactl quantize embedded -o "$out/$method-$bpw" --method "$method" "${extra[@]}" --asym --clip-search \
      --target-bpw "$bpw" --calib-stats "$out/stats.safetensors" --eval-tokens "$tokens" --force --json \
      > "$out/$method-$bpw.json" 2> "$out/$method-$bpw.err" || tail -3 "$out/$method-$bpw.err"
    echo "$method $bpw $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
    rm -rf "$out/$method-$bpw"
  done
done
