"""vLLM workers on one node cache (docs/NODE_CACHE.md), all -m slow:

* two real vLLM engines attached to one cache server: every block the second loads from the node's
  host tier is, bit for bit, the block the first computed, and its generation equals the first's
  (tests/helpers/vllm_node_kv_check.py);
* the served graph (configs/agg_router_vllm_node.yaml: the real frontend and KV router, two
  ``dynamo.vllm`` workers, seeded weights in float32): a prompt computed on one worker is served by
  the other from the shared host tier, token ids and logprobs equal the same graph without offload;
  a worker SIGKILLed inside a device copy of a load, then inside one of a store (the copies slowed on
  demand by the slow_kv seam): the other worker serves on, exact, the node cache's copies, tasks and
  fences return to zero, nothing half-written becomes visible, and the restarted worker's first
  request of an 8K prefix the other computed is a host hit (its TTFT against its cold TTFT);
* the agg_vllm graph attached to a cache server started apart from it (``cache.node_socket``):
  serve starts none, the worker attaches, a prompt pushed out of the device loads through it;
* the node cache service SIGKILLed while requests flow: every request answered with the
  no-offload tokens and logprobs, the service restarted, both workers re-attached by themselves,
  and a prefix the restarted service re-adopted from disk loads on the worker that never computed it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
from repo_paths import HELPERS  # noqa: E402
from served import routed_workers, scrape, total, wait_until  # noqa: E402
from slow_kv import HOOK as SLOW_HOOK  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

BS = 64
NAMES = ("VllmWorker-0", "VllmWorker-1")
MAX_TOKENS = 6
DOCS = [vg.tokens(5000 + i, n) for i, n in enumerate((900, 1500, 2200, 3000))]
LONG = [vg.tokens(5100 + i, 8192) for i in range(3)]  # 8K prompts: LONG[0] computed elsewhere, LONG[2] cold
KILL_LOAD = vg.tokens(5200, 2500)
KILL_STORE = vg.tokens(5201, 2500)
ON_DISK = vg.tokens(5300, 2000)  # on the node's disk when its service is killed, loaded after its restart
CHECKED = DOCS + LONG[:1] + [KILL_LOAD, ON_DISK]


@pytest.mark.integration
def test_what_one_vllm_engine_computed_another_loads_from_the_node_cache_bit_for_bit(tmp_path):
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    model = write_model_dir(EngineModelConfig.preset("small"), tmp_path / "model", context_length=8192, weights=True)
    out, run = tmp_path / "result.json", tmp_path / "run"
    run.mkdir()
    env = dict(
        os.environ,
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        HOME=str(tmp_path),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm"),
    )
    env.pop("FLEXKV_CONFIG_PATH", None)
    script = HELPERS / "vllm_node_kv_check.py"
    p = subprocess.run(
        [sys.executable, str(script), str(model), str(out), str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(script.parent),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    *prompts, service = json.loads(out.read_text())
    for r in prompts:
        print(
            f"\n{r['prompt_tokens']} tokens: A stored {r['stored_blocks']} blocks, B loaded {r['loaded_blocks']} "
            f"(cached {r['b_cached']}), bytes equal: {r['bytes_equal']}"
        )
        full = (r["prompt_tokens"] - 1) // BS
        assert r["a_cached"] == 0 and r["loaded_blocks"] == full and r["b_cached"] == full * BS, r
        assert r["bytes_equal"] is True and r["nonzero"] is True
        exactness.assert_exact(
            {0: Generation.from_json(r["b"])},
            {0: Generation.from_json(r["a"])},
            f"{r['prompt_tokens']} tokens, loaded on B vs computed on A",
        )
    assert service["engines"] == 2 and service["copies_in_flight"] == 0
    assert service["host_hits"] >= sum((r["prompt_tokens"] - 1) // BS for r in prompts)


# ---- the served graph --------------------------------------------------------------------------------------


def sets(tmp: Path, name: str) -> list[str]:
    return [
        "Frontend.http-port=0",
        *exactness.serve_sets(),
        "VllmWorker.max-model-len=8448",
        "VllmWorker.num-device-blocks=140",
        "VllmWorker.restart-backoff-s=2",
        "VllmWorker.max-restarts=6",
    ]


def complete(base_url: str, prompt: list[int], worker: int = 0) -> dict:
    body = {
        "model": vg.MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]},
    }
    if worker:
        body["nvext"]["backend_instance_id"] = worker
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        doc = json.loads(r.read())
    took = time.monotonic() - t0
    ids = doc["nvext"]["completion_token_ids"]
    return {
        "gen": Generation.of_completion(doc, ids),
        "worker": int(doc["nvext"]["worker_id"]["decode_worker_id"]),
        "cached": int(doc["usage"]["prompt_tokens_details"]["cached_tokens"] or 0),
        "seconds": took,
    }


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-node")


@pytest.fixture(scope="module")
def baseline(tmp) -> dict[tuple, Generation]:
    serve = VllmServe(tmp, "baseline", "VllmWorker.offload=false", graph="agg_router_vllm", base=sets(tmp, "baseline"))
    try:
        return {tuple(p): complete(serve.base_url, p)["gen"] for p in CHECKED}
    finally:
        serve.close()


class NodeGraph:
    def __init__(self, tmp: Path) -> None:
        self.slow = tmp / "slow-kv"
        os.environ.update(SLOW_KV_FILE=str(self.slow), SLOW_KV_S="4")  # serve's workers inherit it
        self.serve = VllmServe(
            tmp,
            "node",
            f"VllmWorker.connector.mover_hook={SLOW_HOOK}",
            graph="agg_router_vllm",
            base=sets(tmp, "node") + [f"NodeCache.cache.ssd_cache_dir={tmp}/node-ssd"],
            config="agg_router_vllm_node",
        )

    def node(self, name: str, **labels: str) -> float:
        return total(scrape(self.serve.metrics["NodeCache"]), name, **labels)

    def ids(self) -> dict[str, int]:
        """Dynamo instance ids (a restarted worker has a new one, on its metrics before its first request)."""
        from dynamo_flexkv.replay.configs import worker_id

        def read(n: str):
            return _quiet(lambda: worker_id(vg.scrape(self.serve.metrics[n])))

        return {n: wait_until(f"{n}'s instance id", lambda n=n: read(n), timeout=60) for n in NAMES}

    def loaded(self, name: str) -> float:
        return vg.loaded(vg.scrape(self.serve.metrics[name]))["host"]

    def idle(self) -> bool:
        return (
            self.node("flexkv_node_copies_in_flight") == 0
            and self.node("flexkv_tasks_in_flight") == 0
            and self.node("flexkv_node_fenced_copies") == 0
        )

    def host_blocks(self) -> float:
        return total(scrape(self.serve.metrics["NodeCache"]), "flexkv_pool_blocks", state="used", tier="host")

    def crash(self, name: str) -> int:
        """SIGKILLs ``name``'s processes (vg.crash) and waits for serve to see it; returns the log
        mark ``back`` waits from."""
        mark = len(self.serve.lines)
        vg.crash(self.serve.worker_pid(name))
        self.serve.wait_for(rf"{name} exited with signal SIGKILL", 60, since=mark)
        return mark

    def back(self, name: str, mark: int) -> dict[str, int]:
        """Waits for ``name``'s restart after ``mark``: ready, attached to the node cache, and known
        to the frontend's router (a request naming its new instance id earlier gets a 400)."""
        self.serve.wait_for(rf"{name} is ready again after \S+ s", 600, since=mark)
        wait_until(f"{name} re-attached", lambda: self.node("flexkv_node_engines") == 2, timeout=120)
        wait_until(
            "the router knows both workers",
            lambda: _quiet(lambda: routed_workers(self.serve.base_url)) == 2,
            timeout=120,
        )
        return self.ids()

    def complete_and_store(self, prompt: list[int], worker: int) -> dict:
        """A completion whose prompt is then in the node's host tier: vLLM stores a finished request
        at its next step, so the answer comes before the store; wait for the blocks, not for time."""
        before = self.host_blocks()
        r = complete(self.serve.base_url, prompt, worker)
        wait_until(
            "the prompt stored in the node's host tier",
            lambda: self.idle() and self.host_blocks() >= before + len(prompt) // BS - r["cached"] // BS,
            timeout=60,
        )
        return r


