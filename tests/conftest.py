"""Suite-wide guards: nothing in the tests may reach outside this machine."""

import os

# transformers / huggingface_hub must never try the network (the model directory is local).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Dynamo processes bind and advertise loopback only.
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV

for var, value in LOOPBACK_ENV.items():
    os.environ.setdefault(var, value)
# ... and vLLM's engines too (its multi-process executor advertises VLLM_HOST_IP to its ranks).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
# Tests import the helpers by name (`from served import ...`), and the processes tests start (serve's
# workers, vLLM's) import the helpers' seams by name (wrong_kv.py): tests/helpers goes on both paths.
import sys  # noqa: E402

_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
if _HELPERS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HELPERS, os.environ.get("PYTHONPATH")) if p)


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """NIXL 1.5.1's UCX plugin bundles a libnl whose exit-time destructor crashes (SIGSEGV) in any
    process that created a UCX backend; the disaggregation tests create some in this process. Once
    the report is written, end with the run's own exit status instead of that crash (the same
    rule the workers follow: dynamo_flexkv.core.transfer.nixl_agent.exit_past_libnl)."""
    nixl_kv = sys.modules.get("dynamo_flexkv.core.transfer.nixl_agent")
    if nixl_kv is not None and nixl_kv.ucx_agents_created():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(config.stash.get(EXIT_STATUS, 1))


# ---- kinds: every test module has one, so a run can pick them (docs/TESTING.md) ----------------------
# A test module's kind is the folder it lives in:
#   unit/         in this process only (its own threads and sockets): no server, no subprocess
#   integration/  starts real processes or servers: redis-server, etcd, NATS, engine and cache-server
#                 processes, fresh interpreters, a built wheel; or NIXL agents talking over UCX
#   served/       serves a Dynamo graph: `dynamo-flexkv serve`, the Launcher, vLLM graphs
#   bench/        benchmark smokes
# (helpers/ holds everything that is not a test module: fixtures, the scripts tests start, seams.)
# A module's folder is what most of its tests need; a test that needs another kind carries that marker
# itself (@pytest.mark.integration, ...), and its own marker wins. A test module anywhere else fails
# collection, naming the folders it belongs in.
KINDS = ("unit", "integration", "served", "bench")
TESTS = Path(__file__).resolve().parent


def module_kind(path: Path) -> str | None:
    """The kind a test module's folder gives it: tests/<kind>/test_x.py; None anywhere else."""
    parent = path.resolve().parent
    return parent.name if parent.parent == TESTS and parent.name in KINDS else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    misplaced = set()
    for item in items:
        own = {m.name for m in item.iter_markers() if m.name in KINDS}
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(own)}: a test has one kind of {KINDS}")
        if item.get_closest_marker("ci_slow") and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked ci_slow but not slow: CI's subset of slow tests is slow")
        kind = module_kind(item.path)
        if kind is None:
            misplaced.add(
                str(item.path.relative_to(TESTS.parent)) if item.path.is_relative_to(TESTS.parent) else str(item.path)
            )
            continue
        if not own:
            item.add_marker(getattr(pytest.mark, kind))
    if misplaced:
        raise pytest.UsageError(
            f"test module(s) {sorted(misplaced)} are outside the kind folders: move each (git mv) into one of "
            f"{', '.join(f'tests/{k}/' for k in KINDS)} by what most of its tests need (tests/conftest.py says "
            "what each kind means); a module that holds no tests belongs in tests/helpers/ and is not named test_*.py"
        )
