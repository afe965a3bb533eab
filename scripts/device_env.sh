# Sourced by the GPU scripts (repository root, $out set): the carried .whl/ wheels (starlette,
# uvicorn; see scripts/README.md) on PYTHONPATH when there are any, unbuffered output, and the GPU
# named in $out/gpu.txt.
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
