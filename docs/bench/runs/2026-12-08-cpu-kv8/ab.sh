#!/usr/bin/env bash
# CPU A/B of the 8-bit KV cache: old tree (9a401cd~1, a git worktree at /tmp/old-cpu) and new (9a401cd),
# order old new new old, prompts 512 and 1536; the embedded model, float32
set -u
. /work/main/.venv/bin/activate
out=/tmp/cpuab
for plen in 512 1536; do
  for tree in old new new old; do
    dir=/work/main; [ $tree = old ] && dir=/tmp/old-cpu
    n=$(ls $out | grep -c "^$tree-$plen-" || true)
    (cd $dir && PYTHONPATH=$dir python -m llamactl bench --device cpu --dtype float32 --prompt-len $plen --gen-len 128 \
      --warmup 1 --repeat 3 --kv-dtype auto,int8,fp8 --format json -o $out/$tree-$plen-$n.json > /dev/null 2>&1)
    python - $out/$tree-$plen-$n.json $tree $plen <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(sys.argv[2], sys.argv[3], " ".join(f"{r['kv_dtype']} {r['decode_tok_s']:.1f} ({r['speedup']:.3f}x)" for r in rows), flush=True)
PY
  done
done
