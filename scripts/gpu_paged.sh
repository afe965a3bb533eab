#!/usr/bin/env bash
# The paged KV cache's workloads (issue 49) on the lent GPU, llama3-8b shape, bf16 random weights,
# `llamactl serve` under `bench --url` (closed loop, greedy, EOS ignored), this tree against an
# older one (OLD: a commit of the device's .git, or a tar of its llamactl/ and pyproject.toml, e.g. a
# carried .whl/old-COMMIT.tar from `git archive COMMIT llamactl pyproject.toml`; unpacked to /tmp/old). Each run's bench JSON is
# merged into OUTDIR/paged-PART.json as it ends, with the GPU's copy bandwidth and bf16 GEMM rate
# (scripts/gpu_rates.py) and each workload's bound computed from them. Carry .whl/.
# RUNS (a server each; default "chat-new prefix-new prefix-noprefix"):
#   chat-new        chat (prompts 64:1024 words, answers 64:512, 512 requests, concurrency 256)
#   prefix-new      a 1,536-word shared prefix, 64:256 own words, 32:256 out, concurrency 64
#   prefix-noprefix the same with --no-prefix-cache
#   chat-old        chat on OLD (--max-batch 128 --max-seq 2624: 256 such slots do not fit an H100;
#                   --max-queue 256: every client waits for a slot, none is answered 429)
#   chat-base       chat on OLD with chat-new's arguments (OLD a paged tree too)
#   chat-ramp       chat with the 256 clients starting over 10 s (--ramp-up 10): steady-state TTFT
#   chat-nomix      chat with --no-mixed-steps (decode steps apart from the prefill forwards)
#   chat-kv16-new   chat with --kv-memory 16
#   chat-kv16-old   chat on OLD's grid of the same 16 GiB (--max-batch 32 --max-seq 4096)
#   chat-kv8-half   chat with --kv-memory 8 --kv-dtype int8 (half chat-kv16-new's memory, 8-bit)
#   chat-fp8        chat with FP8 weights and activations (--synthetic-quant fp8; against chat-new)
#   plain32         32 streams, prompts 64:256 words, answers of 256 tokens (the structured-output baseline)
#   json32          the same, every request held to a JSON schema (needs the carried xgrammar wheel)
#   json32-gil100   json32 with the server's GIL switch interval at 0.1 ms (serve's is 0.5 ms)
# A run named NAME.N is NAME again under its own name. REQUESTS32: plain32's and json32's requests (96).
# Usage: [RUNS="..."] [PART=name] [REQUESTS32=96] bash scripts/gpu_paged.sh OUTDIR OLD_COMMIT|OLD.tar
set -uo pipefail
out=${1:?usage: gpu_paged.sh OUTDIR OLD_COMMIT}; old=${2:?old commit}
. "$(dirname "$0")/device_env.sh"
new=$PWD
site=${PYTHONPATH%%:*}
rm -rf /tmp/old && mkdir -p /tmp/old
if [ -f "$old" ]; then tar -x -C /tmp/old -f "$old"; else git archive "$old" | tar -x -C /tmp/old; fi || { echo "no $old here"; exit 1; }
# a tar may leave the embedded model's weights out (the carry limit): the same files as this tree's
cp -n "$new"/llamactl/assets/docs-llama-17m/*.safetensors /tmp/old/llamactl/assets/docs-llama-17m/ 2> /dev/null
part=${PART:-chat}
mkdir -p /tmp/runs
python scripts/gpu_rates.py > /tmp/runs/rates.json && cat /tmp/runs/rates.json
CHAT=(--prompt-len 64:1024 --gen-len 64:512 --concurrency 256 --requests 512)
PREFIX=(--shared-prefix 1536 --prompt-len 64:256 --gen-len 32:256 --concurrency 64 --requests 128)
JSON32=(--prompt-len 64:256 --gen-len 256 --concurrency 32 --requests "${REQUESTS32:-96}")
# a schema whose documents run long (an array of at least 64 records, 15+ tokens each): answers end by
# length, not by the grammar (with "maxItems" random weights closed most arrays early: 76 tokens a request)
SCHEMA='{"response_format": {"type": "json_schema", "json_schema": {"name": "rows", "schema": {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": false}}}}}'


# start NAME TREE SERVE_ARGS...: a server in the background ($pid, $url); GIL_S set: the server's
# GIL switch interval (serve.run.GIL_SWITCH_S) set to it
start() {
  local name=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=$site:$dir exec python -c "import runpy, sys; import llamactl.serve.run as r
if '${GIL_S:-}': r.GIL_SWITCH_S = float('${GIL_S:-0}')
sys.argv = ['llamactl'] + sys.argv[1:]; runpy.run_module('llamactl', run_name='__main__')" \
     serve --synthetic llama3-8b --dtype bfloat16 --port 0 "$@") > /dev/null 2> "/tmp/runs/srv-$name.err" &
  pid=$!
  url=$(served_url "/tmp/runs/srv-$name.err" $pid)
  grep -h "serving\|warm\|error" "/tmp/runs/srv-$name.err" | cut -c1-400
}
# load NAME BENCH_ARGS...: bench --url against $url, its JSON merged into the part's file
load() {
  local name=$1; shift
  timeout 300 python -m llamactl bench --url "$url" "$@" --format json -o "/tmp/runs/$name.json" > /dev/null \
    2> "/tmp/runs/$name.err" || tail -3 "/tmp/runs/$name.err"
  python scripts/gpu_paged_summary.py /tmp/runs "$out/paged-$part.json" "$name"
}
# stop NAME: the server down, its last lines and the kernels it compiled while serving (after its warm-up)
stop() {
  kill -TERM $pid; wait $pid
  grep -h "compiled while serving" "/tmp/runs/srv-$1.err" | cut -c1-300
  tail -2 "/tmp/runs/srv-$1.err" | cut -c1-300
}

case "${RUNS:-}" in  # structured-output runs: first the engine's grammar rows in graphs, a step ahead, on this GPU
  *json*) timeout 150 python -m pytest -q -m gpu tests/serve/test_engine_gpu.py -k grammar 2>&1 | tail -1 ;;
esac
for run in ${RUNS:-chat-new prefix-new prefix-noprefix}; do
  case ${run%.*} in  # (NAME.2: NAME again, kept apart: an A/B in both orders)
    chat-new) start "$run" "$new"; load "$run" "${CHAT[@]}" ;;
    prefix-new) start "$run" "$new"; load "$run" "${PREFIX[@]}" ;;
    prefix-noprefix) start "$run" "$new" --no-prefix-cache; load "$run" "${PREFIX[@]}" ;;
    chat-old) start "$run" /tmp/old --max-batch 128 --max-seq 2624 --max-queue 256; load "$run" "${CHAT[@]}" ;;
    chat-base) start "$run" /tmp/old; load "$run" "${CHAT[@]}" ;;
    chat-ramp) start "$run" "$new"; load "$run" "${CHAT[@]}" --ramp-up 10 ;;
    chat-nomix) start "$run" "$new" --no-mixed-steps; load "$run" "${CHAT[@]}" ;;
    chat-kv16-new) start "$run" "$new" --kv-memory 16; load "$run" "${CHAT[@]}" ;;
    chat-kv16-old) start "$run" /tmp/old --max-batch 32 --max-seq 4096 --max-queue 256; load "$run" "${CHAT[@]}" ;;
    chat-kv8-half) start "$run" "$new" --kv-memory 8 --kv-dtype int8; load "$run" "${CHAT[@]}" ;;
    chat-fp8) start "$run" "$new" --synthetic-quant fp8; load "$run" "${CHAT[@]}" ;;
    plain32) start "$run" "$new"; load "$run" "${JSON32[@]}" ;;
    json32) start "$run" "$new"; load "$run" "${JSON32[@]}" --request-json "$SCHEMA" ;;
    json32-gil100) GIL_S=1e-4 start "$run" "$new"; load "$run" "${JSON32[@]}" --request-json "$SCHEMA" ;;
    *) echo "unknown run $run"; continue ;;
  esac
  stop "$run"
done
