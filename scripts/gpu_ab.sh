#!/usr/bin/env bash
# An older tree against this one on the GPU, both orders in one call (old, new, new, old): a change
# meant to leave speed unchanged (issue 47). PART=1: the GPU tests of this tree, then the batch
# bench (llama2-7b shape, bf16 random weights, CUDA graphs, batch 1, 8, 32). PART=2: `llamactl
# serve` (--max-batch 32 --max-seq 640) under `bench --url` at concurrency 32 (128-token prompts,
# 256 new tokens). OLD: a commit of the device's .git (unpacked to /tmp/old). Carry .whl/ for PART=2.
# Only the JSON files come back (the device returns 8 files); logs go to stdout.
# Usage: [ORDER="new:1 old:1 ..."] PART=1|2 bash scripts/gpu_ab.sh OUTDIR OLD_COMMIT
set -uo pipefail
out=${1:?usage: PART=1|2 gpu_ab.sh OUTDIR OLD_COMMIT}; old=${2:?old commit}
. "$(dirname "$0")/device_env.sh"
new=$PWD
site=${PYTHONPATH%%:*}
rm -rf /tmp/old && mkdir -p /tmp/old && git archive "$old" | tar -x -C /tmp/old || { echo "no $old here"; exit 1; }
echo "new $(git rev-parse --short HEAD), old $old"
tree() { [ "$1" = old ] && echo /tmp/old || echo "$new"; }
if [ "${PART:-1}" = 1 ]; then
  timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py > /tmp/tests.txt 2>&1; tail -3 /tmp/tests.txt
  for run in ${ORDER:-old:1 new:1 new:2 old:2}; do
    IFS=: read -r t i <<< "$run"
    (cd "$(tree "$t")" && PYTHONPATH=$(tree "$t") timeout 200 python -m llamactl bench --synthetic llama2-7b \
      --dtype bfloat16 --mode graphs --batch 1,8,32 --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3 \
      --format json -o "$out/batch-$t-$i.json" > /dev/null 2> "/tmp/batch-$t-$i.err") || tail -3 "/tmp/batch-$t-$i.err"
    python -c "import json; [print('$t-$i', r.get('batch'), round(r['decode_tok_s'], 1)) for r in json.load(open('$out/batch-$t-$i.json'))['results']]"
  done
else
  for run in ${ORDER:-old:1 new:1 new:2 old:2}; do
    IFS=: read -r t i <<< "$run"
    dir=$(tree "$t")
    (cd "$dir" && PYTHONPATH=$site:$dir exec python -m llamactl serve --synthetic llama2-7b --dtype bfloat16 \
       --max-batch 32 --max-seq 640 --port 0) > /dev/null 2> "/tmp/srv-$t-$i.err" &
    pid=$!
    url=$(served_url "/tmp/srv-$t-$i.err" $pid); grep -h "serving\|warm" "/tmp/srv-$t-$i.err" | cut -c1-300
    timeout 120 python -m llamactl bench --url "$url" --prompt-len 128 --gen-len 256 --concurrency 32 \
      --requests 96 --format json -o "$out/serve-$t-$i.json" > /dev/null 2> "/tmp/serve-$t-$i.err" || tail -3 "/tmp/serve-$t-$i.err"
    kill -TERM $pid; wait $pid
    python -c "import json; [print('$t-$i', r.get('concurrency'), round(r['output_tok_s'], 1), round(r['ttft_ms_p50'], 1), round(r['ttft_ms_p95'], 1)) for r in json.load(open('$out/serve-$t-$i.json'))['results']]"
  done
fi
