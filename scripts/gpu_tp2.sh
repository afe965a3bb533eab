#!/usr/bin/env bash
# Tensor parallelism on two H200s (issue 23), on `nvidia-h200-x2`, repository root; two bounded
# parts, one call each (each within the device's 10 minutes). NVLink multicast stays off: the
# machine sets NCCL_NVLS_ENABLE=0 and the like, and `--tp` passes the environment on unchanged.
#   PART=1: the NCCL GPU tests (greedy tokens at --tp 2 against --tp 1); llama2-7b bf16 at batch 1,
#           --tp 1 then --tp 2 (decode tok/s, each rank's fraction of its GPU's ceiling, the
#           all-reduces' ms a step); llama2-7b bf16 at --tp 2, batch 8 and 32.
#   PART=2: llama3-70b bf16 and int4 (RTN g128) at --tp 2; int4 at --tp 1 (drawn and quantized
#           layer by layer: its bf16 weights would not fit one GPU).
# Files: gpu.txt, log.txt, PART=1: tests.txt, l2-tp1.json, l2-tp2.json, l2-tp2-batch.json;
#        PART=2: l3-70b-tp2.json, l3-70b-int4-tp1.json.
# Usage: PART=1|2 bash scripts/gpu_tp2.sh OUTDIR
set -uo pipefail
out=${1:?usage: PART=1|2 gpu_tp2.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >> "$out/gpu.txt"
env | grep -E "NVLS|MULTICAST" >> "$out/log.txt"
log="$out/log.txt"
std="--dtype bfloat16 --mode graphs --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3 --format json"
run() {  # NAME SECONDS bench arguments...: one bench, its JSON as a table
  local name=$1 limit=$2; shift 2
  echo "== $name: llamactl bench $*" | tee -a "$log"
  timeout "$limit" python -m llamactl bench "$@" -o "$out/$name.json" > /dev/null 2>> "$log" || tail -5 "$log"
  [ -f "$out/$name.json" ] && md "$out/$name.json" | tee -a "$log"
}
if [ "${PART:-1}" = 1 ]; then
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "nccl or two_gpus" -s > "$out/tests.txt" 2>&1
  tail -3 "$out/tests.txt"
  run l2-tp1 120 --synthetic llama2-7b $std --batch 1
  run l2-tp2 120 --synthetic llama2-7b $std --batch 1 --tp 2
  run l2-tp2-batch 180 --synthetic llama2-7b $std --batch 8,32 --tp 2
else
  run l3-70b-tp2 300 --synthetic llama3-70b --synthetic-quant none,int4 $std --batch 1 --tp 2
  run l3-70b-int4-tp1 240 --synthetic llama3-70b --synthetic-quant int4 $std --batch 1
fi
