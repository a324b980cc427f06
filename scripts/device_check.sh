#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (the `device` tool):
#   CUDA device<->host round trips for every layout (tests/unit/test_cuda.py), the data-plane tests
#   with the engine's tensors on CUDA where they apply, `bench links` with CUDA tensors, and
#   `bench vllm` on real vLLM (its CUDA build) with FlexKVConnector and vLLM's own
#   OffloadingConnector (CPUOffloadingSpec) side by side on the same prompts.
#
# Prepare on the development machine once (the GPU image has no liburing/xxhash headers):
#   bash scripts/device_check.sh --prepare        # downloads the .deb files into .devdeps/
# Then run on the device with carry [".devdeps"]:
#   bash scripts/device_check.sh                  # results land in $OUT (or ./device-out)
#   bash scripts/device_check.sh tests links      # only these sections (tests, links, vllm, layouts)
# The vllm section needs a CUDA build of vLLM 0.31 importable by python3 there (it is skipped with a
# message otherwise); its remote cases need redis-server (--prepare fetches the Debian packages).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .devdeps
  (cd .devdeps && apt-get download libxxhash-dev liburing-dev liburing2 \
     redis-server redis-tools liblzf1 libjemalloc2 >/dev/null)
  ls .devdeps
  exit 0
fi

sections=${*:-tests links vllm layouts}
want() { case " $sections " in *" $1 "*) return 0 ;; esac; return 1; }
out=${OUT:-device-out}
mkdir -p "$out"
prefix=/tmp/flexkv-devdeps
mkdir -p "$prefix"
for f in .devdeps/*.deb; do dpkg -x "$f" "$prefix"; done
lib="$prefix/usr/lib/x86_64-linux-gnu"
export CMAKE_PREFIX_PATH="$prefix/usr" CPATH="$prefix/usr/include" LIBRARY_PATH="$lib" LD_LIBRARY_PATH="$lib"
export PATH="$PATH:$prefix/usr/bin"  # redis-server / redis-cli when the image has none
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -3
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA here'; print('torch', torch.__version__)"

set -o pipefail
if want tests; then
  python3 -m pytest -q tests/unit/test_cuda.py tests/unit/test_manager.py tests/unit/test_faults.py 2>&1 | tee "$out/pytest.txt"
fi
if want links; then
  python3 -m dynamo_flexkv.bench links --device cuda --json "$out/links.jsonl" 2>&1 | tee "$out/links.txt"
fi
if want vllm; then
  # Real vLLM on CUDA: recompute, vLLM's prefix-cache hit, FlexKVConnector host/disk/remote hits and
  # its miss path, and vLLM's OffloadingConnector (CPU spec) hit and miss, in one run, same prompts.
  if python3 -c 'import sys; from vllm.platforms import current_platform as p; sys.exit(0 if p.is_cuda_alike() else 1)' \
      >/dev/null 2>&1; then
    python3 -c 'import vllm; print("vllm", vllm.__version__)' | tee "$out/vllm.txt"
    python3 -m dynamo_flexkv.bench vllm --compare-offloading-connector ${BENCH_VLLM_ARGS:-} \
      --json "$out/vllm.jsonl" 2>&1 | tee -a "$out/vllm.txt"
  else
    echo "bench vllm: skipped: no CUDA build of vLLM importable by python3 here" | tee "$out/vllm.txt"
  fi
fi
if want layouts; then
  # The model shapes and parallel layouts on CUDA (FlashAttention's KV layout, its MLA backend, TP
  # over NCCL when there are two GPUs): the loaded bytes per group and rank, host and disk.
  if python3 -c 'import sys; from vllm.platforms import current_platform as p; sys.exit(0 if p.is_cuda_alike() else 1)' \
      >/dev/null 2>&1; then
    python3 -m pytest -q -m slow tests/served/test_vllm_layouts.py -k loaded_bytes 2>&1 | tee "$out/layouts.txt"
    python3 -m dynamo_flexkv.bench vllm --model hybrid-sw --sizes 8k --json "$out/vllm-hybrid.jsonl" 2>&1 \
      | tee "$out/vllm-hybrid.txt"
    python3 -m dynamo_flexkv.bench vllm --model mla-small --sizes 8k --json "$out/vllm-mla.jsonl" 2>&1 \
      | tee "$out/vllm-mla.txt"
  else
    echo "layouts: skipped: no CUDA build of vLLM importable by python3 here" | tee "$out/layouts.txt"
  fi
fi
