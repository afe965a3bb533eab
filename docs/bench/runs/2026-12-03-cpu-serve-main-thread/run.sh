# CPU serve A/B: old tree (engine on its own thread) vs this tree (engine on the main thread), embedded model
set -u
out=$1; old=$2; new=$3
srv() { # name tree
  (cd $2 && exec python -m llamactl serve --port 0 --max-batch 8 --max-seq 512) > /dev/null 2> $out/srv-$1.err &
  local pid=$!
  for i in $(seq 120); do grep -q serving $out/srv-$1.err && break; sleep 1; done
  local url=$(grep -o "http://[0-9.:]*" $out/srv-$1.err | head -1)
  python -m llamactl bench --url $url --prompt-len 128 --gen-len 64 --concurrency 1,8 --requests 8 --format json -o $out/serve-$1.json > /dev/null 2>&1
  kill -TERM $pid; wait $pid
}
python -m llamactl generate -p "$(head -c 600 llamactl/assets/docs-eval.txt)" -n 64 --temperature 0 --json > $out/generate.json 2>/dev/null
srv old1 $old; srv new1 $new; srv new2 $new; srv old2 $old
python -m llamactl generate -p "$(head -c 600 llamactl/assets/docs-eval.txt)" -n 64 --temperature 0 --json > $out/generate2.json 2>/dev/null
