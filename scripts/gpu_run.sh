#!/usr/bin/env bash
# GPU-machine runs: tests, the kernel probe, and the standard bench cases of ../shared/bench/PROTOCOL.md.
# Usage (on the device machine, repo root): bash scripts/gpu_run.sh OUTDIR PART...
# (one device call: bash scripts/gpu_parts.sh OUTDIR PART:SECONDS... gives each part a deadline and packs OUTDIR)
#   tests   the kernel tests on the GPU (tests/test_kernels.py)
#   gputests the other GPU tests: decode modes, int4/int8 checkpoints, generate and bench with int8 inputs
#   probe   scripts/kernel_probe.py: llamactl's Triton kernels against cuBLAS/tinygemm/SDPA per shape
#   attn1   bf16 and int8 with int8 inputs, decode attention in one kernel a layer (LLAMACTL_ATTN_MIN_CHUNK=512) and not
#   everygemv test_kernels.py's every-GEMV-candidate test alone (each config's product, int8 inputs included)
#   a8sweep kernel_probe.py --sweep "int8 x int8": every int8 x int8 GEMV candidate per step shape, the fastest as a pins file
#   sweep16 kernel_probe.py --sweep "int4 fp16": every int4 fp16 candidate per step shape, the fastest as a pins file
#   sweep8  the same for int8 weights with float inputs (int8 and int4 float pins: sweep8, sweep4)
#   h16     bf16 and int4 with float inputs and in fp16 (3 rows), the pins of the sweeps run before it in the call
#   sweep8h the same for int8 in fp16; int8h: bf16 and int8 with float inputs and in fp16 (3 rows), those pins
#   int8w   bf16 and int8 with float inputs (2 rows), the same pins
#   every4  test_kernels' every-int4-candidate test (float, int8 inputs, fp16), stopping at the first failure
#   exact   scripts/int4_exactness.py: each int4 candidate's float, int8-input and fp16 errors against exact references
#   a8exact the int8-input exactness tests, the mended reference's included (XPASS: the GPU agrees with it)
#   a8diag  scripts/a8_diagnose.py: which rounding of x the int4 int8-input GEMV applies here
#   qtest   test_gpu's bench --quality test with float, int8 and fp16 rows
#   klq     docs-llama-17m RTN int4: KL against the parent over 4K tokens (16K: past 170 s, run 38), float inputs (prefill) and int8/fp16 (decode steps)
#   h16t    h16 with kernels.pinned's table alone (no pins file)
#   h16tests the GPU tests of the fp16 GEMVs (int4, int8), every 16-bit/int8 candidate, and the inputs' own checks
#   a8pinned bf16 and int8 with int8 inputs, pinned to a8sweep's picks (after a8sweep in the same call)
#   stepprobe kernel_probe.py --step: llama2-7b's step GEMVs per kind (bf16, int8, int4; float/int8 inputs), summed
#   bf16    llama2-7b bf16, compile + graphs, Triton kernels on and off, with a kernel profile of each
#   quant   llama2-7b bf16, int4 g128 and int8 in one run (compile + graphs)
#   l3      llama3-8b bf16, 128- and 2048-token prompts
#   long    llama3-8b bf16 at a 128- and a 16K-token context (grouped-query attention)
#   ladder  llama2-7b: transformers eager and static cache, llamactl eager, graphs, compile (kernels on), one run
#   warm    cold compile against a warm start from `llamactl compile` artifacts, regional compilation on and off
#   regions llama2-7b bf16 decode with regional compilation (LLAMACTL_COMPILE_REGIONS=1), to decide its CUDA default
#   swiglu  the quant case again with SwiGLU in down_proj's kernel (LLAMACTL_SWIGLU=down), against quant's default
#   pdl     the quant case with programmatic dependent launch off and on in one run (bench --pdl off,on: 6 rows)
#   a8      bf16, and int4 and int8 each with float and int8 GEMV inputs (bench --quant-inputs float,int8: 5 rows), one run
#   a8int8  a8's bf16 and int8 rows only, no profile (3 rows); a8int4 the same for int4
#   a8prof  the int8 model with int8 inputs alone, with its decode step's kernel table
#   pin     the quant case with every shape tuned (LLAMACTL_PIN_CONFIGS=0), then with kernels.pinned's H200 picks
#   a8tests the GPU tests of the int8-input (DP4A) GEMVs and the self-check only (every other test: tests)
# pytest writes straight to OUT (a part cut short keeps the dots and failures so far; run 26 lost them behind `| tail`).
# Times measured (runs 17-22; a fresh machine's Triton caches are cold): pdl 440 s fresh, 372 s on a
# warm machine; warm 389 s; l3 94 s and long 54 s (warm machine); ladder over 150 s; probe about
# 300 s; tests about 380 s; quant/swiglu about half of pdl; a8 (5 rows) over 400 s on a fresh
# machine (run 23, cut off); on a warm one a8int8 142 s, a8int4 46 s, a8tests 71 s (over 150 s fresh), ladder 190 s,
# tests over 480 s (runs 24-26).
# A device call is at most 600 s. A part cut short leaves its measured rows in OUT/NAME.err.
set -uo pipefail
out=${1:-out}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the device machine gets the tree without .git: `git rev-parse --short HEAD > .commit` here, then carry .commit
[ -f .commit ] && export LLAMACTL_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt"
python -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"
cat "$out/gpu.txt"
std=(--prompt-len 128 --gen-len 256 --warmup 2 --repeat 5)
# TRITON_PRINT_AUTOTUNING: the config each kernel's autotuner chose per shape goes to $out/autotune.txt
# (one file for all parts: the device returns at most 8 files)
# commands.txt names the LLAMACTL_ switches a part sets for its bench (run 31's file had to be mended by hand)
bench() { name=$1; shift; local sw; sw=$(env | grep -E '^LLAMACTL_' | grep -v '^LLAMACTL_COMMIT=' | sort | tr '\n' ' ')
          echo "== $name: ${sw}llamactl bench $*" | tee -a "$out/commands.txt" >> "$out/autotune.txt"
          TRITON_PRINT_AUTOTUNING=1 python -m llamactl bench "$@" --format json -o "$out/$name.json" 2> "$out/$name.err" \
          | grep -iE "autotuning for|with key|best config" >> "$out/autotune.txt"; [ -s "$out/$name.json" ] \
          && python -c "from llamactl import report; import json; print(report.to_markdown(json.load(open('$out/$name.json'))))" > "$out/$name.md" \
          && cat "$out/$name.md" || tail -20 "$out/$name.err"; rm -f "$out/$name.err"; }
