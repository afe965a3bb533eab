# Sourced by the GPU scripts (repository root, $out set): the carried .whl/ wheels (starlette,
# uvicorn; see scripts/README.md) on PYTHONPATH when there are any, unbuffered output, and the GPU
# named in $out/gpu.txt; helpers: served_url ERRFILE (a starting server's URL), md JSON (bench's table).
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# The URL a `llamactl serve` prints to ERRFILE once it serves (waiting up to 300 s, or until
# process PID, where given, has ended; empty if never).
served_url() {
  for _ in $(seq 1 300); do
    grep -q "serving" "$1" && break
    [ -n "${2:-}" ] && ! kill -0 "$2" 2> /dev/null && { tail -5 "$1" >&2; break; }
    sleep 1
  done
  grep -o "http://[0-9.:]*" "$1" | head -1
}
# A bench JSON as bench's markdown table.
md() { python -c "from llamactl.bench import report; import json; print(report.to_markdown(json.load(open('$1'))))"; }
