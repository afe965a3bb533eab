#!/usr/bin/env bash
# CPU decode of 8-bit folders at every group size (and one 4-bit) against their 16-bit parent, beside
# what their bytes allow: the parent's bytes a decode step reads over the child's (docs/bench/cpu.md).
# The parent: random weights of the llama-135m shape with tied embeddings (scripts/synthetic_folder.py),
# the shape of the third-party chat model of issue 56. Usage:
#   bash scripts/cpu_bits_ratio.sh OUT [ROUNDS] [MODES]     (MODES: a comma list of bench --mode; eager,compile)
# Each round times every folder in every mode (bench --prompt-len 128 --gen-len 64 --repeat 3);
# ratios are taken within a round, then the median over rounds. OUT/summary.md: the table.
set -euo pipefail
out=$1; rounds=${2:-3}; modes=${3:-eager,compile}
mkdir -p "$out"
src=$out/bf16
[ -d "$src" ] || python scripts/synthetic_folder.py llama-135m "$src" tied
folders=(bf16)
q() {
  local name=$1; shift
  [ -d "$out/$name" ] || llamactl quantize "$src" -o "$out/$name" --method rtn --sym --eval-tokens 0 -q "$@" > /dev/null
  folders+=("$name")
}
q int8-g32 --bits 8 --group-size 32
q int8-g64 --bits 8 --group-size 64
q int8-g128 --bits 8 --group-size 128
q int8-row --bits 8 --group-size -1
q int8-g64-table8 --bits 8 --group-size 64 --embed-bits 8   # the tied table (the head) at 8 bits too
q int4-g64 --bits 4 --group-size 64
common="--device cpu --dtype bfloat16 --prompt-len 128 --gen-len 64 --warmup 1 --repeat 3 --format json"
for r in $(seq 1 "$rounds"); do
  for m in ${modes//,/ }; do
    for f in "${folders[@]}"; do
      llamactl bench "$out/$f" $common --mode "$m" -o "$out/$f-$m-$r.json" > /dev/null 2> "$out/$f-$m-$r.log"
    done
  done
done
python - "$out" "$rounds" "$modes" "${folders[@]}" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, rounds, modes, folders = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:]
row = lambda f, m, r: json.load(open(f"{out}/{f}-{m}-{r}.json"))["results"][0]
print("| folder | MB a step reads | bytes allow | " + " | ".join(f"{m} tok/s | {m} vs bf16 | {m} of allowed" for m in modes) + " |")
print("| --- | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in modes) + " |")
for f in folders:
    step = row(f, modes[0], 1)["bytes_per_step"]
    allow = row("bf16", modes[0], 1)["bytes_per_step"] / step
    cells = []
    for m in modes:
        tok = [row(f, m, r)["decode_tok_s"] for r in range(1, rounds + 1)]
        ratio = statistics.median(row(f, m, r)["decode_tok_s"] / row("bf16", m, r)["decode_tok_s"] for r in range(1, rounds + 1))
        cells.append(f"{statistics.median(tok):.1f} ({min(tok):.1f}-{max(tok):.1f}) | {ratio:.2f}x | {ratio / allow:.0%}")
    print(f"| {f} | {step / 1e6:.1f} | {allow:.2f}x | " + " | ".join(cells) + " |")
PY
