#!/usr/bin/env bash
# Installs the peer `bench vllm --peer lmcache` compares with: LMCache 0.5.6 (its multi-process
# server and the LMCacheMPConnector vLLM loads from it) into its own prefix, .peers/lmcache, that
# only the peer's processes put on PYTHONPATH. Safe to run again (it checks before it acts).
#
# Why a separate prefix and not the project's .venv: a plain `pip install lmcache` resolves its
# 40-odd requirements (cupy-cuda13x, cuda-python, numpy<=2.2.6, setuptools<81, transformers>=5.4,
# google-cloud-bigtable, ...) against the venv and would replace packages vLLM and Dynamo are
# pinned to. Everything LMCache imports on this path is already in the venv but four small
# packages; those go into the prefix with --no-deps, pinned, so the venv is never touched and
# `make test` / `make demo` never see LMCache.
#   VENV=path    the project's virtual environment whose python runs the peer (default .venv)
#   LMCACHE_PEER_DIR=dir  the prefix (default .peers/lmcache; bench vllm --peer lmcache reads it too)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PEER_DIR=${LMCACHE_PEER_DIR:-.peers/lmcache}
PY="$VENV/bin/python"
# lmcache itself, then the four it imports that the venv lacks (caio: aiofile's backend, within
# lmcache's caio~=0.12.0; nvtx: imported unconditionally by its transfer code).
PINS=(lmcache==0.5.6 aiofile==3.12.3 aiofiles==25.1.0 caio==0.12.10 nvtx==0.2.17)
# What the peer runs: the server CLI, its MP server, and the connector vLLM resolves.
PROBE="import lmcache.cli.main, lmcache.v1.multiprocess.http_server, lmcache.integration.vllm.lmcache_mp_connector"

[ -x "$PY" ] || { echo "install_peer_lmcache.sh: no $PY: run make install first" >&2; exit 1; }
stamp="$PEER_DIR/.installed-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "install_peer_lmcache.sh: ${PINS[*]} into $PEER_DIR (--no-deps)"
  mkdir -p "$PEER_DIR"
  rm -f "$PEER_DIR"/.installed-*
  # --upgrade: pip --target replaces what an earlier pin left there (and nothing else in the directory).
  "$PY" -m pip --disable-pip-version-check -q install --upgrade --no-deps --target "$PEER_DIR" "${PINS[@]}" \
    2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
fi
if ! out=$(PYTHONPATH="$PEER_DIR" "$PY" -c "$PROBE" 2>&1); then
  echo "install_peer_lmcache.sh: LMCache does not import with $PY and $PEER_DIR:" >&2
  echo "$out" | tail -5 >&2
  exit 1
fi
echo "install_peer_lmcache.sh: LMCache 0.5.6 ready in $PEER_DIR (bench vllm --peer lmcache)"
