"""The node cache (core/node/, docs/NODE_CACHE.md): one service owns the tiers of a node and every
engine attached to it loads what any of them stored, bytes exact; an engine that dies mid-copy
leaves nothing visible and nothing held; a service that restarts re-adopts its disk and its
engines re-attach by themselves; bad input on the socket ends that connection only."""

from __future__ import annotations

import os
import random
import signal
import socket
import stat
import struct
import time

import numpy as np
import pytest
import torch
import yaml
from node_helpers import BS, SPEC, Engine, Held, engine_process, node_server, prompt, read_line, server_config
from served import wait_until

from dynamo_flexkv import CacheConfig, KVManager, open_offload
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType
from dynamo_flexkv.core.node.protocol import VERSION, Attach, Load, encode
from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions


def stats(server) -> dict:
    return server.stats()


def idle(server) -> bool:
    st = server.stats()
    return all(e["copies_in_flight"] == 0 and e["tasks"] == 0 for e in st["engines"]) and st["fenced_waiting"] == 0


def test_what_one_engine_stores_another_loads_bytes_exact_from_host_and_disk(tmp_path):
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05) as server:
        a, b = Engine(server.options.socket_path, "A"), Engine(server.options.socket_path, "B")
        shared = prompt(1, 40 * BS)
        a.store(shared, list(range(40)))
        assert b.offload.cached_tokens(shared) == 40 * BS
        # The same lookup, explained: the service's decision comes back with the answer.
        answer, decision = b.offload.explain_lookup(shared, prompt_tokens=40 * BS + 1, skip_blocks=2)
        assert answer == 40 * BS and decision is not None
        assert (decision["start"], decision["end"], decision["found"]) == (2 * BS, 40 * BS, {"host": 38 * BS})
        assert b.load(shared, list(range(50, 90))) == 40
        assert b.check(shared, list(range(50, 90)), 0, 40) == []
        # A prompt that extends it: B holds the first 40 blocks already (skip), loads the rest.
        longer = shared + prompt(2, 8 * BS)
        a.store(longer, list(range(48)), key="r2")
        assert b.load(longer, list(range(50, 98)), skip=40) == 8
        assert b.check(longer, list(range(50, 98)), 40, 8) == []
        # Through disk: host evicted (disk keeps the copies), B loads again.
        assert b.offload.drain(30)
        assert a.offload.evict_host(30) > 0
        assert b.offload.stats().host.ready_blocks == 0
        assert b.load(shared, list(range(0, 40))) == 40
        assert b.check(shared, list(range(0, 40)), 0, 40) == []
        tiers = b.offload.stats()
        assert tiers.disk.hit_blocks >= 40 and tiers.host.hit_blocks >= 48
        wait_until("every copy answered", lambda: idle(server))
        a.offload.shutdown()
        b.offload.shutdown()
        wait_until("both detached", lambda: not server.stats()["engines"])


def test_randomized_stores_and_loads_of_two_engines_always_restore_the_stored_bytes(tmp_path):
    """Random prompts sharing prefixes, stored and loaded by two engines in random order, through a
    host tier that holds a fraction of them and a disk tier: every block a load brings back is the
    block those tokens stored (their bytes are a function of the tokens), whatever was evicted."""
    rnd = random.Random(5)
    bases = [prompt(100 + i, rnd.randrange(4, 20) * BS) for i in range(6)]
    with node_server(tmp_path, host_gb=0.002, ssd_gb=0.03) as server:
        engines = [Engine(server.options.socket_path, name) for name in ("A", "B")]
        loaded = 0
        for step in range(60):
            e = rnd.choice(engines)
            tokens = rnd.choice(bases) + prompt(1000 + step, rnd.randrange(0, 6) * BS)
            n = len(tokens) // BS
            blocks = rnd.sample(range(96), n)
            if rnd.random() < 0.5:
                e.store(tokens, blocks, key=f"s{step}")
            else:
                got = e.load(tokens, blocks)
                if got:
                    loaded += got
                    assert e.check(tokens, blocks, 0, got) == [], f"step {step}: wrong bytes loaded"
        assert loaded > 50
        st = engines[0].offload.stats()
        assert st.host.evicted_blocks > 0 and st.disk.hit_blocks > 0
        wait_until("every copy answered", lambda: idle(server))
        for e in engines:
            e.offload.shutdown()


