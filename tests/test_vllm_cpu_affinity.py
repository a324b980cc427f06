"""FlexKVConnector keeps a CPU vLLM worker's model thread on the core vLLM's OpenMP binding gave it
(the first of VLLM_CPU_OMP_THREADS_BIND), after NixlConnector pinned it to the machine's last core
or anything widened it, while the helper threads it starts share the whole bind list."""

import os
import threading

import pytest

from dynamo_flexkv.integrations.vllm_connector.cpu_affinity import (BIND_ENV, bind_cpus, bind_list,
                                                                    helpers_on_bind_cores, restore_bind)

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move a thread between")


@pytest.mark.parametrize("value,rank,cpus", [
    ("0", 0, {0}), ("0-3,5", 0, {0, 1, 2, 3, 5}), ("0-1|2-3", 1, {2, 3}), ("0-1|2-3", 2, None),
    ("auto", 0, None), ("nobind", 0, None), ("all", 0, None), ("", 0, None), (None, 0, None), ("x-1", 0, None),
])
def test_bind_values_as_vllm_reads_them(value, rank, cpus):
    assert bind_cpus(value, rank) == cpus


@pytest.mark.parametrize("value,rank,cpus", [("3,1", 0, [3, 1]), ("5,0-2", 0, [5, 0, 1, 2]),
                                             ("0-1|3,2", 1, [3, 2]), ("1,1,0", 0, [1, 0])])
def test_the_bind_list_keeps_its_order(value, rank, cpus):
    """OpenMP thread i goes to the i-th core written: the model thread's core is the first one."""
    assert bind_list(value, rank) == cpus


def in_a_thread(fn):
    """Runs ``fn`` in a thread of its own (the test process keeps its cores) and returns its result."""
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()))
    t.start()
    t.join()
    return out["result"]


@needs_two
@pytest.mark.parametrize("moved_to", [[CORES[-1]], CORES[:2]], ids=["pinned-elsewhere", "widened"])
def test_the_model_thread_goes_back_to_its_core(monkeypatch, moved_to):
    """Pinned to the last core (what NixlConnector does on a CPU platform), or widened to every core
    of the list (the thread then shares a core with an OpenMP thread while another idles)."""
    monkeypatch.setenv(BIND_ENV, f"{CORES[0]}-{CORES[1]}")

    def model_thread():
        os.sched_setaffinity(0, set(moved_to))
        moved = restore_bind()
        return moved, os.sched_getaffinity(0), restore_bind()

    assert in_a_thread(model_thread) == (True, {CORES[0]}, False)  # again: already there
    monkeypatch.setenv(BIND_ENV, "auto")
    assert restore_bind() is False


@needs_two
def test_helpers_share_the_bind_list_and_the_model_thread_ends_on_its_core(monkeypatch):
    monkeypatch.setenv(BIND_ENV, f"{CORES[1]},{CORES[0]}")  # thread 0's core is the first written

    def model_thread():
        os.sched_setaffinity(0, {CORES[0]})
        helper = {}
        with helpers_on_bind_cores():
            t = threading.Thread(target=lambda: helper.update(cpus=os.sched_getaffinity(0)))
            t.start()
            t.join()
        return helper["cpus"], os.sched_getaffinity(0)

    assert in_a_thread(model_thread) == ({CORES[0], CORES[1]}, {CORES[1]})


def test_without_a_bind_list_nothing_moves(monkeypatch):
    monkeypatch.setenv(BIND_ENV, "nobind")

    def model_thread():
        before = os.sched_getaffinity(0)
        with helpers_on_bind_cores():
            pass
        return before, os.sched_getaffinity(0)

    before, after = in_a_thread(model_thread)
    assert before == after
