"""A node-cache call that timed out (the service stopped, SIGSTOP, longer than the call timeout)
returns a miss and the engine takes its blocks back. The service may still run that request when
it resumes, so the engine drops the connection on the timeout: a late store finds no engine to
copy from (it commits nothing), a late load none to write to; the engine attaches again by itself.
Found by the adversarial review of issue 47 (before the fix a late store committed another
prompt's bytes under the first prompt's hashes, and a late load overwrote recomputed blocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from node_helpers import Engine, prompt


@pytest.fixture
def stoppable_server(tmp_path):
    sock = str(tmp_path / "node.sock")
    srv = subprocess.Popen(
        [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", sock,
         "--set", "tokens_per_block=16", "--set", "cpu_cache_gb=0.02"],
        stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60  # its log fills no pipe that nobody reads
    while "cache server ready" not in (tmp_path / "server.log").read_text():
        assert time.monotonic() < deadline and srv.poll() is None, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    yield sock, srv
    os.kill(srv.pid, signal.SIGCONT)
    srv.terminate()
    srv.wait(30)


def back(engine: Engine, timeout: float = 60) -> None:
    """The service answered again: the engine, which dropped the connection when a call timed out,
    is attached anew and the old connection's tasks are gone from the service."""

    def settled() -> bool:
        st = engine.offload.stats()  # None while detached
        return engine.offload.attaches >= 2 and st is not None and st.tasks.in_flight == 0

    deadline = time.monotonic() + timeout
    while not settled():
        assert time.monotonic() < deadline, f"not re-attached after {timeout} s (attaches {engine.offload.attaches})"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_timed_out_store_does_not_commit_the_blocks_the_engine_reused(stoppable_server):
    sock, srv = stoppable_server
    engine = Engine(sock, "e")
    a, b, blocks = prompt(1, 64), prompt(2, 64), [0, 1, 2, 3]
    try:
        engine.fill(a, blocks)
        os.kill(srv.pid, signal.SIGSTOP)
        assert engine.offload.store(a, blocks, key="a") is None  # a miss: the blocks are the engine's
        engine.fill(b, blocks)  # so it reuses them
        os.kill(srv.pid, signal.SIGCONT)
        back(engine)
        other = [10, 11, 12, 13]
        n = engine.load(a, other)
        assert not n or engine.check(a, other, 0, n) == [], "the node cache serves B's bytes for prompt A"
        assert engine.offload.tasks_pending == 0
    finally:
        engine.offload.shutdown()


@pytest.mark.slow
def test_a_timed_out_load_does_not_write_the_blocks_the_engine_recomputed(stoppable_server):
    sock, srv = stoppable_server
    engine = Engine(sock, "e")
    a, b = prompt(1, 64), prompt(2, 64)
    try:
        engine.store(a, [0, 1, 2, 3])
        dst = [20, 21, 22, 23]
        os.kill(srv.pid, signal.SIGSTOP)
        assert engine.offload.load(a, dst, 0) is None  # a miss: recompute
        engine.fill(b, dst)  # the engine computes another request's KV there
        os.kill(srv.pid, signal.SIGCONT)
        back(engine)
        assert engine.check(b, dst, 0, 4) == [], "a late load of the node cache overwrote the engine's blocks"
        assert engine.load(a, [30, 31, 32, 33]) == 4  # the service serves on, exactly
        assert engine.check(a, [30, 31, 32, 33], 0, 4) == []
    finally:
        engine.offload.shutdown()