for part in "$@"; do
  t0=$SECONDS
  case $part in
    # (the sm_90 compile test needs no GPU: CI runs it)
    # run 26's `tests` (both halves together) ran past 480 s on a machine warmed by benches: one half a call
    tests) python -m pytest -q -p no:cacheprovider --durations=12 tests/test_kernels.py \
             --deselect tests/test_kernels.py::test_kernels_compile_for_hopper > "$out/tests.txt" 2>&1; tail -30 "$out/tests.txt" ;;
    gputests) python -m pytest -v -p no:cacheprovider --durations=12 tests/test_gpu.py tests/test_int4.py tests/test_pinned.py \
                > "$out/gputests.txt" 2>&1; tail -30 "$out/gputests.txt" ;;
    a8tests) python -m pytest -q -p no:cacheprovider tests/test_quant_inputs.py tests/test_kernels.py -k "a8 or int8_inputs or self_check" \
               > "$out/a8tests.txt" 2>&1; tail -15 "$out/a8tests.txt" ;;
    # each 16-bit/int8 GEMV candidate's product at odd sizes (masks), int8 inputs included: test_kernels' config test alone
    everygemv) python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k every_gemv_autotune_config \
               > "$out/everygemv.txt" 2>&1; tail -5 "$out/everygemv.txt" ;;
    # every int8 x int8 candidate per step shape (in-graph timing), the fastest written as a pins file for a8pinned
    a8sweep) python scripts/kernel_probe.py --sweep "int8 x int8" "$out/a8pins.json" 2>&1 | tee "$out/a8sweep.txt" ;;
    sweep16|sweep8h|sweep8|sweep4|sweepi8|sweepi4) kind=$(case $part in sweep16) echo "int4 fp16";; sweep8h) echo "int8 fp16";;
                                    sweep8) echo int8;; sweepi8) echo "int8 x int16";; sweepi4) echo "int4 x int16";; *) echo int4;; esac)
           python scripts/kernel_probe.py --sweep "$kind" "$out/$part-pins.json" 2>&1 | tee "$out/$part.txt"
           python -c "import json, sys; print(json.dumps(sum((json.load(open(f)) for f in sys.argv[1:]), [])))" \
             "$out"/sweep*-pins.json > "$out/pins.json" ;;
    h16) LLAMACTL_PINS_FILE=$out/pins.json bench llama2-7b-h16 --synthetic llama2-7b --synthetic-quant none,int4 \
           --dtype bfloat16 --mode compile --quant-inputs float,fp16 "${std[@]}" ;;
    int8h) LLAMACTL_PINS_FILE=$out/pins.json bench llama2-7b-int8h --synthetic llama2-7b --synthetic-quant none,int8 \
           --dtype bfloat16 --mode compile --quant-inputs float,fp16 "${std[@]}" ;;
    # bf16, int4 and int8 with fp16 arithmetic and int16 inputs in one run (the int16 shapes pinned by sweepi8/sweepi4)
    i16) LLAMACTL_PINS_FILE=$out/pins.json bench llama2-7b-i16 --synthetic llama2-7b --synthetic-quant none,int4,int8 \
           --dtype bfloat16 --mode compile --quant-inputs fp16,int16 "${std[@]}" ;;
    # bf16, int4 and int8 with the default inputs (int16) and kernels.pinned's table alone
    i16d) bench llama2-7b-i16d --synthetic llama2-7b --synthetic-quant none,int4,int8 --dtype bfloat16 --mode compile \
            "${std[@]}" ;;
    # the GPU tests of generate/compile/bench paths with the default inputs, but the 3-minute synthetic int4 bench
    gpudefault) python -m pytest -v -p no:cacheprovider --durations=8 tests/test_gpu.py tests/test_int4.py tests/test_pinned.py \
                  -k "not bench_synthetic_int4" > "$out/gpudefault.txt" 2>&1; tail -25 "$out/gpudefault.txt" ;;
    i16tests) python -m pytest -q -rxX -p no:cacheprovider tests/test_int16_inputs.py tests/test_quant_inputs.py \
                -k "int16 or i16 or int8_input_candidates or own" > "$out/i16tests.txt" 2>&1; tail -15 "$out/i16tests.txt" ;;
    int8w) LLAMACTL_PINS_FILE=$out/pins.json bench llama2-7b-int8w --synthetic llama2-7b --synthetic-quant none,int8 \
           --dtype bfloat16 --mode compile "${std[@]}" ;;
    # test_kernels' every-int4-candidate test alone, stopping at the first failure with its traceback
    every4) python -m pytest -x -q -p no:cacheprovider --tb=long tests/test_kernels.py -k every_int4 > "$out/every4.txt" 2>&1
            tail -60 "$out/every4.txt" ;;
    a8exact) python -m pytest -q -rxX -p no:cacheprovider tests/test_kernels.py tests/test_quant_inputs.py \
               -k "int8_input_candidates or a8" > "$out/a8exact.txt" 2>&1; tail -15 "$out/a8exact.txt" ;;
    a8diag) python scripts/a8_diagnose.py 2>&1 | tee "$out/a8diag.txt" ;;
    qtest) python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k bench_scores > "$out/qtest.txt" 2>&1; tail -15 "$out/qtest.txt" ;;
    exact) python scripts/int4_exactness.py "$out/exact.json" > "$out/exact.txt" 2>&1; tail -30 "$out/exact.txt" ;;
    klq) python -m llamactl quantize llamactl/assets/docs-llama-17m --method rtn --bits 4 --group-size 128 -o /tmp/rtn4 \
           --device cpu --eval-tokens 0 --force > /dev/null 2>&1
         bench docs17m-rtn4-quality /tmp/rtn4 --device cuda --dtype bfloat16 --quality --eval-tokens 4096 \
           --quant-inputs float,int8,fp16 --prompt-len 16 --gen-len 8 --warmup 0 --repeat 1 ;;
    h16t) bench llama2-7b-h16 --synthetic llama2-7b --synthetic-quant none,int4 \
           --dtype bfloat16 --mode compile --quant-inputs float,fp16 "${std[@]}" ;;
    h16tests) python -m pytest -q -p no:cacheprovider tests/test_half_math.py tests/test_quant_inputs.py tests/test_kernels.py \
                -k "packed_fp16 or every_gemv or own" > "$out/h16tests.txt" 2>&1
              tail -15 "$out/h16tests.txt" ;;
    # bf16 and int8 with int8 inputs, the int8 shapes pinned to a8sweep's picks (run a8sweep first, same call)
    a8pinned) LLAMACTL_PINS_FILE=$out/a8pins.json bench llama2-7b-int8-a8-swept --synthetic llama2-7b \
                --synthetic-quant none,int8 --dtype bfloat16 --mode compile --quant-inputs int8 "${std[@]}" ;;
    # the decode step's GEMVs per weight kind as the model runs them (pinned picks), summed over a step
    stepprobe) python scripts/kernel_probe.py --step "$out/step.json" 2>&1 | tee "$out/step.txt" ;;
    # attention in one kernel a layer (one split over the 384-position cache) against the default plan, two processes
    attn1) for c in 64 512; do LLAMACTL_ATTN_MIN_CHUNK=$c bench llama2-7b-int8-a8-chunk$c --synthetic llama2-7b \
             --synthetic-quant none,int8 --dtype bfloat16 --mode compile --quant-inputs int8 "${std[@]}"; done ;;
    # the probe times every candidate: no pinned configs
    probe) LLAMACTL_PIN_CONFIGS=0 TRITON_PRINT_AUTOTUNING=1 python scripts/kernel_probe.py "$out/probe.json" 2>&1 | tee "$out/probe.txt" ;;
    # a part's profile folder starts empty: bench numbers its tables, so an earlier, interrupted
    # run's table would otherwise take the first name
    bf16) rm -rf /tmp/prof; bench llama2-7b-bf16 --synthetic llama2-7b --mode compile --kernels on,off "${std[@]}" --profile /tmp/prof
          for f in /tmp/prof/kernels-*.txt; do cp "$f" "$out/$(basename "$f")"; head -25 "$f"; done ;;
    quant) rm -rf /tmp/profq; bench llama2-7b-quant --synthetic llama2-7b --synthetic-quant none,int4,int8 --dtype bfloat16 --mode compile "${std[@]}" --profile /tmp/profq
           cp /tmp/profq/kernels-compile-triton-2.txt "$out/kernels-int4.txt"; head -30 "$out/kernels-int4.txt" ;;
    l3) bench llama3-8b --synthetic llama3-8b --mode compile --prompt-len 128,2048 --gen-len 256 --warmup 2 --repeat 5 ;;
    long) bench llama3-8b-16k --synthetic llama3-8b --mode compile --prompt-len 128,16384 --gen-len 256 --warmup 2 --repeat 5 ;;
    ladder) bench llama2-7b-stages --synthetic llama2-7b --stages "${std[@]}" ;;
    # the same with regional compilation off only (CUDA's default)
    warm0) LLAMACTL_COMPILE_REGIONS=0 bash scripts/compile_warm_start.sh llamactl/assets/docs-llama-17m /tmp/warm0 cuda \
             | tee "$out/warm-regions0.txt" ;;
    warm) for r in 1 0; do LLAMACTL_COMPILE_REGIONS=$r bash scripts/compile_warm_start.sh llamactl/assets/docs-llama-17m /tmp/warm$r cuda \
            | tee "$out/warm-regions$r.txt"; done ;;
    regions) LLAMACTL_COMPILE_REGIONS=1 bench llama2-7b-regions --synthetic llama2-7b --mode compile "${std[@]}" ;;
    swiglu) LLAMACTL_SWIGLU=down bench llama2-7b-quant-swiglu-down --synthetic llama2-7b --synthetic-quant none,int4,int8 \
              --dtype bfloat16 --mode compile "${std[@]}" ;;
    # the step's kernel tables, one per row in row order (bf16, int4, int8, each PDL off then on), in OUT/pdl/
    pdl) rm -rf /tmp/profp; bench llama2-7b-quant-pdl --synthetic llama2-7b --synthetic-quant none,int4,int8 \
           --dtype bfloat16 --mode compile --pdl off,on "${std[@]}" --profile /tmp/profp
         mkdir -p "$out/pdl"; cp /tmp/profp/kernels-*.txt "$out/pdl/" ;;
    # rows: bf16, int4 float/int8 inputs, int8 float/int8 inputs; kernel tables in row order in OUT/a8/
    a8) rm -rf /tmp/profa; bench llama2-7b-quant-a8 --synthetic llama2-7b --synthetic-quant none,int4,int8 \
          --dtype bfloat16 --mode compile --quant-inputs float,int8 "${std[@]}" --profile /tmp/profa
        mkdir -p "$out/a8"; cp /tmp/profa/kernels-*.txt "$out/a8/" ;;
    a8int4) bench llama2-7b-int4-a8 --synthetic llama2-7b --synthetic-quant none,int4 \
              --dtype bfloat16 --mode compile --quant-inputs float,int8 "${std[@]}" ;;
    # the quant case tuned afresh (LLAMACTL_PIN_CONFIGS=0), then with the H200's pinned configs: two processes back to back
    pin) for p in 0 1; do LLAMACTL_PIN_CONFIGS=$p bench llama2-7b-quant-pin$p --synthetic llama2-7b --synthetic-quant none,int4,int8 \
           --dtype bfloat16 --mode compile "${std[@]}"; done ;;
    # a8's int8 rows alone, without the profile: bf16, int8 float/int8 inputs
    a8int8) bench llama2-7b-int8-a8 --synthetic llama2-7b --synthetic-quant none,int8 \
              --dtype bfloat16 --mode compile --quant-inputs float,int8 "${std[@]}" ;;
    # the int8 model's step with int8 inputs, profiled: what keeps int8 under 1.6x (kernel table in OUT/)
    # int4 and int8 with the default inputs (int16), PDL off so that each kernel's time is its own: the step's kernel tables
    i16prof) rm -rf /tmp/profi; LLAMACTL_PDL=0 bench llama2-7b-i16-prof --synthetic llama2-7b --synthetic-quant int4,int8 \
               --dtype bfloat16 --mode compile "${std[@]}" --profile /tmp/profi
             cp /tmp/profi/kernels-*.txt "$out/"; head -16 /tmp/profi/kernels-*.txt ;;
    a8prof) rm -rf /tmp/profi; bench llama2-7b-int8-a8-prof --synthetic llama2-7b --synthetic-quant int8 \
              --dtype bfloat16 --mode compile --quant-inputs int8 "${std[@]}" --profile /tmp/profi
            cp /tmp/profi/kernels-*.txt "$out/"; head -30 /tmp/profi/kernels-*.txt ;;
  esac
  echo "[$part: $((SECONDS - t0)) s]"
done
