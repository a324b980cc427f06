"""An idle NIXL agent must not keep a core busy: NIXL's Python binding creates agents whose UCX
progress thread polls without blocking (one full core per idle agent, measured), which starved the
vLLM engine thread beside them. core/transfer/nixl_agents.py gives every agent the process creates
a delay -- vLLM's NixlConnector's too, which is created through NIXL's own API."""

import subprocess
import sys

import pytest

pytest.importorskip("nixl._api")

# In a child: the delay is process-wide once installed. Prints the CPU share (of one core) the
# process used over 2 s while its agent sat idle.
_IDLE_AGENT = r"""
import os, sys, time
from dynamo_flexkv.core.transfer.nixl_agents import quiet_progress_threads
quiet_progress_threads()
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("idle-" + str(os.getpid()), nixl_agent_config(num_threads=4))  # as NixlConnector does
assert "UCX" in agent.backends, agent.backends
time.sleep(0.3)
cpu0, wall0 = time.process_time(), time.monotonic()
time.sleep(2.0)
print((time.process_time() - cpu0) / (time.monotonic() - wall0), flush=True)
os._exit(0)  # NIXL's bundled libnl crashes at exit (core/transfer/nixl_agent.exit_past_libnl)
"""


def _idle_share(env_delay: str) -> float:
    import os

    env = {**os.environ, "FLEXKV_NIXL_PROGRESS_DELAY_US": env_delay}
    out = subprocess.run([sys.executable, "-c", _IDLE_AGENT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_an_idle_agent_created_through_nixls_own_api_leaves_the_core_free():
    # With the delay ~0.02 of a core here; the bound is loose on purpose (a busy machine only
    # lowers what an idle process gets). The control, NIXL's own busy polling (delay 0), measures
    # ~1.0 on a quiet machine and still several times the delayed agent's on a busy one.
    quiet, polling = _idle_share("100"), _idle_share("0")
    assert quiet < 0.3
    assert polling > 2 * quiet + 0.05, (quiet, polling)


def test_the_ucx_leak_guard_vllm_sets_still_holds_once_we_imported_nixl_first():
    # vLLM's NixlConnector sets UCX_RCACHE_MAX_UNRELEASED only when NIXL is not imported yet; in a
    # FlexKVConnector worker we import it first, so the guard must come from us.
    code = (
        "import os\n"
        "from dynamo_flexkv.core.transfer.nixl_agents import quiet_progress_threads\n"
        "quiet_progress_threads()\n"
        "print(os.environ.get('UCX_RCACHE_MAX_UNRELEASED'))\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "UCX_RCACHE_MAX_UNRELEASED"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-1000:]
    assert out.stdout.strip().splitlines()[-1] == "1024"


def test_a_bad_delay_setting_is_refused_with_the_variable_named():
    code = "from dynamo_flexkv.core.transfer.nixl_agents import quiet_progress_threads\nquiet_progress_threads()\n"
    import os

    # 2**64 was accepted and then failed every agent creation; 2**32 wrapped to 0 inside NIXL.
    for bad in ("fast", "-5", "+7", "1_000", "1e3", str(2**32), str(2**64)):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "FLEXKV_NIXL_PROGRESS_DELAY_US": bad},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        assert "FLEXKV_NIXL_PROGRESS_DELAY_US" in out.stderr, out.stderr[-1000:]
