#!/usr/bin/env bash
# The 8-bit KV cache's decode goals (issue 52) on the lent GPU: each bench times the 16-bit cache
# and the int8 and fp8 ones in one run (--kv-dtype auto,int8,fp8), so their ratios are of one call.
#   kv8-7b-16k    llama2-7b-32k shape, int4 weights (RTN), batch 1 after a 16,384-token prompt
#   kv8-8b-32x4k  llama3-8b bf16, 32 rows after 4,096-token prompts
# First the kernels' tests on the GPU (tests/kernels/test_kv8.py); bench's stderr goes to /tmp (the
# device returns at most 8 files). The capacity goal is scripts/gpu_paged.sh's chat-kv16-new and
# chat-kv8-half. Then the int8 decode kernel alone (scripts/attention_probe.py --variants kv8) at
# both cases' shapes, to attn-int8-7b.json and attn-int8-8b.json; given OLD (a `git archive`
# tarball of another tree), that tree's probe too, in the same call (its lines in the output).
# Usage: bash scripts/gpu_kv8.sh OUTDIR [OLD.tar]
set -uo pipefail
out=${1:?usage: gpu_kv8.sh OUTDIR [OLD.tar]}
old=${2:-}
. "$(dirname "$0")/device_env.sh"
timeout 100 python -m pytest -q -x tests/kernels/test_kv8.py > "$out/kv8-tests.log" 2>&1; tail -1 "$out/kv8-tests.log"
CASES=("llama2-7b 1 16384 16512 7b" "llama3-8b 32 4096 4160 8b")  # shape, rows, context, cache, file tag
for c in "${CASES[@]}"; do
  read -r shape rows ctx cache tag <<< "$c"
  timeout 120 python scripts/attention_probe.py "$out/attn-int8-$tag.json" --shapes "$shape" --batch "$rows" \
    --ctx "$ctx" --max-seq "$cache" --variants kv8 --kv-dtype int8 2>&1 | tail -8
done
if [ -n "$old" ]; then
  rm -rf /tmp/old-tree && mkdir -p /tmp/old-tree && tar xf "$old" -C /tmp/old-tree
  for c in "${CASES[@]}"; do
    read -r shape rows ctx cache tag <<< "$c"
    echo "old tree ($old):"
    (cd /tmp/old-tree && PYTHONPATH=/tmp/old-tree timeout 60 python scripts/attention_probe.py "/tmp/old-$tag.json" \
      --shapes "$shape" --batch "$rows" --ctx "$ctx" --max-seq "$cache" --variants splits --kv-dtype int8 2>&1 | tail -6)
  done
fi
# NAME BENCH_ARGS...: bench's JSON to OUTDIR/NAME.json, and each row's decode rate against the first's
run() {
  local name=$1; shift
  timeout 220 python -m llamactl bench "$@" --kv-dtype auto,int8,fp8 --format json -o "$out/$name.json" \
    > /dev/null 2> "/tmp/$name.err" || tail -3 "/tmp/$name.err"
  python - "$out/$name.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
base = next((r["decode_tok_s"] for r in rows if r.get("decode_tok_s")), None)
for r in rows:
    tok = r.get("decode_tok_s")
    print(f"{r.get('kv_dtype', '?'):8} {tok or 0:8.1f} tok/s  {tok / base if tok and base else 0:.3f}x  "
          f"{r.get('bandwidth_ceiling_frac', 0):.2f} of the ceiling  {r.get('skipped', '')}")
PY
}
run kv8-7b-16k --synthetic llama2-7b-32k --synthetic-quant int4 --batch 1 --prompt-len 16384 --gen-len 128 --warmup 1 --repeat 3
run kv8-8b-32x4k --synthetic llama3-8b --batch 32 --prompt-len 4096 --gen-len 64 --warmup 1 --repeat 2
