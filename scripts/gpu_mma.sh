#!/usr/bin/env bash
# Issues 51 and 53 on the GPU: the tensor-core int4, int8 and FP8 kernels' tests (kernels/mma.py
# against its reference at 1-64 rows, bf16 and fp16), then scripts/mma_probe.py: one decoder
# layer's products against cuBLAS bf16 at each row count (llama2-7b and llama3-8b: int4 g128, int8
# and FP8 per channel) and whole decode steps of llama2-7b (bf16; each kind on today's kernels and
# on the tensor-core kernel). OUTDIR gets mma-tests.log and mma.json (written as it goes).
# Usage: [PROBE_S=420] [KINDS=int4,int8,fp8] bash scripts/gpu_mma.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_mma.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_mma.py > "$out/mma-tests.log" 2>&1
grep -E "passed|failed|Error" "$out/mma-tests.log" | tail -5
timeout "${PROBE_S:-420}" python scripts/mma_probe.py "$out/mma.json" --kinds "${KINDS:-int4,int8,fp8}" --rows 1,2,4,8,16,32,64 \
  --steps llama2-7b 2> /tmp/mma-probe.err || tail -5 /tmp/mma-probe.err
