#!/usr/bin/env bash
# A/B on the GPU machine: the server as it is, then with a 0.5 ms GIL switch interval.
set -u
O=$1
run_level() {  # $1 name, $2.. the server's python -c prefix
  name=$1; shift
  "$@" > /dev/null 2> $O/srv-$name.err &
  P=$!
  for i in $(seq 1 120); do grep -q "serving" $O/srv-$name.err && break; sleep 1; done
  URL=$(grep -o "http://[0-9.:]*" $O/srv-$name.err | head -1)
  python -m llamactl bench --url $URL --prompt-len 128 --gen-len 256 --concurrency 1,8,32 --requests 32 --format json -o $O/ab-$name.json > /dev/null 2> $O/ab-$name.err
  kill -TERM $P; wait $P
}
S="--synthetic llama2-7b --dtype bfloat16 --max-batch 32 --max-seq 640 --port 0"
run_level base python -m llamactl serve $S
run_level switch python -c "import sys, runpy; sys.setswitchinterval(5e-4); sys.argv = ['llamactl', 'serve'] + sys.argv[1:]; runpy.run_module('llamactl', run_name='__main__')" $S
