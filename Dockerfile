# The image `dynamo-flexkv render --k8s` names by default (--image dynamo-flexkv:latest):
# Dynamo's vLLM runtime (ai-dynamo 1.6.1 and the vLLM it pins, CUDA torch, NIXL) with this
# checkout's wheel installed into its Python.
#
#   docker build -t dynamo-flexkv:latest .
#   docker tag dynamo-flexkv:latest REGISTRY/dynamo-flexkv:TAG && docker push REGISTRY/dynamo-flexkv:TAG
#   dynamo-flexkv render graphs/agg_router_vllm.py -f configs/agg_router_vllm.yaml --k8s \
#       --image REGISTRY/dynamo-flexkv:TAG -o flexkv.k8s.yaml
#
# Needs BuildKit (Docker 23+ uses it by default) and network access at build time (apt packages
# and the wheel's build requirements, scikit-build-core and pybind11, from PyPI).
# DYNAMO_VERSION follows the ai-dynamo / ai-dynamo-runtime version that scripts/install.sh pins.

ARG DYNAMO_VERSION=1.6.1
ARG BASE_IMAGE=nvcr.io/nvidia/ai-dynamo/vllm-runtime:${DYNAMO_VERSION}

# ---- build: the wheel, compiled by the runtime's own Python (same cp3XX tag, same glibc) -------
FROM ${BASE_IMAGE} AS build
USER root
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        build-essential cmake liburing-dev libxxhash-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . /src
# What `pip wheel .` does in tests/test_wheel.py: the native extension, the package, the serve
# graphs, their configs and the model presets in one wheel (pyproject.toml, scikit-build-core).
RUN if command -v uv >/dev/null 2>&1; then \
        uv build --wheel --python "$(command -v python3)" --out-dir /wheels /src; \
    else \
        python3 -m pip wheel --no-deps --wheel-dir /wheels /src; \
    fi \
    && ls /wheels/dynamo_flexkv-*.whl

# ---- runtime: the vLLM runtime image plus the wheel ----------------------------------------------
FROM ${BASE_IMAGE}
# The user the base image runs as (Dynamo's runtime images: dynamo, uid 1000, owner of its venv).
ARG RUN_USER=dynamo
USER root
# liburing: the native extension's io_uring disk mover (it links the shared library).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends liburing2 \
    && rm -rf /var/lib/apt/lists/*
USER ${RUN_USER}
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
