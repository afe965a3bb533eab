#!/usr/bin/env bash
# 5- and 6-bit layers on the int4 GEMV with a high plane (kernels.high_bits) against int4 and bf16 on
# the GPU machine (issue 26): their tests on CUDA, then one bench run, llama2-7b shape, RTN g128,
# so the ratios come from the same run.
# Usage: bash scripts/gpu_high_bits.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_high_bits.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
python -m pytest -q -p no:cacheprovider -m "not quant" tests/test_high_bits.py tests/test_planes.py \
  > "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt"
echo "tests $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
python -m llamactl bench --synthetic llama2-7b --synthetic-quant none,int4,int5,int6 --dtype bfloat16 \
  --batch "${BATCH:-1}" --prompt-len 128 --gen-len 128 --format json -o "$out/high-bits.json" 2> "$out/bench.err" \
  > /dev/null || tail -20 "$out/bench.err"
echo "bench $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
[ -f "$out/high-bits.json" ] && python -c "
import json
from llamactl import report
d = json.load(open('$out/high-bits.json'))
print(report.to_markdown(d))
rows = {(r['model'].split()[-1], r['batch']): r for r in d['results']}
for (q, b), r in sorted(rows.items()):
    base = rows.get(('int4-g128', b))
    if base and q != 'int4-g128':
        pred = base['decode_tok_s'] * base['bytes_per_step'] / r['bytes_per_step']
        print(f'{q} batch {b}: {r[\"decode_tok_s\"]:.1f} tok/s = {r[\"decode_tok_s\"] / pred:.3f} of what its bytes predict from int4')
"
