# serve --draft ngram on the CPU, 1 stream: the tree before today's verify changes (/tmp/oldtree, dfd6156) and this one, alternating
out=$1; : > $out
ds=/work/main/docs/decisions/runs/2026-12-06-speculative/copy-prompts.jsonl
for round in 1 2; do
  if [ $round = 1 ]; then order="old new"; else order="new old"; fi
  for tree in $order; do
    dir=/work/main; [ $tree = old ] && dir=/tmp/oldtree
    for draft in ngram none; do
      args=(); [ "$draft" = none ] || args=(--draft ngram)
      (cd $dir && PYTHONPATH=$dir python -m llamactl serve --port 0 --device cpu "${args[@]}" 2> /tmp/work/srv.err &)
      for _ in $(seq 1 120); do grep -q "serving" /tmp/work/srv.err && break; sleep 1; done
      url=$(grep -o "http://[0-9.:]*" /tmp/work/srv.err | head -1)
      python -m llamactl bench --url $url --dataset $ds --gen-len 128 --concurrency 1 --requests 9 --format json -o /tmp/work/b.json > /dev/null 2>&1
      pkill -TERM -f "llamactl serve --port 0 --device cpu" ; sleep 2
      python -c "import json; r=json.load(open('/tmp/work/b.json'))['results'][0]; print(json.dumps({'round': $round, 'tree': '$tree', 'draft': '$draft', 'output_tok_s': r.get('output_tok_s'), 'errors': r.get('errors')}))" >> $out
    done
  done
done