def test_an_engine_killed_mid_store_leaves_nothing_visible_and_nothing_held(tmp_path):
    with node_server(tmp_path) as server:
        proc = engine_process(server.options.socket_path, "store-hang", "7", str(12 * BS))
        try:
            read_line(proc, "copying")  # half its blocks' bytes are in host slots, the copy not finished
            assert sum(e["copies_in_flight"] for e in server.stats()["engines"]) == 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
        wait_until(
            "the dead engine detached and its copy fenced and failed",
            lambda: not server.stats()["engines"] and server.stats()["fenced_waiting"] == 0,
        )
        other = Engine(server.options.socket_path, "B")
        tokens = prompt(7, 12 * BS)
        assert other.offload.cached_tokens(tokens) == 0  # the torn blocks never became visible
        ns = server.namespaces()[0]
        host = ns.kv.stats().host
        assert host.used_blocks == 0 and host.rolled_back_blocks == 12
        other.store(tokens, list(range(12)))  # the slots are reusable, and the block is stored whole
        assert other.load(tokens, list(range(20, 32))) == 12 and other.check(tokens, list(range(20, 32)), 0, 12) == []
        other.offload.shutdown()


def test_an_engine_killed_mid_load_releases_its_locks(tmp_path):
    with node_server(tmp_path) as server:
        a = Engine(server.options.socket_path, "A")
        tokens = prompt(8, 10 * BS)
        a.store(tokens, list(range(10)))
        proc = engine_process(server.options.socket_path, "load-hang", "8", str(10 * BS))
        try:
            read_line(proc, "copying")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
        wait_until("the dead engine detached", lambda: len(server.stats()["engines"]) == 1)
        wait_until("its load failed and unlocked", lambda: idle(server))
        assert server.namespaces()[0].kv.stats().requests.tasks_in_flight == 0
        assert a.offload.evict_host(10) == 10  # nothing is pinned by the dead engine's read
        a.offload.shutdown()


def test_a_dropped_connection_fences_host_writes_until_the_process_exits(tmp_path):
    """EngineDevice + Fence directly: a device-to-host copy of an engine whose connection is gone
    but whose process lives fails only once that process exited, so its slots cannot be reused
    under a write still landing."""
    import subprocess

    import numpy as np

    from dynamo_flexkv.core.node.engines import EngineDevice, EngineGone, Fence
    from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp

    sent, forgot, results = [], [], []
    sleeper = subprocess.Popen(["sleep", "60"])
    fence = Fence()
    try:
        dev = EngineDevice("e", 8, sent.append, sleeper.pid, forgot.append)
        d2h = TransferOp(OpKind.D2H, np.arange(2), np.arange(2))
        h2d = TransferOp(OpKind.H2D, np.arange(2), np.arange(2), layers=(0, 1))
        dev.start(d2h, lambda e, n: results.append(("d2h", type(e))))
        dev.start(h2d, lambda e, n: results.append(("h2d", type(e))))
        assert len(sent) == 2 and len(forgot) == 1  # the write's slots forget their checksums first
        dev.detach("connection dropped", fence)
        assert results == [("h2d", EngineGone)]  # a read fails at once
        assert fence.waiting == 1
        sleeper.kill()
        sleeper.wait()
        wait_until("the write failed after the exit", lambda: len(results) == 2)
        assert results[1] == ("d2h", EngineGone) and fence.waiting == 0
        dev.start(TransferOp(OpKind.H2D, np.arange(1), np.arange(1)), lambda e, n: results.append(("late", type(e))))
        assert results[2] == ("late", EngineGone)  # a copy of a departed engine fails at once
    finally:
        sleeper.kill()
        fence.close()


