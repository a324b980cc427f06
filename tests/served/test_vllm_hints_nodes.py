"""Router hints across two ``dynamo-flexkv nodes`` (docs/HINTS.md), all -m slow, root needed:
configs/agg_router_vllm.yaml with ``VllmWorker.router-hints: true`` served over two network
namespaces (``serve --nodes``): VllmWorker-0 on node A, VllmWorker-1 and the frontend (with its
KV router, etcd and NATS) on node B, every byte between them on the veth link (NIXL's UCX over TCP).

* a prompt computed on A's worker, then booked on B's (nvext.backend_instance_id) arrives with a
  ``kv.fetch`` hint naming A's control endpoint on A's address; B pulls A's blocks over the link;
  its generation equals the graph without offload; B's cached tokens count the pulled blocks;
* faults, A's link slowed (tbf) so that B's READ is seen under way on A's link before the fault:
  A's link cut mid-pull: B recomputes with the no-offload tokens within its pull timeout, A's pin
  ends with its lease, and once the link is back a pull works again; B's worker stopped (SIGSTOP)
  after A pinned: A releases the pin at its lease end while B's connection stays open, and B,
  resumed, recomputes with the no-offload tokens; A's worker SIGKILLed mid-READ (last: serve
  restarts it): B recomputes with the no-offload tokens, its staged blocks are rolled back, it
  serves on, and once serve brought A back a pull from A works again."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces (dynamo-flexkv nodes) need root"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by scripts/install.sh"),
]
pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

import exactness  # noqa: E402
import vllm_graph as vg  # noqa: E402
from exactness import Generation  # noqa: E402
from hints_graph import BS, MAX_TOKENS, NAMES, HintGraph, compute_on, failed_since, m, sets  # noqa: E402
from served import routed_workers, scrape, sums_by, wait_until  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

from dynamo_flexkv.integrations.vllm_connector.hints import HintTier  # noqa: E402
from dynamo_flexkv.integrations.vllm_connector.settings import EXTRA_KEYS  # noqa: E402
from dynamo_flexkv.serve.nodes import Nodes  # noqa: E402

PULLED = vg.tokens(7100, 1500)  # computed on A, pulled by B over the link
CUT = vg.tokens(7101, 1500)  # A's link cut while B pulls
AGAIN = vg.tokens(7102, 1500)  # pulled once the link is back
STOPPED = vg.tokens(7103, 1500)  # B stopped (SIGSTOP) after A pinned
KILLED = vg.tokens(7104, 1500)  # A SIGKILLed while B reads its blocks
BESIDE = vg.tokens(7105, 1500)  # B's next request, while A is dead or restarting (nothing to pull)
REVIVED = vg.tokens(7106, 1500)  # pulled from A once serve restarted it
CHECKED = [PULLED, CUT, AGAIN, STOPPED, KILLED, BESIDE, REVIVED]
FULL = (len(PULLED) - 1) // BS * BS  # the prompt's full blocks: what is hinted and pulled (23 blocks, 5.75 MiB)
# serve's secondary_tiers leave both at their defaults, and the connector its lookup give-up.
LEASE_S, PULL_TIMEOUT_S = HintTier.lease_s, HintTier.pull_timeout_s
LOOKUP_GIVE_UP_S = float(EXTRA_KEYS["lookup_give_up_s"][1])
# The longest a hinted request waits for its pull: the pull's own deadline, or the scheduler's
# give-up on the lookup that carries it, whichever comes first; then it is computed.
HINT_WAIT_S = min(PULL_TIMEOUT_S, LOOKUP_GIVE_UP_S)
# A's egress while a fault is staged: the 5.75 MiB READ takes ~3 s at this rate, so it is seen under
# way on A's link (FLOWING bytes since the request: nothing else A sends is near that large) before
# the fault, which then lands mid-read.
RATE = "16mbit"
FLOWING = 512 * 1024


# ---- this test inside a node -------------------------------------------------------------------

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextmanager
def inside(netns: str) -> Iterator[None]:
    """This thread, and the threads and processes it starts meanwhile, in network namespace
    ``netns``: the test reaches the nodes' addresses as a process on that node does."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def in_netns(pid: int, netns: str) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino


