#!/usr/bin/env bash
# The server against an older tree under the same load test (issue 21), in one call on the GPU
# machine: the batch bench (generate's per-token time and the batch figures, same call), then
# `llamactl serve` of OLD_TREE and of this tree with each prefill chunk, each under `bench --url`
# at concurrency 1, 8, 32 (llama2-7b shape, bf16 random weights, CUDA graphs, 128-token prompts,
# 256 new tokens, 32 requests a level). Carry .whl/ (starlette, uvicorn; scripts/README.md).
# Usage: bash scripts/gpu_serve_ab.sh OUTDIR OLD_TREE [CHUNK ...]   (CHUNK: --prefill-chunk, default 512 2048)
set -uo pipefail
out=${1:?usage: gpu_serve_ab.sh OUTDIR OLD_TREE [CHUNK ...]}; old=${2:?old tree}; shift 2
chunks=("$@"); [ ${#chunks[@]} -gt 0 ] || chunks=(512 2048)
. "$(dirname "$0")/device_env.sh"
new=$PWD
site=${PYTHONPATH%%:*}
timeout 240 python -m llamactl bench --synthetic llama2-7b --dtype bfloat16 --mode graphs --batch 1,8,32 \
  --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3 --format json -o "$out/batch.json" > /dev/null 2> "$out/batch.err" \
  || tail -5 "$out/batch.err"
serve_run() {  # name tree chunk
  local name=$1 dir=$2 chunk=$3
  (cd "$dir" && PYTHONPATH=$site:$dir exec python -m llamactl serve --synthetic llama2-7b --dtype bfloat16 \
     --max-batch 32 --max-seq 640 --port 0 --prefill-chunk "$chunk") > /dev/null 2> "$out/srv-$name.err" &
  local pid=$!
  local url; url=$(served_url "$out/srv-$name.err")
  echo "$name: $url (started in ${SECONDS}s of the script)"
  timeout 200 python -m llamactl bench --url "$url" --prompt-len 128 --gen-len 256 --concurrency 1,8,32 \
    --requests 32 --format json -o "$out/serve-$name.json" > /dev/null 2> "$out/serve-$name.err" || tail -5 "$out/serve-$name.err"
  kill -TERM $pid; wait $pid
  [ -f "$out/serve-$name.json" ] && md "$out/serve-$name.json"
}
serve_run old "$old" 512
for c in "${chunks[@]}"; do serve_run "new-$c" "$new" "$c"; done
python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/batch.json'))))"
