#!/usr/bin/env bash
# Speculation in the server (issue 50's serve goals): `llamactl serve --draft DRAFT` against the same
# server without it, under `bench --url` (greedy, EOS ignored), servers alternating off/on/on/off:
#   copy-C       the embedded model (a trained one), prompts that ask for a copy of a guide's text
#                (prompt lookup's case), 128 tokens, C streams (1 and 32)
#   chat32       the llama3-8b shape, bf16 random weights, prompts 64:1024 words, answers 64:512,
#                32 streams: a loaded server, where speculation must step aside
# Each run's bench JSON is OUTDIR/NAME-off|on-ROUND.json; a line a run (output tok/s, TPOT, the
# server's acceptance) to stdout and OUTDIR/spec-serve.jsonl. Carry .whl/.
# Usage: [DRAFT=ngram] [ROUNDS=2] [RUNS="copy-1 copy-32 chat32"] bash scripts/gpu_spec_serve.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_spec_serve.sh OUTDIR}
. "$(dirname "$0")/device_env.sh"
draft=${DRAFT:-ngram}
mkdir -p /tmp/runs
python - > /tmp/copy.jsonl <<'EOF'
import json, pathlib
text = "".join(p.read_text() for p in sorted(pathlib.Path("docs/guide").glob("*.md")))
for i in range(64):
    chunk = text[i * 700:(i + 1) * 700]
    print(json.dumps({"prompt": "Repeat the following text exactly.\n\n" + chunk + "\n\n" + chunk[:200]}))
EOF

# run NAME SIDE ROUND SERVE_ARGS -- BENCH_ARGS: one server and one load test
run() {
  local name=$1 side=$2 round=$3; shift 3
  local serve_args=() bench_args=()
  while [ "$1" != -- ]; do serve_args+=("$1"); shift; done; shift; bench_args=("$@")
  [ "$side" = on ] && serve_args+=(--draft "$draft")
  python -m llamactl serve "${serve_args[@]}" --port 0 > /dev/null 2> "/tmp/runs/srv-$name-$side.err" &
  local pid=$!
  local url; url=$(served_url "/tmp/runs/srv-$name-$side.err" $pid)
  local json="$out/$name-$side-$round.json"
  timeout 240 python -m llamactl bench --url "$url" "${bench_args[@]}" --format json -o "$json" > /dev/null \
    2> "/tmp/runs/$name.err" || tail -3 "/tmp/runs/$name.err"
  kill -TERM $pid; wait $pid
  python - "$json" "$name" "$side" "$round" <<'EOF' | tee -a "$out/spec-serve.jsonl"
import json, sys
path, name, side, rnd = sys.argv[1:]
try:
    r = json.load(open(path))["results"][0]
except (OSError, ValueError, KeyError, IndexError) as e:
    r = {"failed": f"{type(e).__name__}: {e}"}
keys = ("concurrency", "errors", "output_tok_s", "tpot_ms_mean", "tpot_ms_p50", "itl_ms_p50", "ttft_ms_p50", "failed")
row = {"run": name, "side": side, "round": int(rnd), **{k: r.get(k) for k in keys}}
row["spec_acceptance"] = r.get("server", {}).get("spec_acceptance")
row["verify_steps"] = r.get("engine", {}).get("verify_steps")
print(json.dumps(row))
EOF
}

COPY=(--dataset /tmp/copy.jsonl --gen-len 128)
CHAT=(--synthetic llama3-8b --dtype bfloat16)
for name in ${RUNS:-copy-1 copy-32 chat32}; do
  for round in $(seq 1 "${ROUNDS:-2}"); do
    sides="off on"; [ $((round % 2)) = 0 ] && sides="on off"
    for side in $sides; do
      case $name in
        copy-1) run "$name" "$side" "$round" -- "${COPY[@]}" --concurrency 1 --requests 16 ;;
        copy-32) run "$name" "$side" "$round" -- "${COPY[@]}" --concurrency 32 --requests 64 ;;
        chat32) run "$name" "$side" "$round" "${CHAT[@]}" -- --prompt-len 64:1024 --gen-len 64:512 \
                  --concurrency 32 --requests 64 ;;
        *) echo "unknown run $name" ;;
      esac
    done
  done
done
