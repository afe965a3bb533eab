#!/usr/bin/env bash
# Cold compile against a warm start from `llamactl compile` artifacts, each in a fresh process with
# empty inductor and Triton caches, so only the artifacts can make the second one warm.
# Usage: bash scripts/compile_warm_start.sh MODEL OUTDIR [DEVICE]
set -euo pipefail
model=$1; out=$2; dev=${3:-auto}
mkdir -p "$out"
t() { local s=$(date +%s.%N); "$@" > /dev/null 2>>"$out/log"; python -c "print(round($(date +%s.%N) - $s, 2))"; }
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
cold=$(t python -m llamactl generate "$model" --compile --device "$dev" -p "The kernel" -n 32 --temperature 0)
# the floor of any start: no torch.compile, llamactl's Triton kernels already built and tuned (the caches above)
eager=$(t python -m llamactl generate "$model" --device "$dev" -p "The kernel" -n 32 --temperature 0)
python -m llamactl compile "$model" -o "$out/compiled" --buckets 128 --device "$dev" --force > /dev/null 2>>"$out/log"
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
warm=$(t python -m llamactl generate "$out/compiled" --compile --device "$dev" -p "The kernel" -n 32 --temperature 0)
# the same warm start again, empty caches again: what the first one pays once on this machine (runs 18 and 42: its
# in-process rerun below took 8-9 s less) shows as the difference
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
warm2=$(t python -m llamactl generate "$out/compiled" --compile --device "$dev" -p "The kernel" -n 32 --temperature 0)
# and once more with Inductor's compile workers off (one thread): a warm start compiles nothing, but by default
# Inductor starts a pool of worker processes at its first compile, which a short process may wait on at exit
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
warm1t=$(TORCHINDUCTOR_COMPILE_THREADS=1 t python -m llamactl generate "$out/compiled" --compile --device "$dev" -p "The kernel" \
  -n 32 --temperature 0)
echo "generate -n 32, whole process: eager with built kernels ${eager}s, cold compile ${cold}s, warm start from artifacts ${warm}s, again ${warm2}s, with TORCHINDUCTOR_COMPILE_THREADS=1 ${warm1t}s"
python -c "c, w, e = $cold, $warm2, $eager; print(f'with the second warm start: cold/warm {c / w:.2f}x; above the eager floor ratio {(c - e) / max(w - e, 1e-3):.1f}x')"
python -c "c, w, e = $cold, $warm, $eager; print(f'whole process: cold/warm {c / w:.2f}x; above the eager floor: cold {c - e:.1f}s, warm {w - e:.1f}s, ratio {(c - e) / max(w - e, 1e-3):.1f}x')"
