# the CPU A/B of generate --draft ngram: OLD (its own loop, dfd6156) and NEW (the serving engine), 3 rounds, orders alternating
# Usage: [ROUNDS=3] bash ab.sh OUT.jsonl (the old tree at /tmp/oldtree: git worktree add /tmp/oldtree dfd6156)
out=$1; : > $out
for round in $(seq 1 ${ROUNDS:-3}); do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for tree in $order; do
    dir=/work/main; [ $tree = old ] && dir=/tmp/oldtree
    for draft in ngram none; do
      args=(); [ "$draft" = none ] || args=(--draft "$draft")
      (cd $dir && PYTHONPATH=$dir python -m llamactl generate -n 128 --temperature 0 --ignore-eos --device cpu --json "${args[@]}" < /tmp/work/copy-prompt.txt 2>/dev/null) \
        | python -c "import json,sys; r=json.loads(sys.stdin.read()); s=r['extra'].get('speculation') or {}; print(json.dumps({'round': $round, 'tree': '$tree', 'draft': '$draft', 'decode_tok_s': round(r['decode_tok_s'],1), 'ttft_ms': round(r['ttft_s']*1000,1), 'prompt_tokens': r['prompt_tokens'], 'generated': len(r['token_ids']), 'tokens_hash': hash(tuple(r['token_ids'])), **{k: s.get(k) for k in ('acceptance','tokens_per_step','verify_steps','plain_steps')}}))" >> $out
    done
  done
done
