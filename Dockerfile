# The image `dynamo-flexkv render --k8s` names by default (--image dynamo-flexkv:latest):
# Dynamo's vLLM runtime (ai-dynamo 1.6.1 and the vLLM it pins, CUDA torch, NIXL) with this
# checkout's wheel installed into its Python.
#
#   make image                     # = docker build -t dynamo-flexkv:latest .  (IMAGE=... to name it)
#   docker tag dynamo-flexkv:latest REGISTRY/dynamo-flexkv:TAG && docker push REGISTRY/dynamo-flexkv:TAG
#   dynamo-flexkv render graphs/agg_router_vllm.py -f configs/agg_router_vllm.yaml --k8s \
#       --image REGISTRY/dynamo-flexkv:TAG -o flexkv.k8s.yaml
#
# Needs BuildKit (Docker 23+ uses it by default) and network access at build time (the base image,
# apt packages and the wheel's build requirements, scikit-build-core and pybind11, from PyPI).
# DYNAMO_VERSION follows the ai-dynamo / ai-dynamo-runtime version that scripts/install.sh pins.
# `make lint-image` checks this file with hadolint (tests/integration/test_dockerfile.py runs it too); the
# rules it is told to skip are skipped line by line below, each with its reason.

ARG DYNAMO_VERSION=1.6.1
ARG BASE_IMAGE=nvcr.io/nvidia/ai-dynamo/vllm-runtime:${DYNAMO_VERSION}

# ---- build: the wheel, compiled by the runtime's own Python (same cp3XX tag, same glibc) -------
FROM ${BASE_IMAGE} AS build
# This stage only compiles the wheel (as root: it installs the build packages); nothing of it but
# the wheel reaches the image.
# hadolint ignore=DL3002
USER 0
# The base image's distribution decides the versions (pinning them here would break on its next release).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential cmake liburing-dev libxxhash-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . /src
# What `pip wheel .` does in tests/integration/test_wheel.py: the native extension, the package, the serve
# graphs, their configs and the model presets in one wheel (pyproject.toml, scikit-build-core).
RUN if command -v uv >/dev/null 2>&1; then \
        uv build --wheel --python "$(command -v python3)" --out-dir /wheels /src; \
    else \
        python3 -m pip wheel --no-deps --wheel-dir /wheels /src; \
    fi \
    && ls /wheels/dynamo_flexkv-*.whl

# ---- runtime: the vLLM runtime image plus the wheel ----------------------------------------------
FROM ${BASE_IMAGE}
# The user the base image runs as (Dynamo's runtime images: dynamo, uid 1000, owner of its venv),
# by number: the rendered manifests run every pod as this uid (render.py RUN_AS) and the node cache
# and its workers must share it.
ARG RUN_UID=1000
USER 0
# liburing: the native extension's io_uring disk mover (it links the shared library). Versions: the
# base image's distribution's.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends liburing2 \
    && rm -rf /var/lib/apt/lists/*
USER ${RUN_UID}
# Only what the wheel needs and the image lacks is installed (xxhash, ...): torch, vLLM and Dynamo
# stay the image's own (the wheel does not depend on torch, see pyproject.toml).
RUN --mount=type=bind,from=build,source=/wheels,target=/tmp/wheels \
    if command -v uv >/dev/null 2>&1; then \
        uv pip install --python "$(command -v python3)" /tmp/wheels/dynamo_flexkv-*.whl; \
    else \
        python3 -m pip install --no-cache-dir /tmp/wheels/dynamo_flexkv-*.whl; \
    fi \
    && python3 -c "import dynamo_flexkv._native; from dynamo_flexkv.resources import GRAPHS, shipped_names; print(shipped_names(GRAPHS))" \
    && dynamo-flexkv --version
