#!/usr/bin/env bash
# CPU decode and prefill, llamactl against llama.cpp's llama-bench on the same model and bits,
# interleaved rounds (docs/bench/README.md, CPU protocol). Usage:
#   bash scripts/cpu_vs_llamacpp.sh LLAMA_CPP_BIN_DIR MODEL_FOLDER OUT [ROUNDS]
# MODEL_FOLDER: a 16-bit HF folder (scripts/synthetic_folder.py llama-135m makes one). Each round
# runs llama-bench (BF16, Q8_0, Q4_0; -p 128 -n 64 -t THREADS) and llamactl bench, eager and
# compiled (f32, bf16,
# RTN int8 per channel, RTN int4 g64, and both with lm_head quantized too), one after the other.
set -euo pipefail
bin=$1; src=$2; out=$3; rounds=${4:-3}
threads=$(nproc)
mkdir -p "$out"
[ -f "$out/bf16.gguf" ] || llamactl convert "$src" -o "$out/bf16.gguf" -q > /dev/null
for t in Q8_0 Q4_0; do
  [ -f "$out/$t.gguf" ] || "$bin/llama-quantize" --pure "$out/bf16.gguf" "$out/$t.gguf" $t > /dev/null 2>&1
done
[ -d "$out/int8" ] || llamactl quantize "$src" -o "$out/int8" --method rtn --bits 8 --group-size -1 --eval-tokens 0 -q > /dev/null
[ -d "$out/int4" ] || llamactl quantize "$src" -o "$out/int4" --method rtn --bits 4 --group-size 64 --eval-tokens 0 -q > /dev/null
# with lm_head in the same bits: llama-bench's --pure files quantize it too (each step reads it)
[ -d "$out/int8h" ] || llamactl quantize "$src" -o "$out/int8h" --method rtn --bits 8 --group-size -1 --quantize-lm-head --eval-tokens 0 -q > /dev/null
[ -d "$out/int4h" ] || llamactl quantize "$src" -o "$out/int4h" --method rtn --bits 4 --group-size 64 --quantize-lm-head --eval-tokens 0 -q > /dev/null
common="--device cpu --mode eager,compile --prompt-len 128 --gen-len 64 --warmup 1 --repeat 3 --format json"
for r in $(seq 1 "$rounds"); do
  for t in bf16 Q8_0 Q4_0; do
    "$bin/llama-bench" -m "$out/$t.gguf" -p 128 -n 64 -t "$threads" -r 3 -o json > "$out/llamacpp-$t-$r.json" 2> /dev/null
  done
  llamactl bench "$src" $common --dtype float32 -o "$out/llamactl-f32-$r.json" > /dev/null 2>&1
  llamactl bench "$src" $common --dtype bfloat16 -o "$out/llamactl-bf16-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int8" $common --dtype bfloat16 -o "$out/llamactl-int8-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int4" $common --dtype bfloat16 -o "$out/llamactl-int4-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int8h" $common --dtype bfloat16 -o "$out/llamactl-int8h-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int4h" $common --dtype bfloat16 -o "$out/llamactl-int4h-$r.json" > /dev/null 2>&1
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def med(xs):
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
print("| run | decode tok/s median (min-max) | prefill tok/s |")
print("| --- | --- | --- |")
for t in ("bf16", "Q8_0", "Q4_0"):
    dec, pre = [], []
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/llamacpp-{t}-{r}.json")):
            (pre if row["n_prompt"] else dec).append(row["avg_ts"])
    print(f"| llama.cpp {t} | {med(dec)} | {med(pre)} |")
for k in ("f32", "bf16", "int8", "int4", "int8h", "int4h"):
    for i, mode in enumerate(("eager", "compile")):
        rows = [json.load(open(f"{out}/llamactl-{k}-{r}.json"))["results"][i] for r in range(1, rounds + 1)]
        print(f"| llamactl {k} {mode} ({rows[0]['gemv']}) | {med([x['decode_tok_s'] for x in rows])} | "
              f"{med([x['prefill_tok_s'] for x in rows])} |")
PY
