#!/usr/bin/env bash
# One device call: gpu_run.sh parts, each with its own deadline, then everything packed into one file
# (the device returns at most 8 files). A part past its deadline is killed with its whole process
# group (pytest and bench children included), so the next part starts on an idle GPU.
# Usage: bash scripts/gpu_parts.sh OUTDIR PART:SECONDS...   ->  OUTDIR/x.tgz
set -u
out=$1; shift
mkdir -p "$out/r"
for spec in "$@"; do
  part=${spec%%:*}; limit=${spec##*:}; t0=$SECONDS
  setsid bash scripts/gpu_run.sh "$out/r" "$part" > "$out/r/$part.log" 2>&1 &
  pid=$!
  ( sleep "$limit"; kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null ) &
  watchdog=$!
  wait "$pid"; rc=$?
  kill "$watchdog" 2>/dev/null
  echo "$part: rc $rc, $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/r/parts.txt"
done
tar czf "$out/x.tgz" -C "$out" r && rm -rf "$out/r"