def test_a_restarted_service_readopts_its_disk_and_engines_reattach_by_themselves(tmp_path):
    tokens = prompt(9, 16 * BS)
    server = node_server(tmp_path, host_gb=0.02, ssd_gb=0.05)
    s1 = server.__enter__()
    try:
        e = Engine(s1.options.socket_path, "A")
        e.store(tokens, list(range(16)))
        assert e.offload.drain(30)
    finally:
        server.__exit__(None, None, None)
    # The service is gone: every per-request call is a miss at once (the engine computes), nothing
    # raises, nothing hangs, nothing is held.
    wait_until("the engine noticed", lambda: e.offload.cached_tokens(tokens) == 0)
    faults = e.offload.tier_faults
    assert e.offload.cached_tokens(tokens, skip_blocks=3) == 3 * BS  # what the engine holds
    assert e.offload.load(tokens, list(range(16)), 0) is None
    assert e.offload.store(tokens, list(range(16)), key="x") is None
    assert e.offload.prefetch(tokens) is None
    assert e.offload.tier_faults == faults + 4 and e.offload.tasks_pending == 0
    assert e.offload.stats() is None and e.offload.drain(1)
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05) as s2:
        wait_until("the engine re-attached", lambda: e.offload.cached_tokens(tokens) == 16 * BS, timeout=30)
        # An engine that publishes hears of the re-adopted disk blocks when it subscribes: the router
        # learns that every engine on the node can load them.
        held = Held()
        listener = Engine(s2.options.socket_path, "L", listener=held)
        hashes = listener.offload.block_hashes(tokens)
        wait_until("the re-adopted blocks announced", lambda: held.prefix(("disk",), hashes) == 16)
        listener.offload.shutdown()
        assert e.load(tokens, list(range(40, 56))) == 16
        assert e.check(tokens, list(range(40, 56)), 0, 16) == []
        assert s2.namespaces()[0].kv.stats().disk.hit_blocks == 16
        e.offload.shutdown()


def test_engines_of_another_model_or_tenant_see_nothing_and_a_second_model_is_refused(tmp_path):
    with node_server(tmp_path, max_models=2) as server:
        path = server.options.socket_path
        a = Engine(path, "A")
        tokens = prompt(10, 8 * BS)
        a.store(tokens, list(range(8)))
        other_tenant = Engine(path, "T", tenant="acme")
        assert other_tenant.offload.cached_tokens(tokens) == 0
        assert other_tenant.load(tokens, list(range(8))) is None
        other_model = Engine(path, "M", model_id="another-finetune")
        assert other_model.offload.cached_tokens(tokens) == 0
        # max_models=2 holds m (tenant "") and m (tenant acme): a third namespace is refused, clearly.
        third = Engine(path, "X", model_id="third")
        assert third.offload.cached_tokens(tokens) == 0  # it serves without the cache
        assert server.stats()["refused"] >= 1
        for e in (a, other_tenant, other_model, third):
            e.offload.shutdown()


def test_an_engine_whose_weights_changed_sees_no_old_block_and_the_old_namespace_gives_way(tmp_path):
    """The attach key carries the weights: an engine that changed its weights leaves what it
    announced (the router forgets it at once) and attaches to its new weights' namespace; an
    engine still on the weights before keeps them; once nobody runs them, the next weights take
    their place even with max_models=1."""
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05, max_models=1) as server:
        path = server.options.socket_path
        held = Held()
        a, b = Engine(path, "A", listener=held), Engine(path, "B")
        tokens = prompt(12, 6 * BS)
        a.store(tokens, list(range(6)))
        hashes = a.offload.block_hashes(tokens)
        assert a.offload.drain(30)
        wait_until(
            "A announced the blocks", lambda: held.prefix(("host",), hashes) == held.prefix(("disk",), hashes) == 6
        )
        assert a.offload.weights_changed("step-2") == 12
        assert held.prefix(("host",), hashes) == 0 and held.prefix(("disk",), hashes) == 0
        assert a.offload.cached_tokens(tokens) == 0  # refused while B holds the old namespace: a miss
        assert b.offload.cached_tokens(tokens) == 6 * BS  # B still runs the weights before
        b.offload.weights_changed("step-2")
        wait_until("A attached to the new weights' namespace", lambda: a.offload.stats() is not None, timeout=30)
        assert a.offload.cached_tokens(tokens) == 0 and b.offload.cached_tokens(tokens) == 0
        a.store(tokens, list(range(6)))
        assert b.load(tokens, list(range(10, 16))) == 6 and b.check(tokens, list(range(10, 16)), 0, 6) == []
        assert len(server.namespaces()) == 1  # the old weights' namespace was retired
        for e in (a, b):
            e.offload.shutdown()