# ---- the graph ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-hints-nodes")


@pytest.fixture(scope="module")
def baseline(tmp) -> dict[tuple, Generation]:
    """The no-offload graph's generations, served on this machine's loopback."""
    serve = VllmServe(tmp, "baseline", "VllmWorker.offload=false", graph="agg_router_vllm", base=sets())
    try:
        return {tuple(p): vg.complete(serve.base_url, p, MAX_TOKENS)["gen"] for p in CHECKED}
    finally:
        serve.close()


@pytest.fixture(scope="module")
def nodes(tmp) -> Iterator[Nodes]:
    made = Nodes.up(f"hn{os.getpid() % 100000}", ("A", "B"), path=tmp / "nodes.yaml")
    try:
        yield made
    finally:
        made.down()


@pytest.fixture(scope="module")
def graph(tmp, baseline, nodes) -> Iterator[HintGraph]:
    with inside(nodes["B"].netns):
        serve = VllmServe(
            tmp,
            "hints",
            "VllmWorker.router-hints=true",
            "Frontend.node=B",
            "VllmWorker.node=[A,B]",
            *exactness.offload_sets(),
            graph="agg_router_vllm",
            # Every hinted pull is made: what the cost model decides (with a link it measured on a
            # busy machine) is not what these tests ask; a pull it leaves out proves nothing here.
            base=sets()
            + [f"VllmWorker.cache.ssd_cache_dir={tmp}/ssd{{replica}}", "VllmWorker.cache.load_policy=always"],
            prefix=nodes["B"].argv([]),
            args=["--nodes", str(tmp / "nodes.yaml"), "--discovery-backend", "etcd", "--event-plane", "nats"],
        )
        try:
            yield HintGraph(serve)
        finally:
            serve.close()
    assert serve.proc.returncode == 0, "\n".join(serve.lines[-40:])
    assert vg.ours_left(serve.run) == []


def assert_hint_recomputed(got: dict, want: Generation, what: str, before: str, after: str, reason: str) -> None:
    """B's hinted request was answered by recomputing (exact tokens, nothing cached) after its one
    hint failed for ``reason``; ``before`` / ``after``: B's metrics text around it."""
    exactness.assert_exact({what: got["gen"]}, {what: want}, what)
    assert m(after, "hints_seen_total") - m(before, "hints_seen_total") == 1
    assert m(after, "hints_used_total") == m(before, "hints_used_total")
    failed = failed_since(before, after)
    assert failed == {reason: 1} and got["cached"] == 0, failed


def slow_link(nodes: Nodes, name: str, on: bool) -> None:
    """Node ``name``'s egress limited to RATE (a token bucket on its end of the link), or not."""
    node = nodes[name]
    if on:
        tbf = ["tc", "qdisc", "replace", "dev", node.device, "root", "tbf", "rate", RATE, "burst", "32kb"]
        subprocess.run(node.argv([*tbf, "latency", "10s"]), check=True, capture_output=True, timeout=30)
    else:
        subprocess.run(node.argv(["tc", "qdisc", "del", "dev", node.device, "root"]), capture_output=True, timeout=30)


class Asked:
    """One completion booked on a worker, on a thread: its answer and how long it took."""

    def __init__(self, graph: HintGraph, prompt: list[int], worker: int) -> None:
        self.got: dict = {}

        def ask() -> None:
            t0 = time.monotonic()
            try:
                self.got["r"] = vg.complete(graph.serve.base_url, prompt, MAX_TOKENS, worker=worker)
            finally:
                self.got["at"] = time.monotonic()  # when the answer came (or the request failed)
                self.got["s"] = self.got["at"] - t0

        self.thread = threading.Thread(target=ask, daemon=True)
        self.thread.start()

    def answer(self, timeout: float = 120) -> tuple[dict, float]:
        self.thread.join(timeout)
        assert "r" in self.got, f"no answer in {timeout} s"
        return self.got["r"], self.got["s"]


