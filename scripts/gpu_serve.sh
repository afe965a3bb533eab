#!/usr/bin/env bash
# Batched decoding and serving on the GPU machine (issues 20 and 21), repository root, one call:
# the batch sweep (bf16/int4/int8, batch 1, 8, 32; PROFILE=1: then the kernels of a decode step
# at each batch, scripts/step_profile.py), `llamactl serve` (bf16, then int4) under `bench --url`
# at concurrency 1, 8, 32 (REQUESTS a level), with the Triton kernels each server compiled after
# it said "serving" (first uses that its warm-up missed), then the GPU tests named (`-k`; "-":
# none). Each part has a time limit. ATTN=1: then the decode attention's split plans
# (scripts/attention_probe.py --variants splits, the bench's cache and the server's). Each load
# test goes through scripts/serve_breakdown.py: the server's /metrics beside each level (its TTFT,
# prefill forwards, gather wait). Files: gpu.txt, batch.json, [prof.json,] [attn.json,]
# serve-QUANT[-FLAG].json, log.txt, tests.txt. A QUANTS item QUANT:--FLAG serves with that flag
# too (none:--no-prefill-graphs: serve-none-no-prefill-graphs.json; none:--gather-ms=3:
# serve-none-gather-ms3.json). CONC: the load test's levels.
# Usage: [REQUESTS=64] [CONC=1,8,32] [PROFILE=1] [ATTN=1] [BATCH_QUANT=none,int4,int8] [BATCH=1,8,32] [QUANTS="none int4"]
#        [MAX_SEQ=512] bash scripts/gpu_serve.sh OUTDIR [pytest -k expression | -]
# (MAX_SEQ: a slot's tokens, as `bench --serve` sizes them for 128 + 256: 2 x 128 + 256)
# Needs starlette and uvicorn there: carry .whl (see scripts/README.md).
set -uo pipefail
out=${1:?usage: gpu_serve.sh OUTDIR}; tests=${2:-served or own_positions}
. "$(dirname "$0")/device_env.sh"
log="$out/log.txt"
common="--synthetic llama2-7b --dtype bfloat16"
load="--prompt-len 128 --gen-len 256"
compiled() { find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name "*.json" ! -name "*autotune*" ! -name "__grp__*" \
  -printf "%P\n" 2>/dev/null | sort -u; }
timeout 330 python -m llamactl bench $common $load --synthetic-quant "${BATCH_QUANT:-none,int4,int8}" --mode graphs --batch "${BATCH:-1,8,32}" \
  --warmup 1 --repeat 3 --format json -o "$out/batch.json" > /dev/null 2>> "$log" || tail -5 "$log"
[ -f "$out/batch.json" ] && md "$out/batch.json"
[ "${PROFILE:-0}" = 1 ] && timeout 90 python scripts/step_profile.py "$out/prof.json" --batch 1,8,32 2>&1 | tee -a "$log"
if [ "${ATTN:-0}" = 1 ]; then  # the bench's cache (320, rows near 256), then the server's (512, rows near 300)
  timeout 60 python scripts/attention_probe.py /tmp/attn-bench.json --batch 8,32 --variants splits 2>&1 | tee -a "$log"
  timeout 60 python scripts/attention_probe.py /tmp/attn-serve.json --batch 8,32 --ctx 300 --max-seq 512 \
    --variants splits 2>&1 | tee -a "$log"
  python -c "import json, sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1], 'w'), indent=1)" \
    "$out/attn.json" /tmp/attn-bench.json /tmp/attn-serve.json
fi
for item in ${QUANTS:-none int4}; do
  q=${item%%:*}; flag=""; [ "$item" = "$q" ] || flag=${item#*:}
  name=$q${flag:+-${flag#--}}; name=${name//=/}
  srv="/tmp/srv-$name.err"
  python -m llamactl serve $common --synthetic-quant $q $flag --max-batch 32 --max-seq "${MAX_SEQ:-512}" --port 0 > /dev/null 2> "$srv" &
  pid=$!
  url=$(served_url "$srv")
  compiled > /tmp/ready-$name.txt
  echo "$name: $url (ready at ${SECONDS}s of the script)" | tee -a "$log"
  timeout 200 python scripts/serve_breakdown.py "$url" --concurrency "${CONC:-1,8,32}" --requests "${REQUESTS:-64}" \
    -o "$out/serve-$name.json" -- $load 2>> "$log" | tee -a "$log" || tail -5 "$log"
  compiled | comm -13 /tmp/ready-$name.txt - | sed "s/^/$name: compiled while serving: /" | tee -a "$log"
  kill -TERM $pid; wait $pid
  cat "$srv" >> "$log"
  [ -f "$out/serve-$name.json" ] && md "$out/serve-$name.json"
done
[ "$tests" = "-" ] || { timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "$tests" > "$out/tests.txt" 2>&1; tail -3 "$out/tests.txt";
  # the batched step's dependent launches in a CUDA graph against plain ones (bit for bit)
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_skinny.py -k dependent >> "$out/tests.txt" 2>&1; tail -1 "$out/tests.txt"; }
