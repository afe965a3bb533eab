#!/usr/bin/env bash
# One GPU-machine session: GPU tests, then the standard bench cases of ../shared/bench/PROTOCOL.md.
# Usage (on the device machine, repo root): bash scripts/gpu_run.sh OUTDIR
set -uo pipefail
out=${1:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the device machine gets the tree without .git: `git rev-parse --short HEAD > .commit` here, then carry .commit
[ -f .commit ] && export LLAMACTL_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)" | tee -a "$out/gpu.txt"
: > "$out/tests.txt"
run() { name=$1; shift; python -m llamactl bench "$@" --format json -o "$out/$name.json" > /dev/null 2> "$out/$name.err" \
          && python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$out/$name.json'))))" > "$out/$name.md" \
          && cat "$out/$name.md" || tail -20 "$out/$name.err"; }
python -m pytest -q -x tests/test_int4.py 2>&1 | tail -3 | tee -a "$out/tests.txt"
run llama2-7b-bf16 --synthetic llama2-7b --mode compile --prompt-len 128 --gen-len 256 --warmup 2 --repeat 5
run llama2-7b-int4 --synthetic llama2-7b --synthetic-quant int4 --dtype bfloat16 --mode graphs,compile --prompt-len 128 --gen-len 256 --warmup 2 --repeat 5
run llama2-7b-int8 --synthetic llama2-7b --synthetic-quant int8 --dtype bfloat16 --mode compile --prompt-len 128 --gen-len 256 --warmup 2 --repeat 5
run llama3-8b --synthetic llama3-8b --mode compile --prompt-len 128,2048 --gen-len 256 --warmup 2 --repeat 5
