#!/usr/bin/env bash
# KL against file bits per parameter on the embedded model: llamactl's quantize points beside
# llama.cpp's types (with and without an importance matrix), every file scored by llamactl's own
# quality code on the same eval tokens (issue 26; docs/quantize-quality.md).
# Usage: bash scripts/bpw_table.sh LLAMA_CPP_BIN_DIR OUT [EVAL_TOKENS] (llama.cpp built from the
# llama-cpp-python sdist with llama-quantize, llama-imatrix; see docs/convert.md)
set -uo pipefail
bin=$1; out=$2; n=${3:-16384}; mkdir -p "$out"
row() { python - "$@" <<'PY'
import json, os, sys
name, bpw_src, quality = sys.argv[1:4]
q = json.load(open(quality))
q = q["results"][0]["quality"] if "results" in q else q["quality"]  # bench's JSON, or quantize --json's
if bpw_src.endswith(".gguf"):  # the whole file over the parent's parameters, as quantize counts them
    from llamactl.folder.artifact import open_artifact, resolve_model_path
    from llamactl.folder.describe import params_from_config
    bpw = 8 * os.path.getsize(bpw_src) / params_from_config(open_artifact(resolve_model_path(None)).args)
else:
    bpw = json.load(open(bpw_src))["metrics"]["file_bpw"]
print(f"| {name} | {bpw:.2f} | {q['kl_mean']:.4f} | {q['top1_agreement'] * 100:.1f}% | {q['ppl']:.2f} | {q['tokens']} |")
PY
}
echo "| file | file bpw | KL mean | top-1 | ppl | tokens |" | tee "$out/table.md"
echo "| --- | --- | --- | --- | --- | --- |" | tee -a "$out/table.md"
# llamactl: RTN and GPTQ, linears alone, then the embedding table and the head in low bits
while IFS='|' read -r name args; do
  [ -z "$name" ] && continue
  { grep -q file_bpw "$out/$name.json" 2> /dev/null ||  # a finished point is kept (rerun: delete its .json)
    llamactl quantize embedded -o "$out/$name" $args --eval-tokens "$n" --force --json > "$out/$name.json" 2> "$out/$name.err"; } \
    && row "llamactl $name" "$out/$name.json" "$out/$name.json" | tee -a "$out/table.md" || tail -3 "$out/$name.err"
done <<'LIST'
rtn4-g128|--method rtn
rtn4-g128-e4|--method rtn --embed-bits 4
rtn4-g128-e4-h4|--method rtn --embed-bits 4 --quantize-lm-head
rtn4-g128-asym-clip-e4-h4|--method rtn --asym --clip-search --embed-bits 4 --quantize-lm-head
rtn4-g64-asym-clip-e4-h4|--method rtn --group-size 64 --asym --clip-search --embed-bits 4 --quantize-lm-head
rtn4-g32-asym-clip-e4-h4|--method rtn --group-size 32 --asym --clip-search --embed-bits 4 --quantize-lm-head
rtn4-g128-asym-clip-e8-h4|--method rtn --asym --clip-search --embed-bits 8 --quantize-lm-head
gptq4-g128-e4-h4|--method gptq --embed-bits 4 --quantize-lm-head
gptq4-g128-asym-e4-h4|--method gptq --asym --gptq-variant gptaq --embed-bits 4 --quantize-lm-head
gptq4-g128-asym-clip-e8-h4|--method gptq --asym --gptq-variant gptaq --clip-search --embed-bits 8 --quantize-lm-head
gptq4-g64-asym-clip-e4-h4|--method gptq --group-size 64 --asym --gptq-variant gptaq --clip-search --embed-bits 4 --quantize-lm-head
gptq4-g64-asym-clip-e4-h8|--method gptq --group-size 64 --asym --gptq-variant gptaq --clip-search --embed-bits 4 --head-bits 8
gptq4-g128-asym-clip-e4-h8|--method gptq --asym --gptq-variant gptaq --clip-search --embed-bits 4 --head-bits 8
gptq4-g32-asym-clip-e4-h8|--method gptq --group-size 32 --asym --gptq-variant gptaq --clip-search --embed-bits 4 --head-bits 8
rtn8-e8-h8|--method rtn --bits 8 --group-size -1 --embed-bits 8 --quantize-lm-head
LIST
# llama.cpp: its types from the BF16 export, dequantized back by llamactl convert and scored the same way
llamactl convert embedded -o "$out/bf16.gguf" --force --json > /dev/null
python -c "
import json, llamactl, pathlib
src = pathlib.Path('../shared/calib/docs-calib.jsonl')
lines = [json.loads(l)['text'] for l in src.open()][:256]
pathlib.Path('$out/calib.txt').write_text('\n\n'.join(lines))"
[ -f "$out/imatrix.dat" ] || "$bin/llama-imatrix" -m "$out/bf16.gguf" -f "$out/calib.txt" -o "$out/imatrix.dat" -c 512 --chunks 64 -t 2 > "$out/imatrix.log" 2>&1 || tail -3 "$out/imatrix.log"
for t in Q4_0 IQ4_XS Q4_K_M Q5_K_M Q6_K Q8_0; do
  for im in none imatrix; do
    name="$t-$im"; flag=(); [ $im = imatrix ] && flag=(--imatrix "$out/imatrix.dat")
    "$bin/llama-quantize" "${flag[@]}" "$out/bf16.gguf" "$out/$name.gguf" "$t" > "$out/$name.q.log" 2>&1 || { tail -2 "$out/$name.q.log"; continue; }
    llamactl convert "$out/$name.gguf" -o "$out/$name-hf" --dtype f32 --force --json > /dev/null 2> "$out/$name.c.err" || { tail -2 "$out/$name.c.err"; continue; }
    llamactl bench "$out/$name-hf" --quality --reference embedded --eval-tokens "$n" --device cpu --gen-len 2 --prompt-len 8 \
      --warmup 0 --repeat 1 --format json -o "$out/$name.bench.json" > /dev/null 2> "$out/$name.b.err" \
      && row "llama.cpp $name" "$out/$name.gguf" "$out/$name.bench.json" | tee -a "$out/table.md" || tail -2 "$out/$name.b.err"
  done
done
