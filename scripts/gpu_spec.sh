#!/usr/bin/env bash
# Speculative decoding on the lent GPU (issue 50): the batch-1 table from measured step costs
# (scripts/spec_table.py: llama3-8b and llama2-7b shapes, bf16, the self-int4 draft) and prompt lookup
# end to end on the embedded model (generate --draft ngram against plain decoding, 3 rounds
# interleaved, a prompt that asks for a copy of a guide's text). Repository root; OUTDIR gets
# spec-SHAPE.json and ngram.jsonl.
# Usage: bash scripts/gpu_spec.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_spec.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
for shape in llama3-8b llama2-7b; do
  python scripts/spec_table.py "$out/spec-$shape.json" --synthetic "$shape" --draft self-int4 --device cuda \
    --k 1,2,4,6,8 2> "$out/spec-$shape.err" | head -1 || tail -3 "$out/spec-$shape.err"
done
prompt=/tmp/copy-prompt.txt
{ echo "Repeat the following text exactly."; head -c 1500 docs/guide/serving.md; head -c 200 docs/guide/serving.md; } > "$prompt"
for round in 1 2 3; do
  for draft in ngram none; do
    args=(); [ "$draft" = none ] || args=(--draft "$draft")
    python -m llamactl generate -n 128 --temperature 0 --ignore-eos --device cuda --json "${args[@]}" < "$prompt" \
      2> "$out/ngram.err" | python -c "import json,sys; r=json.loads(sys.stdin.read()); [r.pop(k,None) for k in ('text','token_ids')]; r.update(round=$round, draft='$draft'); print(json.dumps(r))" \
      >> "$out/ngram.jsonl" || tail -3 "$out/ngram.err"
  done
done
cat "$out/ngram.jsonl" | cut -c1-300
