#!/usr/bin/env bash
# FP8 weights and activations (issue 53) on the lent GPU: each bench times the bf16 model and its
# FP8 copy (--synthetic-quant none,fp8) in one run, so their ratios are of one call.
#   fp8-SHAPE-b1    batch 1 after a 2,048-token prompt: time to first token, batch-1 decode
#   fp8-SHAPE-b128  128 rows after 128-token prompts: decode
# for each of SHAPES; first the FP8 and 8-bit-cache GPU tests. Bench's stderr goes to /tmp
# (the device returns at most 8 files).
# Usage: [SHAPES="llama3-8b llama2-7b"] [TESTS=0] bash scripts/gpu_fp8.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_fp8.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 120 python -m pytest -q -m gpu tests/test_gpu.py -k "fp8 or 8bit" > "$out/fp8-tests.log" 2>&1; tail -1 "$out/fp8-tests.log"
fi
# NAME BENCH_ARGS...: bench's JSON to OUTDIR/NAME.json; each row's TTFT and decode against the first row's
run() {
  local name=$1; shift
  timeout 200 python -m llamactl bench "$@" --synthetic-quant none,fp8 --dtype bfloat16 --format json \
    -o "$out/$name.json" > /dev/null 2> "/tmp/$name.err" || tail -3 "/tmp/$name.err"
  python - "$out/$name.json" "$name" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
base = rows[0] if rows and rows[0].get("decode_tok_s") else None
for r in rows:
    if not r.get("decode_tok_s") or base is None:
        print(sys.argv[2], r.get("model"), r.get("skipped", "no rows"))
        continue
    print(f"{sys.argv[2]:16} {r['model']:28} ttft {r['ttft_s'] * 1000:7.1f} ms ({r['ttft_s'] / base['ttft_s']:.2f}x)  "
          f"decode {r['decode_tok_s']:8.1f} tok/s ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x)  {r.get('products', '')}")
PY
}
for shape in ${SHAPES:-llama3-8b llama2-7b}; do
  run "fp8-$shape-b1" --synthetic "$shape" --batch 1 --prompt-len 2048 --gen-len 128 --warmup 1 --repeat 3
  run "fp8-$shape-b128" --synthetic "$shape" --batch 128 --prompt-len 128 --gen-len 64 --warmup 1 --repeat 2
done
