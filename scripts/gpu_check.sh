#!/usr/bin/env bash
# The one repeatable GPU check (docs/bench/PROTOCOL.md): the standard bench, bench --compare against
# the committed H200 baseline, then the GPU tests. Run on the GPU machine, repository root.
# Usage: bash scripts/gpu_check.sh OUTDIR [pytest args...]    (OUTDIR gets tests.txt, llama2-7b.json/.md, compare.txt)
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python -m llamactl bench --synthetic llama2-7b --synthetic-quant none,int4,int8 --dtype bfloat16 --mode compile \
  --prompt-len 128 --gen-len 256 --warmup 2 --repeat 5 --format json -o "$out/llama2-7b.json" > /dev/null 2> "$out/bench.err" \
  || tail -20 "$out/bench.err"
python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$out/llama2-7b.json'))))" \
  | tee "$out/llama2-7b.md"
python -m llamactl bench --compare docs/bench/baselines/h200-llama2-7b.json "$out/llama2-7b.json" --max-slowdown 3% \
  | tee "$out/compare.txt"
# the tests after the bench: run before it, they left prefill (128 tokens, eager, launch-bound) 15-43%
# slower in the bench that followed while decode did not move (device calls 4 and 6 against 5)
python -m pytest -m gpu -q -p no:cacheprovider "$@" > "$out/tests.txt" 2>&1; tail -5 "$out/tests.txt"
