"""Router hints in a served graph (docs/HINTS.md), all -m slow: configs/agg_router_vllm.yaml with
``VllmWorker.router-hints: true`` (the real frontend and KV router with KV events, two ``dynamo.vllm``
workers with FlexKVConnector, seeded weights in float32):

* a prompt computed on worker A, then booked by the router on worker B (nvext.backend_instance_id):
  the router attaches a ``kv.fetch`` hint naming A, B pulls A's host blocks over NIXL, and its
  generation equals the same graph without offload; B's cached tokens count the pulled blocks and
  both workers' hint and pin counters say so;
* faults, each a recompute with the no-offload tokens and no pin left (A's pinned-blocks gauge back
  to 0): pulls on A's control endpoint without the graph's secret, with a forged proof and naming
  another tenant are refused by reason; the source stopped (SIGSTOP) while B pulls: B's pull times
  out and B computes; the source SIGKILLed while B's pull waits on it: B's pull fails, B computes,
  and the source comes back."""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by scripts/install.sh"),
]
pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

import exactness  # noqa: E402
import vllm_graph as vg  # noqa: E402
from exactness import Generation  # noqa: E402
from hints_graph import BS, MAX_TOKENS, NAMES, HintGraph, compute_on, m, sets  # noqa: E402
from hints_graph import failed as _failed  # noqa: E402
from hints_graph import refused as _refused  # noqa: E402
from served import wait_until  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

PULLED = vg.tokens(7000, 1500)  # computed on A, pulled by B
STOPPED = vg.tokens(7001, 1500)  # A stopped (SIGSTOP) while B pulls
KILLED = vg.tokens(7002, 1500)  # A SIGKILLed before B's request
CHECKED = [PULLED, STOPPED, KILLED]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-hints")


@pytest.fixture(scope="module")
def baseline(tmp) -> dict[tuple, Generation]:
    serve = VllmServe(tmp, "baseline", "VllmWorker.offload=false", graph="agg_router_vllm", base=sets())
    try:
        return {tuple(p): vg.complete(serve.base_url, p, MAX_TOKENS)["gen"] for p in CHECKED}
    finally:
        serve.close()


@pytest.fixture(scope="module")
def graph(tmp, baseline):
    g = HintGraph(
        VllmServe(
            tmp,
            "hints",
            "VllmWorker.router-hints=true",
            *exactness.offload_sets(),
            graph="agg_router_vllm",
            base=sets() + [f"VllmWorker.cache.ssd_cache_dir={tmp}/ssd{{replica}}"],
        )
    )
    try:
        yield g
    finally:
        g.serve.close()
    assert g.serve.proc.returncode == 0, "\n".join(g.serve.lines[-40:])
    assert vg.ours_left(g.serve.run) == []


def test_a_prefix_computed_on_one_worker_is_pulled_by_the_worker_the_router_books_on_a_hint(graph, baseline):
    a, b = NAMES
    ids = graph.ids()
    first = compute_on(graph, a, PULLED, ids)
    before_b, before_a = graph.text(b), graph.text(a)
    second = vg.complete(graph.serve.base_url, PULLED, MAX_TOKENS, worker=ids[b])
    after_b = graph.text(b)
    full = (len(PULLED) - 1) // BS * BS
    seen = m(after_b, "hints_seen_total") - m(before_b, "hints_seen_total")
    used = m(after_b, "hints_used_total") - m(before_b, "hints_used_total")
    pulled = m(after_b, "hint_pulled_tokens_total") - m(before_b, "hint_pulled_tokens_total")
    host = vg.loaded(after_b)["host"] - vg.loaded(before_b)["host"]
    print(
        f"\n{len(PULLED)} tokens computed on {a} ({first['seconds']:.2f} s), booked on {b}: "
        f"{second['seconds']:.2f} s, hints seen {seen:.0f} used {used:.0f}, pulled {pulled:.0f} tokens, "
        f"loaded {host:.0f} from host, cached {second['cached']}"
    )
    assert second["worker"] == ids[b]
    exactness.assert_exact({"pulled": second["gen"]}, {"pulled": baseline[tuple(PULLED)]}, "hinted pull")
    assert seen == 1 and used == 1, f"hints: seen {seen}, used {used}; failed: {_failed(after_b)}"
    assert pulled == full and host >= full and second["cached"] >= full
    assert graph.pinned(a) == 0  # released by B's Release before B's answer came
    after_a = graph.text(a)
    assert m(after_a, "peer_pins_total") - m(before_a, "peer_pins_total") == 1
    assert m(after_a, "peer_pins_expired_total") == m(before_a, "peer_pins_expired_total")  # released, not expired


def _ask(endpoint: tuple[str, int], pull) -> object:
    from dynamo_flexkv.core.peer import protocol

    with socket.create_connection(endpoint, timeout=30) as s:
        s.sendall(protocol.encode(pull))
        header = _read(s, protocol.HEADER_BYTES)
        return protocol.decode_to_receiver(_read(s, protocol.peer_frame_length(header)))


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "the source closed the connection without an answer"
        data += chunk
    return data