def _quiet(fn):
    try:
        return fn()
    except (RuntimeError, OSError):  # a restarting worker's metrics port: not yet, or reset
        return None


@pytest.fixture(scope="module")
def graph(tmp, baseline):
    g = NodeGraph(tmp)
    try:
        yield g
    finally:
        g.serve.close()
        os.environ.pop("SLOW_KV_FILE", None)
    assert g.serve.proc.returncode == 0, "\n".join(g.serve.lines[-40:])
    assert vg.ours_left(g.serve.run) == []


def test_a_prompt_one_vllm_worker_computed_is_served_by_the_other_from_the_node_cache_exactly(graph, baseline):
    ids = graph.ids()
    a, b = NAMES
    for i, doc in enumerate(DOCS):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        first = graph.complete_and_store(doc, ids[src])
        before = graph.loaded(dst)
        second = complete(graph.serve.base_url, doc, ids[dst])
        full = (len(doc) - 1) // BS
        print(
            f"\n{len(doc)} tokens computed on {src} ({first['seconds']:.2f} s), served by {dst} "
            f"({second['seconds']:.2f} s, {second['cached']} cached)"
        )
        assert first["worker"] == ids[src] and second["worker"] == ids[dst]
        assert second["cached"] == full * BS and graph.loaded(dst) - before == full * BS
        exactness.assert_exact(
            {0: first["gen"], 1: second["gen"]},
            {0: baseline[tuple(doc)], 1: baseline[tuple(doc)]},
            f"{len(doc)} tokens on both workers",
        )
    assert graph.node("flexkv_hit_blocks_total") >= sum((len(d) - 1) // BS for d in DOCS)
    assert vg.event_trouble(graph.serve.run) == []


def kill_inside_a_copy(graph: NodeGraph, name: str, prompt: list[int], worker: int) -> dict:
    """Sends ``prompt`` to ``worker`` with its device copies slowed, SIGKILLs the worker's processes
    (vg.crash) while the node cache has one of its copies in flight (the vLLM Worker process
    making the copy dies in it; a SIGKILL of dynamo.vllm alone lets that process finish the copy
    while it stops, and the block lands whole), and returns how the request ended."""
    out: dict = {}

    def send() -> None:
        try:
            out["r"] = complete(graph.serve.base_url, prompt, worker)
        except (urllib.error.HTTPError, OSError) as e:
            out["error"] = f"{type(e).__name__}: {e}"

    import threading

    graph.slow.touch()
    try:
        t = threading.Thread(target=send, daemon=True)
        t.start()
        wait_until(
            "a copy of the victim in flight",
            lambda: graph.node("flexkv_node_copies_in_flight") >= 1,
            timeout=120,
            every=0.05,
        )
        out["mark"] = graph.crash(name)
    finally:
        graph.slow.unlink()
    t.join(300)
    wait_until(
        "the node cache forgot the dead engine",
        lambda: graph.node("flexkv_node_engines") == 1 and graph.idle(),
        timeout=60,
    )
    return out


def test_a_worker_killed_inside_a_load_and_a_store_leaves_the_node_cache_clean_and_comes_back_to_a_host_hit(
    graph, baseline
):
    a, b = NAMES
    ids = graph.ids()
    # Inside a load: KILL_LOAD computed on B, then sent to A, whose host->device copy is slowed.
    graph.complete_and_store(KILL_LOAD, ids[b])
    ended = kill_inside_a_copy(graph, a, KILL_LOAD, ids[a])
    print(f"\nkilled inside a load: {ended.get('error') or 'the request completed elsewhere'}")
    if "r" in ended:  # migrated to B: exact
        exactness.assert_exact({0: ended["r"]["gen"]}, {0: baseline[tuple(KILL_LOAD)]}, "the migrated request")
    other = complete(graph.serve.base_url, DOCS[0], ids[b])  # B serves on
    exactness.assert_exact({0: other["gen"]}, {0: baseline[tuple(DOCS[0])]}, "the other worker after the kill")
    ids = graph.back(a, ended["mark"])

    # Inside a store: a fresh prompt on A, whose device->host copy of it is slowed after it answered.
    hits = graph.node("flexkv_hit_blocks_total")
    ended = kill_inside_a_copy(graph, a, KILL_STORE, ids[a])
    print(f"killed inside a store: {ended.get('error') or 'answered before the kill'}")
    probe = complete(graph.serve.base_url, KILL_STORE, ids[b])
    assert probe["cached"] == 0, "a half-stored prompt became visible"  # recomputed by B, nothing loaded
    assert graph.node("flexkv_hit_blocks_total") == hits
    graph.back(a, ended["mark"])

    # The restarted worker's first request: an 8K prefix B computed is a host hit. Against what? The
    # first request after another restart, cold (a restarted vLLM's first forward pays its warm-up:
    # a later request would flatter the cold side).
    firsts = {}
    for kind, doc in (("host hit", LONG[0]), ("cold", LONG[2])):
        if kind == "host hit":
            graph.complete_and_store(doc, graph.ids()[b])
        ids = graph.back(a, graph.crash(a))
        firsts[kind] = complete(graph.serve.base_url, doc, ids[a])
    hit, cold = firsts["host hit"], firsts["cold"]
    assert hit["cached"] == (len(LONG[0]) - 1) // BS * BS and cold["cached"] == 0
    exactness.assert_exact({0: hit["gen"]}, {0: baseline[tuple(LONG[0])]}, "the restarted worker's 8K host hit")
    # Reported, not asserted (timings are the benchmarks' to judge): the note quotes them.
    print(
        f"restarted worker, first request of an 8K prompt: host hit {hit['seconds']:.2f} s against cold "
        f"{cold['seconds']:.2f} s ({hit['seconds'] / cold['seconds']:.2f}x)"
    )
    assert vg.event_trouble(graph.serve.run) == []


def test_a_killed_node_cache_costs_no_vllm_request_and_its_disk_prefix_loads_again(graph, baseline):
    import threading

    a, b = NAMES
    ids = graph.ids()
    graph.complete_and_store(ON_DISK, ids[a])
    blocks = (len(ON_DISK) - 1) // BS
    wait_until(
        "the prompt on the node's disk",
        lambda: graph.node("flexkv_pool_blocks", state="used", tier="disk") >= blocks,
        timeout=120,
    )
    answers: list = []  # (prompt, generation or the error)
    stop = threading.Event()

    def flow() -> None:
        deadline, i = time.monotonic() + 600, 0
        while not stop.is_set() and time.monotonic() < deadline:  # bounded: 10 minutes at most
            doc = DOCS[i % len(DOCS)]
            try:
                answers.append((doc, complete(graph.serve.base_url, doc, ids[NAMES[i % 2]])["gen"]))
            except (urllib.error.HTTPError, OSError) as e:
                answers.append((doc, f"{type(e).__name__}: {e}"))
            i += 1

    loader = threading.Thread(target=flow, daemon=True)
    loader.start()
    try:
        wait_until("requests flow", lambda: len(answers) >= 2, timeout=120)
        serve = graph.serve
        mark = len(serve.lines)
        cache = [p for p in serve.children if b"cache-server" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(cache[0], 9)
        during = len(answers)
        serve.wait_for(r"NodeCache is ready again after \S+ s", 120, since=mark)
        wait_until("both workers re-attached", lambda: graph.node("flexkv_node_engines") == 2, timeout=120)
        after = len(answers)
        wait_until("requests flow after the restart", lambda: len(answers) >= after + 2, timeout=300)
    finally:
        stop.set()
        loader.join(300)
    failed = [(len(doc), got) for doc, got in answers if isinstance(got, str)]
    assert failed == [], f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    print(f"\n{len(answers)} requests, {after - during} answered between the kill and the re-attach")
    for doc, got in answers:
        exactness.assert_exact({0: got}, {0: baseline[tuple(doc)]}, f"{len(doc)} tokens around the service's death")
    # The restarted service re-adopted ON_DISK: the worker that never computed it loads it from disk.
    r = complete(graph.serve.base_url, ON_DISK, ids[b])
    assert r["worker"] == ids[b] and r["cached"] == blocks * BS, r
    exactness.assert_exact({0: r["gen"]}, {0: baseline[tuple(ON_DISK)]}, "the re-adopted prefix on the other worker")
    assert vg.event_trouble(graph.serve.run) == []


@pytest.mark.ci_slow  # CI's vLLM-through-the-node-cache path: one graph, one worker, a host-tier load
def test_a_vllm_graph_attaches_to_a_cache_server_the_operator_started(tmp_path):
    """The shipped agg_vllm graph (one dynamo.vllm worker, the small preset, vLLM's CPU build), its
    cache set to node mode with the socket of a cache server started before it and apart from it:
    serve starts none, the worker attaches there (the service's counters), and a prompt sent again
    after fillers pushed it out of vLLM's device cache is loaded through the service's host tier."""
    from node_helpers import CacheServerProcess

    ops = CacheServerProcess(tmp_path, "cpu_cache_gb=0.25")
    try:
        serve = VllmServe(
            tmp_path,
            "ext",
            graph="agg_vllm",
            base=[
                "Frontend.http-port=0",
                *exactness.serve_sets(),  # float32: the loaded prefix gives the computed tokens exactly
                "VllmWorker.max-model-len=2048",
                "VllmWorker.num-device-blocks=40",  # the fillers below push the prompt out of it
                "VllmWorker.cache.mode=node",
                f"VllmWorker.cache.node_socket={ops.socket}",
            ],
        )
        try:
            assert f"note: VllmWorker: attaches to the cache server at {ops.socket}" in "\n".join(serve.lines)
            assert "NodeCache" not in serve.metrics
            wait_until("the worker attached", lambda: ops.metric("flexkv_node_engines") == 1, timeout=120)
            attached = ops.metric("flexkv_node_attached_total")
            worker = next(n for n in serve.metrics if n.startswith("VllmWorker"))
            doc = vg.tokens(6100, 1000)
            full = (len(doc) - 1) // BS  # vLLM computes a prompt's last token: its block is never cached
            first = complete(serve.base_url, doc)
            for i in range(3):  # each fills most of the 40-block device cache with blocks of its own
                complete(serve.base_url, vg.tokens(6200 + i, 1800))
            wait_until(
                "the prompt in the service's host tier, no copy in flight",
                lambda: (
                    ops.metric("flexkv_pool_blocks", state="used", tier="host") >= full + 3 * (1800 // BS)
                    and ops.metric("flexkv_tasks_in_flight") == 0
                ),
            )
            hits = ops.metric("flexkv_hit_blocks_total", tier="host")
            loaded = vg.loaded(vg.scrape(serve.metrics[worker]))["host"]
            second = complete(serve.base_url, doc)
            got = ops.metric("flexkv_hit_blocks_total", tier="host") - hits
            through = vg.loaded(vg.scrape(serve.metrics[worker]))["host"] - loaded
            print(
                f"\nserve ready in {serve.ready_s:.1f} s; {len(doc)} tokens: first cached {first['cached']} "
                f"({first['seconds']:.2f} s), second cached {second['cached']} ({second['seconds']:.2f} s); "
                f"the service's host hits +{got:.0f} blocks, the connector loaded {through:.0f} tokens from host; "
                f"attached {attached:.0f}"
            )
            assert attached == 1 and first["cached"] == 0
            assert second["cached"] == full * BS and through == full * BS, second
            assert got >= full
            assert second["gen"].ids == first["gen"].ids
            serve.proc.send_signal(signal.SIGINT)
            assert serve.proc.wait(timeout=120) == 0, "\n".join(serve.lines[-40:])
        finally:
            serve.close()
        assert ops.proc.poll() is None  # the operator's service outlived the graph
        wait_until("the worker detached", lambda: ops.metric("flexkv_node_engines") == 0)
    finally:
        assert ops.stop() == 0, ops.log.read_text()[-3000:]
