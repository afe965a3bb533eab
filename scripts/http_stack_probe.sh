#!/usr/bin/env bash
# The HTTP side's cost in `llamactl serve`, by uvicorn's stack: h11 on asyncio's loop (what uvicorn
# falls back to without httptools and uvloop) against httptools on uvloop (what it picks when they
# are installed: the serve extra). Each round starts a server on the embedded model (CPU) with
# each stack, in turn, and runs scripts/serve_breakdown.py at concurrency 1, 8, 32: the client's
# TTFT beside the server's shows the HTTP side, and so does the CPU time of its HTTP thread (uvicorn's
# loop: parsing, routing, detokenizing, writing events) a request, which the model's own noise on
# a small machine does not blur. Needs httptools and uvloop installed; the h11 runs hide them from
# uvicorn (a sitecustomize that makes their imports fail).
# Usage: bash scripts/http_stack_probe.sh OUTDIR [ROUNDS=2] [REQUESTS=64] [GEN=32]
set -uo pipefail
out=${1:?usage: http_stack_probe.sh OUTDIR [rounds] [requests] [gen]}; rounds=${2:-2}; requests=${3:-64}; gen=${4:-32}
mkdir -p "$out" /tmp/h11-only
printf 'import sys\nsys.modules["httptools"] = None\nsys.modules["uvloop"] = None\n' > /tmp/h11-only/sitecustomize.py
for r in $(seq 1 "$rounds"); do
  for stack in h11 httptools; do
    extra=""; [ "$stack" = h11 ] && extra=/tmp/h11-only
    PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}" python -m llamactl serve --max-batch 32 --port 0 \
      > /dev/null 2> /tmp/srv-$stack.err &
    pid=$!
    for _ in $(seq 1 120); do grep -q serving /tmp/srv-$stack.err && break; sleep 0.5; done
    url=$(grep -o "http://[0-9.:]*" /tmp/srv-$stack.err | head -1)
    echo "round $r, $stack: $(grep serving /tmp/srv-$stack.err)"
    python scripts/serve_breakdown.py "$url" --concurrency 1,8,32 --requests "$requests" -o "$out/$stack-$r.json" \
      -- --prompt-len 128 --gen-len "$gen" 2> /dev/null
    kill -TERM $pid; wait $pid
  done
done
