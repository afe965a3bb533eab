#!/usr/bin/env bash
# CPU decode and prefill, llamactl against llama.cpp's llama-bench on the same model and bits,
# interleaved rounds (docs/bench/cpu.md). Usage:
#   bash scripts/cpu_vs_llamacpp.sh LLAMA_CPP_BIN_DIR MODEL_FOLDER OUT [ROUNDS] [MODE]
# MODEL_FOLDER: a 16-bit HF folder (scripts/synthetic_folder.py llama-135m makes one). llama.cpp's
# files: llamactl convert (BF16), then llama-quantize Q8_0 / Q4_0 with its default mix (the
# embedding table and lm_head at Q8_0 where Q6_K does not fit the width). llamactl's: RTN in groups
# of 32, symmetric (as Q8_0/Q4_0), the table and the head at 8 bits (--embed-bits 8, --head-bits 8;
# one table for a tied model). Each round: llama-bench (-p 128 -n 64 -t THREADS -r 3) for the
# three files, then llamactl bench --mode MODE (compile, the default, or aot) for the three folders.
set -euo pipefail
bin=$1; src=$2; out=$3; rounds=${4:-3}; mode=${5:-compile}
threads=$(nproc)
mkdir -p "$out"
[ -f "$out/bf16.gguf" ] || llamactl convert "$src" -o "$out/bf16.gguf" -q > /dev/null
for t in Q8_0 Q4_0; do
  [ -f "$out/$t.gguf" ] || "$bin/llama-quantize" "$out/bf16.gguf" "$out/$t.gguf" $t > "$out/quantize-$t.log" 2>&1
done
tied=$(python -c "import json,sys; print(json.load(open(sys.argv[1])).get('tie_word_embeddings', False))" "$src/config.json")
head=(--head-bits 8); [ "$tied" = True ] && head=()
for b in 8 4; do
  [ -d "$out/int$b" ] || llamactl quantize "$src" -o "$out/int$b" --method rtn --bits $b --group-size 32 --sym \
    --embed-bits 8 "${head[@]}" --eval-tokens 0 -q > /dev/null
done
common="--device cpu --mode $mode --prompt-len 128 --gen-len 64 --warmup 1 --repeat 3 --format json"
for r in $(seq 1 "$rounds"); do
  for t in bf16 Q8_0 Q4_0; do
    "$bin/llama-bench" -m "$out/$t.gguf" -p 128 -n 64 -t "$threads" -r 3 -o json > "$out/llamacpp-$t-$r.json" 2> /dev/null
  done
  llamactl bench "$src" $common --dtype bfloat16 -o "$out/llamactl-bf16-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int8" $common --dtype bfloat16 -o "$out/llamactl-int8-$r.json" > /dev/null 2>&1
  llamactl bench "$out/int4" $common --dtype bfloat16 -o "$out/llamactl-int4-$r.json" > /dev/null 2>&1
done
python - "$out" "$rounds" "$src" <<'PY'
import json, os, statistics, sys
out, rounds, src = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def med(xs):
    return statistics.median(xs), f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
size = lambda p: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs if f.endswith(".safetensors")) if os.path.isdir(p) else os.path.getsize(p)
print(f"| bits | llama.cpp decode tok/s | llamactl decode tok/s | ratio | llama.cpp prefill | llamactl prefill | ratio | file MB llama.cpp / llamactl |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for t, k in (("bf16", "bf16"), ("Q8_0", "int8"), ("Q4_0", "int4")):
    dec, pre = [], []
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/llamacpp-{t}-{r}.json")):
            (pre if row["n_prompt"] else dec).append(row["avg_ts"])
    rows = [json.load(open(f"{out}/llamactl-{k}-{r}.json"))["results"][0] for r in range(1, rounds + 1)]
    d1, d1s = med(dec); d2, d2s = med([x["decode_tok_s"] for x in rows])
    p1, p1s = med(pre); p2, p2s = med([x["prefill_tok_s"] for x in rows])
    folder = f"{out}/{k}" if k != "bf16" else src
    print(f"| {t} / {k} ({rows[0]['gemv']}) | {d1s} | {d2s} | {d2 / d1:.2f}x | {p1s} | {p2s} | {p2 / p1:.2f}x | "
          f"{size(f'{out}/{t}.gguf') / 1e6:.1f} / {size(folder) / 1e6:.1f} |")
PY
