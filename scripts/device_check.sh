#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (the `device` tool):
#   CUDA device<->host round trips for every layout (tests/test_cuda.py), the data-plane tests
#   with the engine's tensors on CUDA where they apply, and `bench links` with CUDA tensors.
#
# Prepare on the development machine once (the GPU image has no liburing/xxhash headers):
#   bash scripts/device_check.sh --prepare        # downloads the .deb files into .devdeps/
# Then run on the device with carry [".devdeps"]:
#   bash scripts/device_check.sh                  # results land in $OUT (or ./device-out)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .devdeps
  (cd .devdeps && apt-get download libxxhash-dev liburing-dev liburing2 >/dev/null)
  ls .devdeps
  exit 0
fi

out=${OUT:-device-out}
mkdir -p "$out"
prefix=/tmp/flexkv-devdeps
mkdir -p "$prefix"
for f in .devdeps/*.deb; do dpkg -x "$f" "$prefix"; done
lib="$prefix/usr/lib/x86_64-linux-gnu"
export CMAKE_PREFIX_PATH="$prefix/usr" CPATH="$prefix/usr/include" LIBRARY_PATH="$lib" LD_LIBRARY_PATH="$lib"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -3
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA here'; print('torch', torch.__version__)"

set -o pipefail
python3 -m pytest -q tests/test_cuda.py tests/test_manager.py tests/test_faults.py 2>&1 | tee "$out/pytest.txt"
python3 -m dynamo_flexkv.bench links --device cuda --json "$out/links.jsonl" 2>&1 | tee "$out/links.txt"
