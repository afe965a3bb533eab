#!/usr/bin/env bash
# 5- and 6-bit layers on the int4 GEMV with a high plane (kernels.high_bits) against int4 and bf16 on
# the GPU machine (issue 26): their tests on CUDA, then bench runs, llama2-7b shape, RTN g128, batch
# 1 (and 8), so the ratios come from the same run. Each part has its own time limit (seconds:
# TESTS_S, B1_S, B8_S), so what finished comes back when the machine's time is short.
# Usage: bash scripts/gpu_high_bits.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_high_bits.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout "${TESTS_S:-150}" python -m pytest -q -p no:cacheprovider -m "not quant and not slow" tests/layers/test_high_bits.py \
  > "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt"
echo "tests $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
summary() {  # $1: a bench JSON
  python -c "
import json
from llamactl.bench import report
d = json.load(open('$1'))
print(report.to_markdown(d))
rows = {(r['model'].split()[-1], r['batch']): r for r in d['results']}
for (q, b), r in sorted(rows.items()):
    base = rows.get(('int4-g128', b))
    if base and q != 'int4-g128':
        pred = base['decode_tok_s'] * base['bytes_per_step'] / r['bytes_per_step']
        print(f'{q} batch {b}: {r[\"decode_tok_s\"]:.1f} tok/s = {r[\"decode_tok_s\"] / pred:.3f} of what its bytes predict from int4')
"
}
for b in 1 8; do
  limit=$([ $b = 1 ] && echo "${B1_S:-240}" || echo "${B8_S:-200}")
  timeout "$limit" python -m llamactl bench --synthetic llama2-7b --synthetic-quant none,int4,int5,int6 --dtype bfloat16 \
    --batch $b --prompt-len 128 --gen-len 128 --format json -o "$out/high-bits-b$b.json" 2> "$out/bench-b$b.err" \
    > /dev/null || tail -5 "$out/bench-b$b.err"
  echo "bench batch $b $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
  [ -f "$out/high-bits-b$b.json" ] && summary "$out/high-bits-b$b.json"
done
