#!/usr/bin/env bash
# --tp 1 unchanged (issue 22): the standard batch-1 bench (llama2-7b shape, bf16 and int4, CUDA
# graphs) in the tree before tensor parallelism (OLD, e.g. `git archive 45881a0^` unpacked) and in
# this one, alternating old/new/new/old in one call; then the NCCL graph-capture GPU test.
# Usage: bash scripts/gpu_tp1_ab.sh OUTDIR OLD_TREE
set -uo pipefail
out=${1:?usage: gpu_tp1_ab.sh OUTDIR OLD_TREE}; old=${2:?old tree}
. "$(dirname "$0")/device_env.sh"
new=$PWD
bench="bench --synthetic llama2-7b --synthetic-quant none,int4 --dtype bfloat16 --mode graphs --prompt-len 128 --gen-len 256 --warmup 2 --repeat 5 --format json"
for run in old:1 new:1 new:2 old:2; do
  IFS=: read -r tree i <<< "$run"
  dir=$([ "$tree" = old ] && echo "$old" || echo "$new")
  (cd "$dir" && PYTHONPATH=$dir python -m llamactl $bench -o "$out/$tree-$i.json" > /dev/null 2> "$out/$tree-$i.err") || tail -5 "$out/$tree-$i.err"
  python -c "import json; [print('$tree-$i', r['stage'], r.get('label', r.get('model')), round(r['decode_tok_s'], 1), round(r['prefill_tok_s'], 1)) for r in json.load(open('$out/$tree-$i.json'))['results']]"
done
python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "nccl or cuda_graphs_and_compile" > "$out/tests.txt" 2>&1; tail -5 "$out/tests.txt"
