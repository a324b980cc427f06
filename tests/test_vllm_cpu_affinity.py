"""FlexKVConnector puts a vLLM worker's thread back on its VLLM_CPU_OMP_THREADS_BIND cores after
NixlConnector (its sibling in the disaggregated graphs) pinned it to the machine's last core."""

import os
import threading

import pytest

from dynamo_flexkv.integrations.vllm_connector.cpu_affinity import BIND_ENV, bind_cpus, restore_bind


@pytest.mark.parametrize("value,rank,cpus", [
    ("0", 0, {0}), ("0-3,5", 0, {0, 1, 2, 3, 5}), ("0-1|2-3", 1, {2, 3}), ("0-1|2-3", 2, None),
    ("auto", 0, None), ("nobind", 0, None), ("all", 0, None), ("", 0, None), (None, 0, None), ("x-1", 0, None),
])
def test_bind_values_as_vllm_reads_them(value, rank, cpus):
    assert bind_cpus(value, rank) == cpus


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_a_pinned_thread_goes_back_to_its_bind_and_an_unpinned_one_is_left_alone(monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(BIND_ENV, f"{cores[0]}-{cores[1]}")
    seen = {}

    def worker():  # a thread of its own: the test process keeps its cores
        os.sched_setaffinity(0, {cores[-1]})  # what NixlConnector does on a CPU platform
        seen["moved"] = restore_bind()
        seen["cpus"] = os.sched_getaffinity(0)
        seen["again"] = restore_bind()  # already there: nothing to do

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"moved": True, "cpus": {cores[0], cores[1]}, "again": False}
    monkeypatch.setenv(BIND_ENV, "auto")
    assert restore_bind() is False