def stored_events(graph: HintGraph) -> float:
    """KV "stored" events the frontend's router applied (from both workers)."""
    text = scrape(graph.serve.metrics["Frontend"])
    return sums_by(text, "dynamo_component_kv_cache_events_applied", "event_type").get(("stored",), 0.0)


def computed_on_a(graph: HintGraph, prompt: list[int], ids: dict[str, int]) -> dict:
    """``prompt`` computed on A, stored in A's host tier, and its blocks known to the router (A's
    KV events cross the link to NATS on B: a hint names only what the router learned)."""
    before = stored_events(graph)
    r = compute_on(graph, NAMES[0], prompt, ids)
    wait_until("the router applied A's stored events", lambda: stored_events(graph) > before, timeout=60)
    return r


def nudged(graph: HintGraph, name: str, worker: int) -> str:
    """``name``'s metrics after one more engine step (HintGraph.stepped, booked on instance id
    ``worker``: stepped reads both workers' ids, which waits while the other one restarts)."""
    graph.nudges += 1
    vg.complete(graph.serve.base_url, vg.tokens(7900 + graph.nudges, 8), 1, worker=worker)
    return graph.text(name)


def unready_host(text: str) -> float:
    """Host blocks held but not ready: staged for a pull, or a copy in flight (a leaked staged run
    stays here for good)."""
    return m(text, "pool_blocks", tier="host", state="used") - m(text, "pool_blocks", tier="host", state="ready")


def pull_under_way(nodes: Nodes, asked: Asked, tx0: int) -> float:
    """Waits until B's READ of A's blocks is seen on A's link (FLOWING bytes sent since ``tx0``);
    returns when."""
    wait_until(
        "B's READ of A's blocks under way on A's link",
        lambda: nodes.link_bytes("A")["tx"] - tx0 >= FLOWING or "s" in asked.got,
        timeout=60,
        every=0.02,
    )
    assert "s" not in asked.got, "B answered before its pull was seen on A's link (no pull, or no hint)"
    return time.monotonic()


# ---- the tests ---------------------------------------------------------------------------------


def test_a_prefix_computed_on_node_a_is_pulled_over_the_link_by_node_bs_worker_on_a_hint(graph, nodes, baseline):
    a, b = NAMES
    for name, node in ((a, "A"), (b, "B")):
        assert in_netns(graph.serve.worker_pid(name), nodes[node].netns), f"{name} does not run on node {node}"
    assert graph.endpoint(a)[0] == nodes["A"].address  # what A advertises, the hint names and B dials
    ids = graph.ids()
    first = computed_on_a(graph, PULLED, ids)
    before_b, before_a = graph.text(b), graph.text(a)
    tx0 = nodes.link_bytes("A")["tx"]
    second = vg.complete(graph.serve.base_url, PULLED, MAX_TOKENS, worker=ids[b])
    sent = nodes.link_bytes("A")["tx"] - tx0
    after_b = graph.text(b)
    seen = m(after_b, "hints_seen_total") - m(before_b, "hints_seen_total")
    used = m(after_b, "hints_used_total") - m(before_b, "hints_used_total")
    pulled = m(after_b, "hint_pulled_tokens_total") - m(before_b, "hint_pulled_tokens_total")
    nbytes = m(after_b, "hint_pulled_bytes_total") - m(before_b, "hint_pulled_bytes_total")
    pull_s = m(after_b, "hint_pull_seconds_total") - m(before_b, "hint_pull_seconds_total")
    host = vg.loaded(after_b)["host"] - vg.loaded(before_b)["host"]
    print(
        f"\n{len(PULLED)} tokens computed on {a} (node A, {first['seconds']:.2f} s), booked on {b} (node B): "
        f"{second['seconds']:.2f} s, hints seen {seen:.0f} used {used:.0f}, pulled {pulled:.0f} tokens "
        f"({nbytes:.0f} bytes in {pull_s * 1000:.0f} ms), A sent {sent} bytes on its link, loaded {host:.0f} "
        f"from host, cached {second['cached']}; failures {failed_since(before_b, after_b)}"
    )
    assert second["worker"] == ids[b]
    exactness.assert_exact({"pulled": second["gen"]}, {"pulled": baseline[tuple(PULLED)]}, "hinted pull across nodes")
    assert seen == 1 and used == 1, f"hints: seen {seen}, used {used}; failed: {failed_since(before_b, after_b)}"
    assert pulled == FULL and host >= FULL and second["cached"] >= FULL
    assert nbytes > 0 and sent >= nbytes  # the blocks crossed A's link (UCX over TCP, no shared memory)
    assert graph.pinned(a) == 0  # released by B's Release before B's answer came
    after_a = graph.text(a)
    assert m(after_a, "peer_pins_total") - m(before_a, "peer_pins_total") == 1
    assert m(after_a, "peer_pins_expired_total") == m(before_a, "peer_pins_expired_total")