def test_garbage_truncated_oversized_and_out_of_order_frames_end_that_connection_only(tmp_path):
    with node_server(tmp_path) as server:
        path = server.options.socket_path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # owner only
        good = Engine(path, "good")
        tokens = prompt(11, 4 * BS)
        good.store(tokens, list(range(4)))
        attach = Attach(
            version=VERSION,
            engine="x",
            model_id="m",
            num_layers=SPEC.num_layers,
            num_kv_heads=SPEC.num_kv_heads,
            head_size=SPEC.head_size,
            dtype=SPEC.dtype,
            kv_dim=2,
            tokens_per_block=BS,
            device_blocks=8,
        )
        bad_frames = [
            b"\x05\x00\x00\x00hello",  # not msgpack of the protocol
            struct.pack("<I", 1 << 30),  # a frame longer than the limit
            struct.pack("<I", 100) + b"\x81",  # cut off
            encode(Load(id=1, tokens=b"\x00" * 8, blocks=b"\x00" * 8)),  # before Attach
            encode(attach) + encode(Load(id=2, tokens=b"\x00" * 7, blocks=b"")),  # tokens not whole uint32
            encode(attach) + encode(Load(id=3, tokens=b"\x00" * 64, blocks=struct.pack("<q", 10**9))),  # ids
            encode(Attach(**{**{f: getattr(attach, f) for f in attach.__struct_fields__}, "version": 99})),
            encode(Attach(**{**{f: getattr(attach, f) for f in attach.__struct_fields__}, "dtype": "int3"})),
        ]
        for frame in bad_frames:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(10)
                while s.recv(65536):  # the service answers (an error) and closes, never hangs
                    pass
        wait_until("every bad connection closed", lambda: len(server.stats()["engines"]) == 1)
        assert server.stats()["protocol_errors"] >= 5
        assert good.offload.cached_tokens(tokens) == 4 * BS  # the others are served on
        good.offload.shutdown()


def test_a_thousand_attaches_are_bounded_and_leave_nothing(tmp_path):
    with node_server(tmp_path, max_clients=8) as server:
        path = server.options.socket_path
        socks = []
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)
        wait_until("the server refused all but max_clients", lambda: server.stats()["refused"] >= 992, timeout=60)
        assert len(server.stats()["engines"]) <= 8
        for s in socks:
            s.close()
        wait_until("every connection gone", lambda: not server.stats()["engines"])
        e = Engine(path, "after")
        assert e.offload.cached_tokens(prompt(12, 2 * BS)) == 0 and e.offload.stats() is not None
        e.offload.shutdown()


def test_a_server_closed_while_it_accepts_a_connection_joins_that_session(tmp_path, monkeypatch):
    """close() racing the accept loop: a session close() finds is started (CI once saw close()
    join a session registered but not started yet), and no session thread outlives close()."""
    import threading

    from dynamo_flexkv.core.node import session

    accepting, start = threading.Event(), session.Session.start

    def slow_start(self) -> None:  # the accept thread descheduled between registering and starting
        accepting.set()
        time.sleep(0.3)
        start(self)

    monkeypatch.setattr(session.Session, "start", slow_start)
    server = NodeCacheServer(server_config(tmp_path), ServerOptions(str(tmp_path / "s" / "node.sock"))).start()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.options.socket_path)
    assert accepting.wait(30)
    server.close()
    assert conn.recv(1) == b""  # the session ran and was closed
    conn.close()
    wait_until(
        "no session thread left",
        lambda: not any(t.name.startswith("flexkv-node-engine") and t.is_alive() for t in threading.enumerate()),
        timeout=30,
    )


def test_a_connection_that_never_attaches_is_closed_and_frees_its_place(tmp_path, monkeypatch):
    from dynamo_flexkv.core.node import session

    monkeypatch.setattr(session, "ATTACH_TIMEOUT_S", 0.5)
    with node_server(tmp_path, max_clients=1) as server:
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(server.options.socket_path)  # says nothing
        wait_until("the silent connection closed", lambda: not server.stats()["engines"], timeout=30)
        assert idle.recv(1) == b""
        idle.close()
        e = Engine(server.options.socket_path, "after")  # its place is free again
        assert e.offload.stats() is not None
        e.offload.shutdown()


