"""FlexKVConnector keeps a CPU vLLM worker's model thread on the core vLLM's OpenMP binding gave it
(the first of the list vLLM hands the OpenMP runtime), after NixlConnector pinned it to the
machine's last core or anything widened it, while the helper threads it starts share the list."""

import os
import threading

import pytest

from dynamo_flexkv.integrations.vllm_connector.cpu_affinity import (
    OmpBinding,
    helpers_on_bind_cores,
    omp_binding,
    restore_bind,
)

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move a thread between")
OMP_VARS = ("KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES")


GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
IOMP = "/opt/intel/lib/libiomp5.so"


@pytest.mark.parametrize(
    "env,binding",
    [
        # what vllm/utils/ompmultiprocessing.py sets for the runtime in LD_PRELOAD, sorted and per worker
        ({"LD_PRELOAD": GOMP, "GOMP_CPU_AFFINITY": "0 1"}, OmpBinding([0, 1], True)),
        ({"LD_PRELOAD": GOMP, "GOMP_CPU_AFFINITY": "2 3 0"}, OmpBinding([2, 3, 0], True)),  # thread order
        ({"LD_PRELOAD": GOMP, "GOMP_CPU_AFFINITY": "0-3 5"}, OmpBinding([0, 1, 2, 3, 5], True)),
        ({"LD_PRELOAD": IOMP, "KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5]"}, OmpBinding([4, 5], True)),
        ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, OmpBinding([0, 1, 2], False)),
        # the runtime decides which variable counts, as in vLLM: another runtime's variable is ignored
        ({"LD_PRELOAD": GOMP, "KMP_AFFINITY": "proclist=[2,3]", "GOMP_CPU_AFFINITY": "0 1"}, OmpBinding([0, 1], True)),
        ({"LD_PRELOAD": IOMP, "GOMP_CPU_AFFINITY": "0 1"}, None),
        ({"GOMP_CPU_AFFINITY": "0 1"}, None),
        ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, None),
        ({}, None),
        ({"LD_PRELOAD": GOMP}, None),
        # what no vLLM writes: not a core list we can trust, so nothing moves
        *(
            ({"LD_PRELOAD": GOMP, "GOMP_CPU_AFFINITY": v}, None)
            for v in (
                " ",
                "a",
                "3-1",
                "0-",
                "-1",
                "+1",
                "1_0",
                "\u0661",
                "0-15:2",
                "99999999999999999999999",
                "0-10000000",
            )
        ),
        ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "true"}, None),
        ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),
        ({"LD_PRELOAD": IOMP, "KMP_AFFINITY": "compact"}, None),
        ({"LD_PRELOAD": IOMP, "KMP_AFFINITY": "proclist=[]"}, None),
    ],
)
def test_the_binding_is_read_from_what_vllm_gave_the_openmp_runtime(env, binding):
    assert omp_binding(env) == binding


def test_the_model_thread_belongs_on_thread_zeros_core():
    assert OmpBinding([2, 3, 0], True).model_cores == [2]
    assert OmpBinding([0, 1, 2], False).model_cores == [0, 1, 2]  # one place: every thread floats over it


def test_a_long_list_parses_fast():
    cores = list(range(4096))
    assert omp_binding({"LD_PRELOAD": GOMP, "GOMP_CPU_AFFINITY": " ".join(map(str, cores))}).cores == cores


@pytest.fixture
def gomp(monkeypatch):
    """Sets the worker's binding as vLLM does for GNU OpenMP (the other variables cleared)."""
    for var in OMP_VARS + ("OMP_PROC_BIND",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_PRELOAD", GOMP)
    return lambda cores: monkeypatch.setenv("GOMP_CPU_AFFINITY", " ".join(map(str, cores)))


def in_a_thread(fn):
    """Runs ``fn`` in a thread of its own (the test process keeps its cores) and returns its result."""
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()))
    t.start()
    t.join()
    return out["result"]


@needs_two
@pytest.mark.parametrize("moved_to", [[CORES[-1]], CORES[:2]], ids=["pinned-elsewhere", "widened"])
def test_the_model_thread_goes_back_to_its_core(gomp, moved_to):
    """Pinned to the last core (what NixlConnector does on a CPU platform), or widened to every core
    of the list (the thread then shares a core with an OpenMP thread while another idles)."""
    gomp(CORES[:2])

    def model_thread():
        os.sched_setaffinity(0, set(moved_to))
        moved = restore_bind()
        return moved, os.sched_getaffinity(0), restore_bind()

    assert in_a_thread(model_thread) == (True, {CORES[0]}, False)  # again: already there


@needs_two
def test_helpers_share_the_list_and_the_model_thread_ends_on_its_core_even_nested_or_raising(gomp):
    gomp([CORES[1], CORES[0]])  # thread 0's core is the first in the list

    def model_thread():
        os.sched_setaffinity(0, {CORES[0]})
        seen = []

        def helper():
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
            t.join()

        with pytest.raises(RuntimeError), helpers_on_bind_cores():
            helper()
            with helpers_on_bind_cores():
                helper()
            helper()  # still inside the outer one: the inner exit did not pin the caller yet
            raise RuntimeError("a failed registration")
        return seen, os.sched_getaffinity(0)

    both = {CORES[0], CORES[1]}
    assert in_a_thread(model_thread) == ([both, both, both], {CORES[1]})


def test_where_vllm_bound_nothing_nothing_moves(gomp):
    def model_thread():
        before = os.sched_getaffinity(0)
        with helpers_on_bind_cores():
            pass
        return before, os.sched_getaffinity(0), restore_bind()

    before, after, moved = in_a_thread(model_thread)
    assert before == after and moved is False


def test_a_core_outside_this_process_is_left_alone(gomp, caplog):
    outside = max(CORES) + 64
    gomp([outside])

    def model_thread():
        before = os.sched_getaffinity(0)
        return before, restore_bind(), os.sched_getaffinity(0)

    before, moved, after = in_a_thread(model_thread)
    assert moved is False and after == before
    assert "cannot move the worker thread" in caplog.text