def test_the_link_cut_mid_pull_costs_a_recompute_and_the_pin_ends_with_its_lease(graph, nodes, baseline):
    a, b = NAMES
    ids = graph.ids()
    first = computed_on_a(graph, CUT, ids)
    before_b, before_a = graph.text(b), graph.text(a)
    slow_link(nodes, "A", True)
    try:
        tx0 = nodes.link_bytes("A")["tx"]
        asked = Asked(graph, CUT, ids[b])
        flowing_at = pull_under_way(nodes, asked, tx0)
        nodes.set_link("A", False)
        cut_at = time.monotonic()
        at_cut = nodes.link_bytes("A")["tx"] - tx0
        cut, took = asked.answer()
        answered_after_cut = time.monotonic() - cut_at
        # The cable stays out until A's pin ended with its lease (B's Release waits in B's TCP send
        # queue meanwhile): the pin was made before its bytes were seen, so its lease is over by then.
        # (A's metrics cannot say so before the link is back; the test checks them after.)
        lease_over = flowing_at + LEASE_S + 0.5
        wait_until("A's pin's lease to end", lambda: time.monotonic() > lease_over, timeout=LEASE_S + 5)
    finally:
        nodes.set_link("A", True)
        slow_link(nodes, "A", False)
    after_b = graph.text(b)
    failed = failed_since(before_b, after_b)
    print(
        f"\nA's link cut {cut_at - flowing_at:.2f} s after B's READ was seen ({at_cut} of ~{FULL // BS * 256 * 1024} "
        f"bytes sent): B answered {took:.2f} s after the request, {answered_after_cut:.2f} s after the cut "
        f"(computing it on A took {first['seconds']:.2f} s); hint failures {failed}, cached {cut['cached']}"
    )
    assert_hint_recomputed(cut, baseline[tuple(CUT)], "link cut mid-pull", before_b, after_b, "timeout")
    assert took <= PULL_TIMEOUT_S + first["seconds"] + 15, "B's step waited on the dead link past its pull timeout"
    wait_until(f"{a}'s pin gone once the link is back", lambda: graph.pinned(a) == 0, timeout=60, every=0.5)
    after_a = graph.text(a)
    assert m(after_a, "peer_pins_total") - m(before_a, "peer_pins_total") == 1
    assert m(after_a, "peer_pins_expired_total") - m(before_a, "peer_pins_expired_total") == 1

    # The link back: B pulls from A again (a fresh NIXL connection to A), exact tokens.
    computed_on_a(graph, AGAIN, ids)
    before_b = graph.text(b)
    again = vg.complete(graph.serve.base_url, AGAIN, MAX_TOKENS, worker=ids[b])
    after_b = graph.text(b)
    seen, used = (m(after_b, f"hints_{k}_total") - m(before_b, f"hints_{k}_total") for k in ("seen", "used"))
    print(f"after the link is back: hints seen {seen:.0f} used {used:.0f}, cached {again['cached']}")
    exactness.assert_exact({"again": again["gen"]}, {"again": baseline[tuple(AGAIN)]}, "pull after the link is back")
    assert seen == 1 and used == 1, f"hints: seen {seen}, used {used}; failed: {failed_since(before_b, after_b)}"
    assert again["cached"] >= FULL


