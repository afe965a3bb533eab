#!/usr/bin/env bash
# A burst's time to first token with each gather window (issue 21), one call on the GPU machine:
# the batch bench at batch 1 and 32 (the server's reference, same call), then `llamactl serve`
# with each --gather-ms value under `bench --url` at concurrency 8 and 32 (llama2-7b shape, bf16
# random weights, CUDA graphs, 128-token prompts, 256 new tokens, REQUESTS a level: at 32 streams
# every wave of a closed loop arrives at an idle engine). Files: gpu.txt, batch.json,
# serve-gatherG.json a value, log.txt (stderr, and the engine's gather and prefill metrics). Carry .whl/.
# Usage: [REQUESTS=64] bash scripts/gpu_serve_gather.sh OUTDIR [GATHER_MS ...]   (default: 0 10)
set -uo pipefail
out=${1:?usage: gpu_serve_gather.sh OUTDIR [GATHER_MS ...]}; shift
gathers=("$@"); [ ${#gathers[@]} -gt 0 ] || gathers=(0 10)
. "$(dirname "$0")/device_env.sh"
log="$out/log.txt"
timeout 200 python -m llamactl bench --synthetic llama2-7b --dtype bfloat16 --mode graphs --batch 1,32 \
  --prompt-len 128 --gen-len 256 --warmup 1 --repeat 3 --format json -o "$out/batch.json" > /dev/null 2>> "$log" \
  || tail -5 "$log"
for g in "${gathers[@]}"; do
  srv="/tmp/srv-gather$g.err"
  python -m llamactl serve --synthetic llama2-7b --dtype bfloat16 --max-batch 32 --max-seq 640 --port 0 \
    --gather-ms "$g" > /dev/null 2> "$srv" &
  pid=$!
  url=$(served_url "$srv")
  echo "gather $g ms: $url (started at ${SECONDS}s of the script)" | tee -a "$log"
  timeout 150 python -m llamactl bench --url "$url" --prompt-len 128 --gen-len 256 --concurrency 8,32 \
    --requests "${REQUESTS:-64}" --format json -o "$out/serve-gather$g.json" > /dev/null 2>> "$log" || tail -5 "$log"
  python -c "import urllib.request as u; print(u.urlopen('$url/metrics').read().decode())" \
    | grep -E "^llamactl_engine_(gather|prefill)" | sed "s/^/gather $g: /" | tee -a "$log"
  kill -TERM $pid; wait $pid
  cat "$srv" >> "$log"
  [ -f "$out/serve-gather$g.json" ] && md "$out/serve-gather$g.json"
done
md "$out/batch.json"