def test_every_engine_announces_the_node_blocks_it_can_load_and_an_engine_that_attaches_gets_them(tmp_path):

    class Seen:
        def __init__(self):
            self.blocks = {"host": set(), "disk": set()}

        def on_stored(self, tier, run):
            self.blocks[tier.value].update(int(h) for h in run.hashes)

        def on_removed(self, tier, hashes):
            self.blocks[tier.value].difference_update(int(h) for h in hashes)

    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05) as server:
        path = server.options.socket_path
        seen_a, seen_b = Seen(), Seen()
        a = Engine(path, "A", listener=seen_a)
        t1 = prompt(13, 6 * BS)
        a.store(t1, list(range(6)))
        b = Engine(path, "B", listener=seen_b)  # attaches after the store: gets the current set
        ns = server.namespaces()[0]
        want = set(ns.mirror.held("host"))
        assert len(want) == 6
        wait_until("both engines see the host blocks", lambda: seen_a.blocks["host"] == want == seen_b.blocks["host"])
        assert a.offload.drain(30)
        wait_until(
            "both see the disk copies",
            lambda: (
                seen_a.blocks["disk"] == set(ns.mirror.held("disk")) == seen_b.blocks["disk"]
                and len(seen_b.blocks["disk"]) == 6
            ),
        )
        a.offload.evict_host(10)  # eviction leaves every engine's view
        wait_until("host blocks removed everywhere", lambda: not seen_a.blocks["host"] and not seen_b.blocks["host"])
        a.offload.shutdown()
        assert seen_a.blocks == {"host": set(), "disk": set()}  # a detaching engine forgets what it announced
        b.offload.shutdown()


def test_another_tensor_parallel_split_of_a_model_is_budgeted_as_another_model_and_told_why(tmp_path, caplog):
    """Shards of one split divide the model's budget; a TP=4 engine beside TP=2 ones would add its
    own split's namespaces, so it counts against max_models, and the engine's log says why."""
    from served import wait_until

    with node_server(tmp_path) as server:
        path = server.options.socket_path
        tp2 = [Engine(path, "E", rank=r, ranks=2).offload for r in range(2)]
        wait_until("both shards attached", lambda: server.stats()["attached"] >= 2, timeout=30)
        with caplog.at_level("WARNING", logger="dynamo_flexkv.core.node"):
            tp4 = Engine(path, "F", rank=0, ranks=4).offload
            wait_until("the TP=4 engine refused", lambda: server.stats()["refused"] >= 1, timeout=30)
            wait_until("its log says why", lambda: "max_models=1" in caplog.text, timeout=30)
        assert "refused this engine" in caplog.text and "--max-models" in caplog.text
        for off in (*tp2, tp4):
            off.shutdown()


def test_token_ids_pack_the_same_from_a_list_an_array_or_a_tuple_and_bad_ids_are_named():
    """The wire's token ids: a list (vLLM's), an int64 or uint32 array and a tuple give the same
    bytes, which unpack to the ids; an id outside [0, 2**32) or not an integer is a ValueError."""
    from dynamo_flexkv.core.node.protocol import pack_tokens, unpack_tokens

    rng = np.random.default_rng(7)
    for n in (0, 1, 63, 8192):
        ids = rng.integers(0, 2**32, n, dtype=np.uint64).tolist()
        packed = pack_tokens(ids)
        assert packed == pack_tokens(tuple(ids)) == pack_tokens(np.asarray(ids, dtype=np.uint32))
        assert unpack_tokens(packed).tolist() == ids
    for bad in ([-1], [2**32], [1.5], ["7"], [[1]], np.array([1.0]), np.array([[1]]), np.array([-1])):
        with pytest.raises(ValueError, match=r"token ids must be a flat sequence of integers in \[0, 2\*\*32\)"):
            pack_tokens(bad)