def test_a_pin_whose_receiver_stopped_ends_with_its_lease_and_the_receiver_recomputes(graph, nodes, baseline):
    a, b = NAMES
    ids = graph.ids()
    computed_on_a(graph, STOPPED, ids)
    before_b, before_a = graph.text(b), graph.text(a)
    slow_link(nodes, "A", True)
    group: list[int] = []
    try:
        tx0 = nodes.link_bytes("A")["tx"]
        asked = Asked(graph, STOPPED, ids[b])
        pull_under_way(nodes, asked, tx0)  # A pinned and answered: the READ moves
        group = [p for p, _ in vg.group(graph.serve.worker_pid(b))]
        for p in group:
            os.kill(p, signal.SIGSTOP)
        stopped_at = time.monotonic()

        # B holds its connection to A open, stopped: only the lease ends A's pin. (A's metrics show
        # it after A's next step: a one-token request booked on A; graph.stepped would ask B too.)
        wait_until(
            f"{a}'s pin to end with its lease while {b} is stopped",
            lambda: m(nudged(graph, a, ids[a]), "peer_pins_expired_total") > m(before_a, "peer_pins_expired_total"),
            timeout=60,
            every=0.5,
        )
        expired_after = time.monotonic() - stopped_at
        pinned_meanwhile = m(graph.text(a), "peer_pinned_blocks")
    finally:
        for p in group:
            os.kill(p, signal.SIGCONT)
        slow_link(nodes, "A", False)
    stopped, took = asked.answer()
    after_b = graph.text(b)
    failed = failed_since(before_b, after_b)
    print(
        f"\n{b} stopped after A pinned: A's pin ended with its lease {expired_after:.2f} s after the stop "
        f"(A's pinned blocks then {pinned_meanwhile:.0f}); {b} answered {took:.2f} s after the request, "
        f"hint failures {failed}, cached {stopped['cached']}"
    )
    assert pinned_meanwhile == 0
    exactness.assert_exact({"stopped": stopped["gen"]}, {"stopped": baseline[tuple(STOPPED)]}, "receiver stopped")
    assert failed == {"timeout": 1} and stopped["cached"] == 0, failed
    after_a = graph.text(a)
    assert m(after_a, "peer_pins_total") - m(before_a, "peer_pins_total") == 1
    assert m(after_a, "peer_pins_expired_total") - m(before_a, "peer_pins_expired_total") == 1
    assert graph.pinned(a) == 0 and graph.pinned(b) == 0


