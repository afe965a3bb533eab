#!/usr/bin/env bash
# Decode batches on kernels.skinny against an older tree, one call on the GPU machine (issue 20):
# the GPU tests of the skinny products, then `bench --synthetic llama2-7b --synthetic-quant
# none,int4` at batch 1, 8, 16, 32 (graphs, 128-token prompts, 256 new tokens) for this tree and
# for OLD (a commit of the device's .git, unpacked to /tmp/old), interleaved: new, old.
# QUANT: this tree's --synthetic-quant list (none,int4), OLD_QUANT: the old tree's (QUANT).
# Usage: [QUANT=...] [OLD_QUANT=...] [PROBE=1] bash scripts/gpu_skinny.sh OUTDIR OLD_COMMIT
set -uo pipefail
out=${1:?usage: gpu_skinny.sh OUTDIR OLD_COMMIT}; old=${2:?old commit}
. "$(dirname "$0")/device_env.sh"
new=$PWD
site=${PYTHONPATH%%:*}
mkdir -p /tmp/old && git archive "$old" | tar -x -C /tmp/old || echo "no $old here: new tree only"
timeout 120 python -m pytest -q tests/kernels/test_skinny.py 2>&1 | tail -3 | tee "$out/tests.txt"
if [ "${PROBE:-0}" = 1 ]; then
  timeout 240 python scripts/skinny_probe.py "$out/probe-int8.json" --kinds int8 --rows 8,32 2>&1 | tail -8
fi
bench() {  # name dir quant
  (cd "$2" && PYTHONPATH=$site:$2 TRITON_PRINT_AUTOTUNING=1 timeout 330 python -m llamactl bench --synthetic llama2-7b \
     --synthetic-quant "$3" --dtype bfloat16 --mode graphs --batch 1,8,32 --prompt-len 128 --gen-len 256 \
     --warmup 1 --repeat 3 --format json -o "$out/batch-$1.json" > "$out/batch-$1.log" 2>&1) || tail -5 "$out/batch-$1.log"
  python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/batch-$1.json'))))"
}
bench new "$new" "${QUANT:-none,int4}"
[ -f /tmp/old/llamactl/__init__.py ] && bench old /tmp/old "${OLD_QUANT:-${QUANT:-none,int4}}"
