"""Adversarial: NodeCacheServer.close() racing its accept loop, raw clients and attaching engines."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from node_helpers import BS, Engine, node_server, prompt, server_config

from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions

# The server's own threads (its accept loop, one per engine session): an engine's client threads
# (flexkv-node-copy-*, -fence) belong to engines, which other tests of this process may hold.
SERVER_THREADS = ("flexkv-node-accept", "flexkv-node-engine-")


def node_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(SERVER_THREADS) and t.is_alive()]


def wait_no_threads(timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while node_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return node_threads()


def hammer_raw(path: str, stop: threading.Event, errors: list) -> None:
    while not stop.is_set():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(path)
            s.sendall(b"\x00" * 8)
        except OSError:
            pass
        finally:
            s.close()


def attach_engines(path: str, stop: threading.Event, engines: list, errors: list, n: int) -> None:
    for i in range(n):
        if stop.is_set():
            return
        try:
            engines.append(Engine(path, f"e{threading.get_ident()}-{i}"))
        except Exception as e:  # noqa: BLE001 - a clean failure to attach is allowed; record the kind
            errors.append(e)


@pytest.fixture
def thread_errors():
    raised: list = []
    old = threading.excepthook
    threading.excepthook = raised.append
    yield raised
    threading.excepthook = old


@pytest.mark.parametrize("round_", range(4))
def test_close_from_another_thread_while_raw_clients_and_engines_attach(tmp_path, round_, thread_errors):
    """Session threads must not die on a socket close() already closed (session.py settimeout:
    OSError EBADF seen in round 3)."""
    path = str(tmp_path / "node.sock")
    server = NodeCacheServer(server_config(tmp_path), ServerOptions(path)).start()
    stop = threading.Event()
    errors: list = []
    engines: list = []
    workers = [threading.Thread(target=hammer_raw, args=(path, stop, errors)) for _ in range(3)]
    workers += [threading.Thread(target=attach_engines, args=(path, stop, engines, errors, 3)) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(0.05 * round_)
    raised: list = []

    def closer():
        try:
            server.close()
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    closers = [threading.Thread(target=closer) for _ in range(2)]  # close twice, concurrently
    t0 = time.monotonic()
    for c in closers:
        c.start()
    for c in closers:
        c.join(30)
    took = time.monotonic() - t0
    stop.set()
    for w in workers:
        w.join(60)
    assert not raised, raised
    assert took < 20, f"close took {took:.1f}s"
    assert not os.path.exists(path)
    server.close()  # a third time, after the fact
    # attached engines fail cleanly: a load returns None (recompute) or ok=False, never hangs
    toks = prompt(1, 2 * BS)
    for e in engines:
        t0 = time.monotonic()
        try:
            e.offload.store(toks, [0, 1], key="x")
            tid = e.offload.load(toks, [2, 3], 0)
            if tid is not None:
                for layer in range(4):
                    e.offload.wait_layer(tid, layer, 10)
                e.offload.finish(tid)
        except Exception:  # noqa: BLE001 - a clean failure is allowed, a hang is not
            pass
        assert time.monotonic() - t0 < 15
    for e in engines:
        e.offload.shutdown()
    left = wait_no_threads()
    assert not left, left
    assert not thread_errors, [(a.thread.name, a.exc_value) for a in thread_errors]


def test_close_ends_the_accept_thread(tmp_path):
    """close() of an idle server: its accept thread, blocked in accept(), ends too (closing the
    listening socket alone does not wake accept() on Linux: the thread and socket stayed forever)."""
    server = NodeCacheServer(server_config(tmp_path), ServerOptions(str(tmp_path / "node.sock"))).start()
    server.close()
    assert wait_no_threads(5) == []


def test_two_concurrent_closes_of_a_server_with_engines(tmp_path):
    path = str(tmp_path / "node.sock")
    for _ in range(5):
        server = NodeCacheServer(server_config(tmp_path), ServerOptions(path)).start()
        engines = [Engine(path, f"e{i}") for i in range(2)]

        def closer():
            server.close()

        ts = [threading.Thread(target=closer) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for e in engines:
            e.offload.shutdown()
        assert wait_no_threads() == []


def test_close_inside_with_block_while_engines_attach(tmp_path):
    for k in range(3):
        d = tmp_path / str(k)
        d.mkdir()
        engines: list = []
        errors: list = []
        stop = threading.Event()
        with node_server(d) as server:
            ts = [
                threading.Thread(target=attach_engines, args=(server.options.socket_path, stop, engines, errors, 4))
                for _ in range(2)
            ]
            for t in ts:
                t.start()
            time.sleep(0.02 * k)
            server.close()
        stop.set()
        for t in ts:
            t.join(60)
            assert not t.is_alive()
        for e in engines:
            e.offload.shutdown()
        assert wait_no_threads() == []