def test_one_setting_attaches_every_entry_point_and_kvmanager_refuses_it_naming_open_offload(tmp_path):
    """``mode: node`` + ``node_socket``, in one config file the service reads too (its tiers and its
    socket) and, for the engine, from that file or the environment: open_offload attaches (the
    service counts it); KVManager, which owns its tiers, refuses the setting instead of building a
    private host tier, naming the factory that attaches."""
    sock = str(tmp_path / "run" / "node.sock")
    shared = tmp_path / "node-cache.yaml"
    shared.write_text(yaml.safe_dump({"mode": "node", "node_socket": sock, "cpu_cache_gb": 0.02}))
    server_cfg = CacheConfig.load(str(shared), env={})
    with NodeCacheServer(server_cfg, ServerOptions(server_cfg.node_socket)) as server:
        from_file = CacheConfig.load(str(shared), env={}).replace(tokens_per_block=BS)
        from_env = CacheConfig.load(env={"FLEXKV_MODE": "node", "FLEXKV_NODE_SOCKET": sock}).replace(
            tokens_per_block=BS
        )
        layout = KVLayout(KVLayoutType.LAYERBLOCK, SPEC, BS, 8)
        tokens = prompt(7, 4 * BS)
        for i, cfg in enumerate((from_file, from_env)):
            with pytest.raises(ConfigError, match=r"mode='node'.*does not attach.*open_offload\(model, config"):
                KVManager(SPEC, cfg)
            off = open_offload(SPEC, cfg, model_id="m", engine=f"e{i}")
            off.register([torch.zeros(layout.layer_shape()) for _ in range(SPEC.num_layers)])
            assert off.describe()["mode"] == "node" and off.describe()["socket"] == sock
            wait_until("the engine attached", lambda: server.stats()["attached"] == i + 1)
            if i == 0:
                off.store(tokens, [0, 1, 2, 3], key="k")
                wait_until("the store's hold", lambda: any(h.key == "k" for h in off.finished_holds()))
            else:  # the second engine finds what the first stored: one cache, through the service
                wait_until("the first engine's blocks", lambda: off.cached_tokens(tokens) == 4 * BS)
            off.shutdown()
    with pytest.raises(ConfigError, match=r"node_socket=.* but mode='embedded': set mode=node"):
        KVManager(SPEC, CacheConfig(tokens_per_block=BS, cpu_cache_gb=0.02, node_socket=sock))


def test_a_socket_path_naming_a_file_or_directory_is_refused_and_left_alone(tmp_path):
    """A node_socket that names something other than a socket (a config file given twice by mistake,
    a directory) is refused naming the fix; the file is never removed."""
    from node_helpers import server_config

    config = tmp_path / "my-config.yaml"
    config.write_text("cpu_cache_gb: 0.1\n")
    (tmp_path / "adir").mkdir()
    for path, what in ((config, "a file"), (tmp_path / "adir", "a directory")):
        with pytest.raises(ConfigError, match=f"node_socket {path}: {what} that is not a socket is there"):
            NodeCacheServer(server_config(tmp_path, 0.02, 0.0), ServerOptions(str(path)))
    assert config.read_text() == "cpu_cache_gb: 0.1\n" and (tmp_path / "adir").is_dir()


def test_a_node_loads_link_is_timed_to_the_engines_copy_not_to_its_answers_way_back(tmp_path):
    """Cost-aware loading fits the host link on the service's loads. An engine's copy lands in its
    own memory and its forward goes on at once; the answer's trip back to the service (a busy
    service thread, a loaded machine) is not what the load cost the engine, and a fit that counted
    it declined loads that would have paid off (issue 49: estimated 120 ms against 46 ms)."""
    from dynamo_flexkv.core.node.protocol import OpDone

    with node_server(tmp_path, host_gb=0.02) as server:
        a, b = Engine(server.options.socket_path, "A"), Engine(server.options.socket_path, "B")
        try:
            shared = prompt(3, 16 * BS)
            a.store(shared, list(range(16)))
            conn = b.offload.link.current
            send = conn.channel.send

            def slow_answers(msg, *args, **kwargs):
                if isinstance(msg, OpDone):
                    time.sleep(0.2)  # the answer travels late; the copy itself ended before
                return send(msg, *args, **kwargs)

            conn.channel.send = slow_answers
            assert b.load(shared, list(range(20, 36))) == 16
            (ns,) = server.namespaces()
            host = ns.kv.cost.links["host"]
            wait_until("the service observed the load", lambda: host.count >= 1)
            nbytes = 16 * ns.kv.host.layout.block_bytes
            assert host.predict(nbytes) < 0.1, host
        finally:  # engines left attached reconnect to the gone socket, warning in later tests' logs
            a.offload.shutdown()
            b.offload.shutdown()
