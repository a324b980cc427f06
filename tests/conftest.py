"""Suite-wide guards: nothing in the tests may reach outside this machine."""

import os

# transformers / huggingface_hub must never try the network (the model directory is local).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Dynamo processes bind and advertise loopback only.
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV  # noqa: E402

for var, value in LOOPBACK_ENV.items():
    os.environ.setdefault(var, value)
# ... and vLLM's engines too (its multi-process executor advertises VLLM_HOST_IP to its ranks).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
# The processes tests start (serve's workers, vLLM's) import tests' seams by name (wrong_kv.py).
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)


import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config._flexkv_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """NIXL 1.5.1's UCX plugin bundles a libnl whose exit-time destructor crashes (SIGSEGV) in any
    process that created a UCX backend; the disaggregation tests create some in this process. Once
    the report is written, end with the run's own exit status instead of that crash (the same
    rule the workers follow: dynamo_flexkv.integrations.disagg.nixl_kv.exit_past_libnl)."""
    nixl_kv = sys.modules.get("dynamo_flexkv.integrations.disagg.nixl_kv")
    if nixl_kv is not None and nixl_kv._ucx_agents:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(getattr(config, "_flexkv_exitstatus", 1))
