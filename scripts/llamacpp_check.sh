#!/usr/bin/env bash
# llamactl's GGUF exports of the embedded model, read by llama.cpp itself: greedy text beside
# llamactl's own on the same folder, and llama.cpp's perplexity (docs/convert.md).
# Usage: bash scripts/llamacpp_check.sh LLAMA_CPP_BIN_DIR OUT (llama.cpp built from the llama-cpp-python sdist,
# see docs/convert.md)
set -euo pipefail
bin=$1; out=$2; mkdir -p "$out"
prompt="The kernel"
eval_text=$(python -c "import llamactl, pathlib; print(pathlib.Path(llamactl.__file__).parent / 'assets' / 'docs-eval.txt')")
llamactl quantize embedded -o "$out/rtn-g32-sym" --method rtn --group-size 32 --eval-tokens 0 -q --force > /dev/null
llamactl quantize embedded -o "$out/rtn-g128-asym" --method rtn --asym --eval-tokens 0 -q --force > /dev/null
llamactl quantize embedded -o "$out/rtn8-g32" --method rtn --bits 8 --group-size 32 --eval-tokens 0 -q --force > /dev/null
for pair in "bf16:embedded" "q4_0:$out/rtn-g32-sym" "q4_1:$out/rtn-g128-asym" "q8_0:$out/rtn8-g32"; do
  name=${pair%%:*}; src=${pair#*:}
  llamactl convert "$src" -o "$out/$name.gguf" --force --json > "$out/$name.convert.json"
  echo "== $name ($(python -c "import json; m=json.load(open('$out/$name.convert.json'))['metrics']; print(m['tensor_types'], m['bits_per_weight'], 'bpw')"))"
  theirs=$("$bin/llama-simple" -m "$out/$name.gguf" -n 32 "$prompt" 2> /dev/null | sed 's/^<s>//')
  ours="$prompt$(llamactl generate "$src" -p "$prompt" -n 32 --temperature 0 2> /dev/null)"
  echo "llama.cpp greedy: $(echo "$theirs" | tr '\n' ' ')"
  [ "$theirs" = "$ours" ] && echo "llamactl greedy:  the same text" || echo "llamactl greedy:  $(echo "$ours" | tr '\n' ' ')"
  "$bin/llama-perplexity" -m "$out/$name.gguf" -f "$eval_text" -c 512 --chunks 32 -t 2 2> "$out/$name.ppl.txt" > /dev/null || true
  grep -o "Final estimate: PPL = [0-9.]* +/- [0-9.]*" "$out/$name.ppl.txt" || tail -2 "$out/$name.ppl.txt"
done