def test_the_source_killed_mid_pull_costs_a_recompute_and_nothing_staged_and_serve_brings_it_back(
    graph, nodes, baseline
):
    """A's worker (its whole process group: dynamo.vllm, EngineCore, the Worker that serves its
    host tier to peers; vg.crash) SIGKILLed once B's READ of A's blocks is under way on A's
    (slowed) link: B's request is answered with the no-offload tokens, computed, within its hint
    wait (HINT_WAIT_S) plus the prompt's compute; B counts the hint failed, rolls its staged host
    blocks back, pins nothing and serves its next request exactly while A is away. serve's restart
    policy (on-death restart; this graph: backoff 2 s, 6 restarts) starts A again on node A with
    the same ports and SSD directory; once it is ready and routed, B pulls a prefix computed on
    the new A over the link again. Last in the module: A's restart is its own."""
    a, b = NAMES
    ids = graph.ids()
    first = computed_on_a(graph, KILLED, ids)
    pid = graph.serve.worker_pid(a)  # read before the pull: the kill must land inside the READ

    def settled(stored: float = 0) -> str | None:
        """B's metrics once a report of its tiers (with a step, at most once a second) shows no
        host block in flight and at least ``stored`` host blocks stored in all."""
        text = nudged(graph, b, ids[b])
        done = unready_host(text) == 0 and m(text, "stored_blocks_total", tier="host") >= stored
        return text if done else None

    before_b = wait_until(f"{b}'s host tier with nothing in flight", settled, timeout=60, every=0.5)
    mark = len(graph.serve.lines)
    slow_link(nodes, "A", True)
    try:
        tx0 = nodes.link_bytes("A")["tx"]
        asked = Asked(graph, KILLED, ids[b])
        flowing_at = pull_under_way(nodes, asked, tx0)
        vg.crash(pid)
        killed_at = time.monotonic()
        at_kill = nodes.link_bytes("A")["tx"] - tx0
        killed, took = asked.answer()
    finally:
        slow_link(nodes, "A", False)
    graph.serve.wait_for(rf"{a} exited with signal SIGKILL", 60, since=mark)
    # B goes on while A is away: a fresh prompt (nothing to hint), computed from nothing, exact.
    beside = vg.complete(graph.serve.base_url, BESIDE, MAX_TOKENS, worker=ids[b])
    # B's staged blocks rolled back: nothing in flight in a report that counts BESIDE's blocks
    # (stored after the killed request's answer, so the report is not one from before the pull).
    # Its counters are read there: the pull is over, whether or not its request stopped waiting first.
    fresh = m(before_b, "stored_blocks_total", tier="host") + FULL // BS
    left = after_b = wait_until(f"{b}'s staged blocks rolled back", lambda: settled(fresh), timeout=60, every=0.5)
    failed = failed_since(before_b, after_b)
    print(
        f"\n{a} SIGKILLed {killed_at - flowing_at:.2f} s after B's READ was seen ({at_kill} of "
        f"~{FULL // BS * 256 * 1024} bytes sent): {b} answered {took:.2f} s after the request, "
        f"{asked.got['at'] - killed_at:.2f} s after the kill (computing it on {a} took {first['seconds']:.2f} s, "
        f"{b}'s next cold prompt {beside['seconds']:.2f} s); hint failures {failed}, cached {killed['cached']}; "
        f"{b}'s unready host blocks after {unready_host(left):.0f}, pinned {m(left, 'peer_pinned_blocks'):.0f}"
    )
    # "failed", not "timeout": NIXL fails the READ once A's sockets close (the kernel closes them
    # at the kill; the close reaches B behind what A's qdisc held then), inside the pull's deadline.
    assert_hint_recomputed(killed, baseline[tuple(KILLED)], "source killed mid-pull", before_b, after_b, "failed")
    # The hinted request waits for its pull at most HINT_WAIT_S, then computes the prompt: its
    # compute is what A's and B's cold runs of same-length prompts took here (twice the slower:
    # the machine is shared, and A's restart starts meanwhile).
    compute_s = max(first["seconds"], beside["seconds"])
    assert took <= HINT_WAIT_S + 2 * compute_s, f"{b} waited {took:.2f} s on the dead source"
    assert beside["worker"] == ids[b] and beside["cached"] == 0
    exactness.assert_exact({"beside": beside["gen"]}, {"beside": baseline[tuple(BESIDE)]}, f"{b} while {a} is away")
    assert unready_host(left) == 0 and m(left, "peer_pinned_blocks") == 0

    # serve restarts A (same node, ports and SSD directory); the router learns its new instance.
    back = graph.serve.wait_for(rf"{a} is ready again after (\S+) s", 600, since=mark)
    wait_until("the router knows both workers", lambda: routed_workers(graph.serve.base_url) == 2, timeout=120)
    routed_after_kill = time.monotonic() - killed_at
    assert in_netns(graph.serve.worker_pid(a), nodes["A"].netns)
    ids = graph.ids()
    computed_on_a(graph, REVIVED, ids)
    before_b = graph.text(b)
    revived = vg.complete(graph.serve.base_url, REVIVED, MAX_TOKENS, worker=ids[b])
    after_b = graph.text(b)
    seen, used = (m(after_b, f"hints_{k}_total") - m(before_b, f"hints_{k}_total") for k in ("seen", "used"))
    print(
        f"{a} restarted (ready {back.group(1)} s after its start, routed {routed_after_kill:.1f} s after the "
        f"kill): a pull from it: hints seen {seen:.0f} used {used:.0f}, cached {revived['cached']}"
    )
    exactness.assert_exact({"revived": revived["gen"]}, {"revived": baseline[tuple(REVIVED)]}, "pull from restarted A")
    assert seen == 1 and used == 1, f"hints: seen {seen}, used {used}; failed: {failed_since(before_b, after_b)}"
    assert revived["cached"] >= FULL
    assert graph.pinned(a) == 0 and graph.pinned(b) == 0
