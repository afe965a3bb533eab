#!/usr/bin/env bash
# A burst's time to first token with and without the engine's gather window (issue 21), one call on
# the GPU machine: the batch bench at batch 1 and 32 (the server's reference, same call), then
# `llamactl serve` with each --gather-ms value under `bench --url` at concurrency 8 and 32
# (llama2-7b shape, bf16 random weights, CUDA graphs, 128-token prompts, 256 new tokens, REQUESTS
# a level: at 32 streams every wave of a closed loop arrives at an idle engine). Carry .whl/.
# Usage: [REQUESTS=64] bash scripts/gpu_serve_gather.sh OUTDIR [GATHER_MS ...]   (default: 0 2)
set -uo pipefail
out=${1:?usage: gpu_serve_gather.sh OUTDIR [GATHER_MS ...]}; shift
gathers=("$@"); [ ${#gathers[@]} -gt 0 ] || gathers=(0 2)
. "$(dirname "$0")/device_env.sh"
timeout 200 python -m llamactl bench --synthetic llama2-7b --dtype bfloat16 --mode graphs --batch 1,32 \
  --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3 --format json -o "$out/batch.json" > /dev/null 2> "$out/batch.err" \
  || tail -5 "$out/batch.err"
for g in "${gathers[@]}"; do
  python -m llamactl serve --synthetic llama2-7b --dtype bfloat16 --max-batch 32 --max-seq 640 --port 0 \
    --gather-ms "$g" > /dev/null 2> "$out/srv-gather$g.err" &
  pid=$!
  for _ in $(seq 1 300); do grep -q "serving" "$out/srv-gather$g.err" && break; sleep 1; done
  url=$(grep -o "http://[0-9.:]*" "$out/srv-gather$g.err" | head -1)
  echo "gather $g ms: $url (started at ${SECONDS}s of the script)"
  timeout 150 python -m llamactl bench --url "$url" --prompt-len 128 --gen-len 256 --concurrency 8,32 \
    --requests "${REQUESTS:-64}" --format json -o "$out/serve-gather$g.json" > /dev/null 2> "$out/serve-gather$g.err" \
    || tail -5 "$out/serve-gather$g.err"
  python -c "import urllib.request as u; print(u.urlopen('$url/metrics').read().decode())" | grep -E "^llamactl_engine_(gather|prefill)" > "$out/metrics-gather$g.txt"
  kill -TERM $pid; wait $pid
  [ -f "$out/serve-gather$g.json" ] && python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$out/serve-gather$g.json'))))"
  cat "$out/metrics-gather$g.txt"
done
python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$out/batch.json'))))"