def test_pulls_without_the_secret_or_of_another_tenant_and_a_dead_or_hung_source_end_in_a_recompute(graph, baseline):
    from dynamo_flexkv.core.peer import protocol

    a, b = NAMES
    ids = graph.ids()
    endpoint = graph.endpoint(a)
    secret = vg.environ(graph.serve.worker_pid(a))["FLEXKV_HANDOVER_SECRET"].encode()

    # Peers that do not prove they belong to the graph, or ask for another tenant's blocks.
    def pull(tenant: str = "", key: bytes = b"") -> protocol.Pull:
        p = protocol.Pull(
            id=1,
            version=protocol.VERSION,
            model_id="any",
            tenant=tenant,
            layout="{}",
            hashes=protocol.pack_u64(list(range(1, 9))),
            start=0,
            sent_unix=time.time(),
            nonce=secrets.token_hex(8),
        )
        if key:
            p.mac = protocol.mac_of(p, key)
        return p

    before = _refused(graph.stepped(a))
    answers = {
        "unsigned": _ask(endpoint, pull()),
        "forged": _ask(endpoint, pull(key=b"not the graph's secret")),
        "namespace": _ask(endpoint, pull(tenant="someone-else", key=secret)),
    }
    for why, answer in answers.items():
        assert isinstance(answer, protocol.Refused) and answer.reason == why, (why, answer)
    after = _refused(graph.stepped(a))
    assert {k: after.get(k, 0) - before.get(k, 0) for k in answers} == {k: 1 for k in answers}
    assert graph.pinned(a) == 0

    # The source hung while B pulls: B's pull times out (pull_timeout_s), B computes, the pin ends.
    compute_on(graph, a, STOPPED, ids)
    before_b = graph.text(b)
    pid = graph.serve.worker_pid(a)
    group = [p for p, _ in vg.group(pid)]
    for p in group:
        os.kill(p, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        hung = vg.complete(graph.serve.base_url, STOPPED, MAX_TOKENS, worker=ids[b])
        took = time.monotonic() - t0
    finally:
        for p in group:
            os.kill(p, signal.SIGCONT)
    after_b = graph.text(b)
    failed = {k: v - _failed(before_b).get(k, 0) for k, v in _failed(after_b).items()}
    print(f"\nsource stopped: B answered in {took:.2f} s, hint failures {failed}, cached {hung['cached']}")
    exactness.assert_exact({"stopped": hung["gen"]}, {"stopped": baseline[tuple(STOPPED)]}, "source stopped")
    assert m(after_b, "hints_seen_total") - m(before_b, "hints_seen_total") == 1
    assert failed.get("timeout", 0) == 1 and hung["cached"] == 0, failed
    wait_until(f"{a}'s pin released after it resumed", lambda: graph.pinned(a) == 0, timeout=30)

    # The source SIGKILLed mid-pull: A stopped, B's request booked on B with a hint, and once B's
    # pull connected to A's control endpoint A is killed: B's pull fails at once, B computes, and
    # A comes back (restarted by serve).
    compute_on(graph, a, KILLED, ids)
    before_b = graph.text(b)
    mark = len(graph.serve.lines)
    pid = graph.serve.worker_pid(a)
    group = [p for p, _ in vg.group(pid)]
    for p in group:
        os.kill(p, signal.SIGSTOP)
    got: dict[str, dict] = {}
    try:
        asked = threading.Thread(
            target=lambda: got.update(r=vg.complete(graph.serve.base_url, KILLED, MAX_TOKENS, worker=ids[b]))
        )
        asked.start()
        wait_until(f"{b}'s pull connected to {a}", lambda: _connected(endpoint[1]), timeout=60)
        vg.crash(pid)
    finally:
        for p, _ in vg.group(pid):  # what crash spared (resource trackers) runs again and cleans up
            os.kill(p, signal.SIGCONT)
    asked.join(120)
    dead = got["r"]
    graph.serve.wait_for(rf"{a} exited with signal SIGKILL", 60, since=mark)
    after_b = graph.text(b)
    failed = {k: v - _failed(before_b).get(k, 0) for k, v in _failed(after_b).items()}
    seen = m(after_b, "hints_seen_total") - m(before_b, "hints_seen_total")
    print(f"\nsource killed mid-pull: hints seen {seen:.0f}, failures {failed}, cached {dead['cached']}")
    exactness.assert_exact({"killed": dead["gen"]}, {"killed": baseline[tuple(KILLED)]}, "source killed")
    assert seen == 1 and failed.get("source_gone", 0) == 1 and dead["cached"] == 0, failed
    assert m(after_b, "hints_used_total") == m(before_b, "hints_used_total")
    graph.serve.wait_for(rf"{a} is ready again after \S+ s", 600, since=mark)
    assert graph.pinned(b) == 0 and graph.pinned(a) == 0


def _connected(port: int) -> bool:
    """Whether a TCP connection to 127.0.0.1:``port`` is established (/proc/net/tcp, state 01)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "01" and int(local.split(":")[1], 16) == port:
            return True
    return False
