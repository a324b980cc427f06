"""A cancelled load ends in bounded time and never writes blocks it handed back.

A copy of a load can stall anywhere (a slow disk, a transfer queue busy with other tasks, a hook):
``mover_hook`` holds one on an Event here. Cancelling the load must hand the device blocks back
(or report the load finished) without waiting for that copy, and the copy, released later, must
write nothing into them: the test fills them with other bytes after the hand-back and checks
those bytes after the stalled copy returned. Nothing leaks: tasks, host locks, holds."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.core.offload import EmbeddedOffload
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp

LAYOUT = KVLayoutType.LAYERBLOCK
DEV = 16
PROMPT = list(range(4 * TPB))
STORED = [0, 1, 2, 3]  # device blocks the prompt is stored from
LOADED = [8, 9, 10, 11]  # device blocks the cancelled load copies into
WAIT_S = 30.0  # bound on every wait for a condition (never reached when the code is right)


class Stall:
    """A mover_hook: once armed, the first copy on ``link`` (of layer ``layer``, for device copies
    by layer) waits for ``release``. ``in_write``: it stalls inside the load's device fence, as a
    copy stuck in the middle of its write would."""

    def __init__(self, link: OpKind, layer: int | None = None, in_write: bool = False) -> None:
        self.link, self.layer, self.in_write = link, layer, in_write
        self.armed = False
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.ran: list = []  # (task, link) of every copy that reached the real mover

    def hook(self, link: OpKind, mover):
        return _Held(self, link, mover)

    def _hit(self, op: TransferOp) -> bool:
        if not self.armed or op.kind is not self.link or self.stalled.is_set():
            return False
        return self.layer is None or op.layers is None or op.layers[0] <= self.layer < op.layers[1]

    def hold(self) -> None:
        self.stalled.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the stalled copy")


class _Held:
    def __init__(self, stall: Stall, link: OpKind, mover) -> None:
        self.stall, self.link, self.mover = stall, link, mover

    def run(self, op: TransferOp) -> int:
        if self.stall._hit(op):
            if self.stall.in_write and op.fence is not None:
                with op.fence.writing():
                    self.stall.hold()
            else:
                self.stall.hold()
        self.stall.ran.append((op.task_id, op.kind))
        return self.mover.run(op)


@contextlib.contextmanager
def offload(stall: Stall, layerwise: bool, workers: int = 4) -> Iterator[EmbeddedOffload]:
    with tempfile.TemporaryDirectory() as tmp:
        kv = KVManager(MODEL, config(tmp, host_blocks=16, disk_blocks=48), mover_hook=stall.hook, workers=workers)
        try:
            kv.dev = device_tensors(LAYOUT, DEV)  # type: ignore[attr-defined]
            kv.register_device_cache(kv.dev)  # type: ignore[attr-defined]
            yield EmbeddedOffload(kv, layerwise=layerwise)
        finally:
            stall.release.set()  # a failed assertion must not leave a worker held
            kv.shutdown()


def stored(off: EmbeddedOffload, from_disk: bool) -> None:
    """PROMPT cached (on disk only, with ``from_disk``)."""
    kv = off.kv
    for b, s in zip(STORED, kv.hashes(PROMPT).sequence):
        fill(kv.dev, LAYOUT, b, int(s))  # type: ignore[attr-defined]
    t = kv.put_async(PROMPT, STORED)
    assert kv.wait([t])[t].ok
    assert kv.drain(WAIT_S)
    if from_disk:
        assert kv.evict("host") == len(STORED)


def fill_pattern(kv: KVManager, blocks: Sequence[int]) -> None:
    """The engine reuses the blocks: other bytes the late copy must not overwrite."""
    for b in blocks:
        fill(kv.dev, LAYOUT, b, 0xBADC0DE + b)  # type: ignore[attr-defined]


def pattern_intact(kv: KVManager, blocks: Sequence[int]) -> bool:
    return all(holds(kv.dev, LAYOUT, b, 0xBADC0DE + b) for b in blocks)  # type: ignore[attr-defined]


def assert_idle(off: EmbeddedOffload) -> None:
    kv = off.kv
    assert kv.drain(WAIT_S), "the stalled copy's graph never finished after its release"
    assert off.tasks_pending == 0
    assert off.finished_holds() == []
    tasks = kv.stats().tasks
    assert (tasks.in_flight, tasks.uncollected_results, tasks.transfers_running) == (0, 0, 0)
    assert_no_leaks(kv)  # host blocks unlocked, no task left in the index


def started(off: EmbeddedOffload, stall: Stall) -> int:
    stall.armed = True
    tid = off.load(PROMPT, LOADED, 0)
    assert tid is not None
    assert stall.stalled.wait(WAIT_S), "the load never reached the stalled link"
    return tid


CASES = st.sampled_from(
    [(OpKind.H2D, False), (OpKind.H2D, True), (OpKind.DISK2H, True)]  # (stalled link, load from disk)
)


def holds_back(off) -> list:
    """The holds finished_holds() hands back, polled until some come (never more than WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not (got := off.finished_holds()):
        assert time.monotonic() < deadline, "the cancelled load's blocks never came back"
        time.sleep(0.001)
    return got


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=CASES, layerwise=st.booleans(), layer=st.integers(0, MODEL.num_layers - 1), hand_back=st.booleans())
def test_cancel_of_a_stalled_load_is_bounded_and_the_late_copy_writes_nothing(case, layerwise, layer, hand_back):
    link, from_disk = case
    stall = Stall(link, layer)
    with offload(stall, layerwise) as off:
        kv = off.kv
        stored(off, from_disk)
        tid = started(off, stall)
        if hand_back:  # an aborted request: its blocks come back through finished_holds()
            off.cancel_load(tid, LOADED, key="req")
            got = holds_back(off)  # a write of another layer running at the cancel may end first
        else:  # vLLM's layer timeout: the step collects the load with finish()
            off.cancel_load(tid, ())
            result = off.finish(tid)
            assert result.status is TaskStatus.CANCELLED
        if hand_back:
            assert [(h.key, h.blocks) for h in got] == [("req", LOADED)]
        # Bounded whatever the stall: all of it happened while the stalled copy is still held.
        assert not stall.release.is_set()
        fill_pattern(kv, LOADED)
        stall.release.set()
        assert_idle(off)
        assert pattern_intact(kv, LOADED), "a copy landed in blocks after they were handed back"
        # The cache is whole: a new load brings the right bytes.
        stall.armed = False
        tid = off.load(PROMPT, LOADED, 0)
        assert tid is not None and off.finish(tid).ok
        assert all(holds(kv.dev, LAYOUT, b, int(s)) for b, s in zip(LOADED, kv.hashes(PROMPT).sequence))  # type: ignore[attr-defined]
        assert_idle(off)


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_write_in_progress_is_waited_for_then_the_blocks_come_back(layerwise):
    """A copy inside its write when the cancel comes: the blocks come back when that write returns
    (bytes it wrote land before the hand-back, none after)."""
    stall = Stall(OpKind.H2D, 0, in_write=True)
    with offload(stall, layerwise) as off:
        kv = off.kv
        stored(off, from_disk=False)
        tid = started(off, stall)
        off.cancel_load(tid, LOADED, key="req")
        assert off.finished_holds() == [] and not kv.done(tid)  # its write may still land: not back yet
        stall.release.set()
        assert [(h.key, h.blocks) for h in off.drain_holds()] == [("req", LOADED)]
        fill_pattern(kv, LOADED)
        assert_idle(off)
        assert pattern_intact(kv, LOADED)


def test_queued_copies_of_a_cancelled_load_never_run():
    """One transfer worker held by load A: load B's copies wait in the queue. Cancelling B ends it
    at once, and its copies are skipped when the worker frees up, never run."""
    stall = Stall(OpKind.H2D, 0)
    with offload(stall, layerwise=True, workers=1) as off:
        kv = off.kv
        stored(off, from_disk=False)
        a = started(off, stall)
        b = off.load(PROMPT, [12, 13, 14, 15], 0)
        assert b is not None
        off.cancel_load(b, ())
        assert off.finish(b).status is TaskStatus.CANCELLED
        stall.release.set()
        assert off.finish(a).ok
        assert_idle(off)
        assert [kind for task, kind in stall.ran if task == b] == []
        assert kv.stats().tasks.failed_ops == 0  # skipped, not failed


def test_node_cache_cancel_of_a_stalled_load_is_bounded(tmp_path):
    """The same through the node cache: the engine's own copier holds the stalled copy, and the
    load is collected without waiting for it or for the service's answer."""
    from node_helpers import BS, Engine, node_server

    stall = Stall(OpKind.H2D, 0)
    with node_server(tmp_path) as server:
        engine = Engine(str(tmp_path / "node.sock"), "e1", mover_hook=stall.hook)
        off = engine.offload
        try:
            tokens, loaded = list(range(4 * BS)), [8, 9, 10, 11]
            engine.fill(tokens, [0, 1, 2, 3])
            off.store(tokens, [0, 1, 2, 3], key="s")
            assert [h.key for h in off.drain_holds()] == ["s"] and off.drain(WAIT_S)
            stall.armed = True
            tid = off.load(tokens, loaded, 0)
            assert tid is not None and stall.stalled.wait(WAIT_S)
            off.cancel_load(tid, loaded, key="req")
            got = holds_back(off)
            assert [(h.key, h.blocks) for h in got] == [("req", loaded)]
            assert not stall.release.is_set()  # back while the stalled copy is still held
            for b in loaded:  # reused by the engine
                for layer in engine.layers:
                    layer[b] = -1.0
            stall.release.set()
            deadline = time.monotonic() + WAIT_S
            while off._collected and time.monotonic() < deadline:  # type: ignore[attr-defined]
                time.sleep(0.01)  # the service's TaskDone of the cancelled load is on its way
            assert not off._collected, "the service never finished the cancelled load"  # type: ignore[attr-defined]
            tasks = server.namespaces()[0].kv.stats().tasks
            assert (tasks.in_flight, tasks.transfers_running) == (0, 0)
            assert all(bool((layer[b] == -1.0).all()) for b in loaded for layer in engine.layers)
            assert off.tasks_pending == 0
            # A new load of the same prompt brings the right bytes.
            stall.armed = False
            tid = off.load(tokens, loaded, 0)
            assert tid is not None and off.finish(tid).ok
            assert engine.check(tokens, loaded, 0, 4) == []
        finally:
            stall.release.set()
            off.shutdown()
