"""The node cache in serve graphs (serve/node_cache.py): the plan starts one cache server before the
workers that say ``cache: {mode: node}`` and hands them its socket, notes the tier keys those
workers ignore (``--set <Worker>.cache.mode=node`` works on the shipped configs), starts none for
workers whose ``cache.node_socket`` names a running one (and refuses one where nothing listens),
renders a DaemonSet; the served agg graph attaches to a cache server started apart from it; and
the served agg_router graph (two reference workers
on one node cache, the real KV router) serves a prompt one worker computed from the other's view of
the shared host tier, credits both workers in the router, survives a worker's SIGKILL (its restart
loads from the node's host tier) and stops with nothing left."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import urllib.request

import pytest
import yaml
from repo_paths import ROOT

from dynamo_flexkv.serve import GraphError, load_graph
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

WORKERS = ("FlexKVWorker-0", "FlexKVWorker-1")
NODE_SETS = [
    "Common.model=tiny",
    "Common.served-model-name=flexkv-tiny",
    "Frontend.http-port=0",
    "FlexKVWorker.num-device-blocks=64",
    "FlexKVWorker.cache={mode: node}",
]


def plan_for(tmp_path, *overrides, graph="agg_router"):
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        [
            *NODE_SETS,
            f"NodeCache.cache={{cpu_cache_gb: 0.02, ssd_cache_gb: 0.05, ssd_cache_dir: {tmp_path}/ssd}}",
            *overrides,
        ],
    )
    return build_plan(
        load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run", source=f"{graph}.yaml"
    )


def test_the_plan_starts_one_node_cache_before_its_workers_and_hands_them_its_socket(tmp_path):
    p = plan_for(tmp_path)
    kinds = [(proc.name, proc.kind) for proc in p.processes]
    assert kinds == [
        ("Frontend", Kind.FRONTEND),
        ("NodeCache", Kind.CACHE),
        ("FlexKVWorker-0", Kind.WORKER),
        ("FlexKVWorker-1", Kind.WORKER),
    ]
    cache = p.processes[1]
    argv = cache.argv
    sock = argv[argv.index("--socket") + 1]
    assert argv[1:4] == ["-m", "dynamo_flexkv.cli", "cache-server"] and sock == str(
        tmp_path / "run" / "node-cache.sock"
    )
    assert argv[argv.index("--metrics-host") + 1] == "127.0.0.1" and cache.port > 0
    node_cfg = yaml.safe_load(cache.files[argv[argv.index("-f") + 1]])
    assert node_cfg == {
        "cpu_cache_gb": 0.02,
        "ssd_cache_gb": 0.05,
        "ssd_cache_dir": f"{tmp_path}/ssd",
        "tokens_per_block": 16,
    }
    for w in p.workers:
        cfg = yaml.safe_load(w.files[w.env["FLEXKV_CONFIG_PATH"]])
        assert cfg == {"mode": "node", "node_socket": sock, "tokens_per_block": 16}
    assert cache.restart.on_death.value == "restart"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["FlexKVWorker.cache={node_socket: /run/x.sock}"],
            r"FlexKVWorker.cache.node_socket='/run/x.sock' names a node cache server, but FlexKVWorker.cache.mode "
            r"is not node: set --set FlexKVWorker.cache.mode=node",
        ),
        (
            ["FlexKVWorker.cache.node_socket=/nonexistent/node.sock"],
            r"FlexKVWorker.cache.node_socket='/nonexistent/node.sock': no cache server listens on "
            r"/nonexistent/node.sock \(no socket there\): start it first \(dynamo-flexkv cache-server --socket "
            r"/nonexistent/node.sock -f node-cache.yaml\), or remove FlexKVWorker.cache.node_socket",
        ),
        (["NodeCache.replicas=2"], r"NodeCache.replicas is not an option of the node cache"),
        (["NodeCache.max-clients=0"], r"NodeCache.max-clients=0 must be >= 1"),
        (["NodeCache.cache={cpu_cache_gb: 0.000001}"], r"NodeCache.cache: cpu_cache_gb=1e-06 holds no block"),
        (["NodeCache.cache={mode: node}"], r"NodeCache.cache.mode: the server is the node cache"),
        (["NodeCache.on-death=retry"], r"NodeCache.on-death='retry': use restart or stop"),
    ],
)
def test_bad_node_cache_configs_are_refused_naming_the_fix(tmp_path, overrides, message):
    with pytest.raises(GraphError, match=message):
        plan_for(tmp_path, *overrides)


@pytest.mark.parametrize(
    "graph, worker",
    [
        ("agg", "FlexKVWorker"),
        ("agg_router", "FlexKVWorker"),
        ("agg_vllm", "VllmWorker"),
        ("agg_router_vllm", "VllmWorker"),
    ],
)
def test_mode_node_alone_on_a_shipped_config_starts_its_node_cache_and_says_which_keys_it_ignores(
    tmp_path, graph, worker
):
    """`--set <Worker>.cache.mode=node` on a shipped config (its workers' tier keys left in place):
    serve plans the config's NodeCache, the workers' cache files hold only what node mode uses,
    and a note names the tier keys the workers ignore and where their tiers are."""
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        [
            "Frontend.http-port=0",
            f"{worker}.cache.mode=node",
            f"NodeCache.cache.ssd_cache_dir={tmp_path}/node-ssd",
            *(["VllmWorker.model=tiny"] if worker == "VllmWorker" else []),
        ],
    )
    p = build_plan(
        load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run", source=f"{graph}.yaml"
    )
    caches = [proc for proc in p.processes if proc.kind is Kind.CACHE]
    assert len(caches) == 1 and p.workers
    sock = caches[0].argv[caches[0].argv.index("--socket") + 1]
    for w in p.workers:
        cfg = yaml.safe_load(w.files[w.env["FLEXKV_CONFIG_PATH"]])
        assert cfg == {"mode": "node", "node_socket": sock, "tokens_per_block": w.block_size}
    assert p.notes == [
        f"{worker}.cache: mode: node ignores cpu_cache_gb, eviction_policy, ssd_cache_dir, ssd_cache_gb (the keys "
        "of a worker's own, embedded tiers); its tiers are the node cache's: NodeCache.cache, which serve starts"
    ]


def test_workers_attach_to_a_running_cache_server_by_node_socket_and_serve_starts_none(tmp_path, monkeypatch):
    """`<Worker>.cache.node_socket` naming a cache server already running (the operator's): no
    NodeCache process is planned (the config's section is unused), every worker's cache file names
    that socket as given (made absolute: the workers run in the run directory), a note says so; a
    socket file nothing listens on is refused naming the key and the fix; render refuses it."""
    from dynamo_flexkv.core.config import CacheConfig
    from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions

    (tmp_path / "ops").mkdir(mode=0o700)
    sock = tmp_path / "ops" / "node.sock"
    monkeypatch.chdir(tmp_path)
    with NodeCacheServer(CacheConfig(cpu_cache_gb=0.01), ServerOptions(str(sock))):
        p = plan_for(tmp_path, "FlexKVWorker.cache.node_socket=ops/node.sock")
        assert [proc.kind for proc in p.processes].count(Kind.CACHE) == 0
        for w in p.workers:
            assert yaml.safe_load(w.files[w.env["FLEXKV_CONFIG_PATH"]]) == {
                "mode": "node",
                "node_socket": str(sock),
                "tokens_per_block": 16,
            }
        assert p.notes == [
            f"FlexKVWorker: attaches to the cache server at {sock} (FlexKVWorker.cache.node_socket); "
            "serve starts none for it"
        ]
        config = apply_overrides(
            load_config(str(ROOT / "configs" / "agg_router.yaml")),
            ["FlexKVWorker.cache.mode=node", f"FlexKVWorker.cache.node_socket={sock}"],
        )
        with pytest.raises(
            GraphError, match=r"a rendered graph runs its node cache as a DaemonSet.*remove node_socket"
        ):
            build_plan(load_graph(str(ROOT / "graphs" / "agg_router.py")), config, run_dir=tmp_path / "r", local=False)
    # The server stopped: its socket file is gone; a stale one (a SIGKILLed server's) is refused too.
    with pytest.raises(
        GraphError, match=r"node_socket='ops/node.sock': no cache server listens on .*\(no socket there\)"
    ):
        plan_for(tmp_path, "FlexKVWorker.cache.node_socket=ops/node.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    with pytest.raises(GraphError, match=r"\(a socket file, but nothing listens on it\): start it first"):
        plan_for(tmp_path, f"FlexKVWorker.cache.node_socket={sock}")


def test_serve_exits_2_naming_the_key_when_the_given_node_socket_is_not_there(tmp_path, capsys):
    from dynamo_flexkv.cli import main

    argv = ["serve", str(ROOT / "graphs" / "agg.py"), "-f", str(ROOT / "configs" / "agg.yaml")]
    argv += ["--run-dir", str(tmp_path / "run"), "--set", "Frontend.http-port=0"]
    argv += ["--set", "FlexKVWorker.cache.mode=node", "--set", f"FlexKVWorker.cache.node_socket={tmp_path}/no.sock"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"FlexKVWorker.cache.node_socket='{tmp_path}/no.sock': no cache server listens" in err, err
    assert "dynamo-flexkv cache-server --socket" in err


def test_render_runs_the_node_cache_as_a_daemonset_the_workers_reach_by_host_path(tmp_path):
    from dynamo_flexkv.serve.render import render_k8s

    config = apply_overrides(load_config(str(ROOT / "configs" / "agg_router_vllm_node.yaml")), [])
    plan = build_plan(
        load_graph(str(ROOT / "graphs" / "agg_router_vllm.py")),
        config,
        run_dir=tmp_path,
        local=False,
        source="agg_router_vllm_node.yaml",
    )
    docs = list(yaml.safe_load_all(render_k8s(plan, "img")))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["DynamoGraphDeployment", "ConfigMap", "DaemonSet"]
    ds = docs[2]["spec"]["template"]["spec"]
    assert ds["hostPID"] is True  # it fences a dead engine's writes by its pid
    args = ds["containers"][0]["args"]
    assert args[args.index("--socket") + 1] == "/run/dynamo-flexkv/node.sock" and "$(POD_IP)" in args
    worker = docs[0]["spec"]["services"]["VllmWorker"]
    env = {e["name"]: e.get("value") for e in worker["envs"]}
    assert env["FLEXKV_MODE"] == "node" and env["FLEXKV_NODE_SOCKET"] == "/run/dynamo-flexkv/node.sock"
    mounts = worker["extraPodSpec"]["mainContainer"]["volumeMounts"]
    assert {"name": "node-cache", "mountPath": "/run/dynamo-flexkv"} in mounts


# ---- the served graph --------------------------------------------------------------------------------


def complete(base_url: str, prompt, worker: int = 0, max_tokens: int = 4) -> dict:
    body = {
        "model": "flexkv-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "nvext": {"extra_fields": ["worker_id", "engine_data", "completion_token_ids"]},
    }
    if worker:
        body["nvext"]["backend_instance_id"] = worker
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        doc = json.loads(r.read())
    nv = doc["nvext"]
    return {
        "ids": nv["completion_token_ids"],
        "worker": int(nv["worker_id"]["decode_worker_id"]),
        "tiers": nv["engine_data"]["flexkv"]["cached_tokens"],
    }


def node_metric(serve, name: str) -> float:
    from served import scrape, total

    return total(scrape(serve.metrics["NodeCache"]), name)


def served_node_graph(tmp_path):
    """The agg_router graph of two tiny reference workers on one node cache with a disk tier: the
    Serve, each worker's Dynamo instance id, and a KvRouter probe of the frontend's view."""
    import vllm_graph as vg
    from served import Serve

    serve = Serve(
        tmp_path,
        "node",
        graph="agg_router",
        base=[*NODE_SETS, f"NodeCache.cache={{cpu_cache_gb: 0.02, ssd_cache_gb: 0.05, ssd_cache_dir: {tmp_path}/ssd}}"],
    )
    try:
        ids = {n: vg.worker_id(vg.scrape(serve.metrics[n])) for n in WORKERS}
        front = [p for p in serve.children if b"dynamo.frontend" in open(f"/proc/{p}/cmdline", "rb").read()]
        probe = vg.RouterProbe(front[0], tmp_path / "probe.log", endpoint="dynamo.flexkv.generate", block_size=16)
    except BaseException:
        serve.close()
        raise
    return serve, ids, probe


@pytest.mark.served
def test_two_workers_on_one_node_cache_load_each_others_prefixes_and_the_router_credits_both(tmp_path):
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    import vllm_graph as vg
    from node_helpers import BS, Engine, Held, prompt
    from served import assert_all_gone, wait_until

    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    serve, ids, probe = served_node_graph(tmp_path)
    try:
        names = WORKERS
        tokens = [t % 500 + 10 for t in prompt(21, 30 * BS + 5)]  # ids of the tiny model's vocabulary
        first = complete(serve.base_url, tokens, ids[names[0]])
        assert first["worker"] == ids[names[0]] and first["tiers"]["host"] == 0
        n = len(tokens) // BS

        def view():
            return {w: v for w, v in probe.scores(tokens).items() if w in ids.values()}

        # Both workers are credited with the node's host and disk copies (the computing one holds it
        # on its device too): every worker on the node can load them.
        wait_until(
            "the router credits both workers",
            lambda: all(view().get(ids[x], (0, 0, 0))[1:] == (n, n) for x in names),
            timeout=30,
        )
        # The other worker serves the prompt from the shared host tier, with the same tokens.
        other = complete(serve.base_url, tokens, ids[names[1]])
        assert other["worker"] == ids[names[1]] and other["tiers"]["host"] == n * BS, other
        assert other["ids"] == first["ids"]
        assert node_metric(serve, "flexkv_hit_blocks_total") >= n

        # The router's view of every worker against the node cache's contents. An engine of the same
        # model attached from here (the service's public interface; it hears the same events) stores a
        # burst of prompts sharing prefixes, that no worker holds on its device: each worker's
        # (device, host, disk) counts of each prompt must be (0, its prefix held on host, its prefix
        # held on disk) by the service (the router's counts include the faster tiers).
        spec = EngineModelConfig.preset("tiny").kv_spec()
        sock = [a for a in serve.lines if "cache server ready on" in a][0].split("ready on ")[1].split(" ")[0]
        held = Held()
        admin = Engine(sock, "admin", model_id="tiny|flexkv-tiny", spec=spec, listener=held)
        stem = [t % 500 + 10 for t in prompt(22, 6 * BS)]
        burst = [stem + [t % 500 + 10 for t in prompt(100 + i, (i % 5 + 1) * BS)] for i in range(24)]
        for i, q in enumerate(burst):  # stores in flight together: one hold each, collected below
            admin.fill(q, list(range(len(q) // BS)))
            admin.offload.store(q, list(range(len(q) // BS)), key=f"b{i}")
        wait_until(
            "every store's hold back",
            lambda: admin.offload.drain(30) and not admin.offload.finished_holds() and admin.offload.tasks_pending == 0,
            timeout=60,
        )

        def expected(q):
            """The router counts a tier with the faster ones: host = the host prefix, disk = the prefix
            held on host or disk (a racing store may leave its suffix on host only)."""
            hs = admin.offload.block_hashes(q)
            return (0, held.prefix(("host",), hs), held.prefix(("host", "disk"), hs))

        def views_match(live):
            scores = [probe.scores(q) for q in burst]
            bad = [
                (i, x, sc.get(ids[x], (0, 0, 0)), expected(q))
                for i, (q, sc) in enumerate(zip(burst, scores))
                for x in live
                if sc.get(ids[x], (0, 0, 0)) != expected(q)
            ]
            mismatches[:] = bad
            return not bad

        mismatches: list = []
        try:
            wait_until(
                "both workers' views equal the node's contents after the burst", lambda: views_match(names), timeout=60
            )
        except AssertionError:
            raise AssertionError(f"(prompt, worker, router view, node contents): {mismatches[:10]}") from None
        assert expected(burst[0])[1] == len(burst[0]) // BS  # the views are not trivially empty
        assert admin.offload.evict_host(30) > 0  # eviction leaves every worker's view
        wait_until("both views equal the node's contents after the eviction", lambda: views_match(names), timeout=60)
        assert all(expected(q)[1] == 0 and expected(q)[2] >= 6 for q in burst)

        # A worker SIGKILLed: the router drops it; restarted, it re-attaches, receives the node's
        # contents (its view equals them again) and its first request of the prompt loads it.
        victim = names[0]
        pid = serve.worker_pid(victim)
        os.kill(pid, signal.SIGKILL)
        serve.wait_for(rf"{victim} is ready again after \S+ s", 120)
        wait_until("the node cache counts both workers again", lambda: node_metric(serve, "flexkv_node_engines") == 3)
        assert node_metric(serve, "flexkv_node_copies_in_flight") == 0
        new_id = vg.worker_id(vg.scrape(serve.metrics[victim]))
        assert ids[victim] not in probe.scores(burst[0])  # the dead instance is gone from the router
        ids[victim] = new_id
        wait_until("the restarted worker's view equals the node's contents", lambda: views_match(names), timeout=60)
        admin.offload.shutdown()
        again = complete(serve.base_url, tokens, new_id)
        assert again["tiers"]["disk"] + again["tiers"]["host"] == n * BS and again["ids"] == first["ids"], again
        wait_until("no task left in flight", lambda: node_metric(serve, "flexkv_tasks_in_flight") == 0)
        serve.children += [
            int(x) for x in os.popen(f"pgrep -P {serve.proc.pid}").read().split() if int(x) not in serve.children
        ]
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=90) == 0, "\n".join(serve.lines[-40:])
        assert_all_gone(serve.children, [])
        assert vg.event_trouble(serve.run) == []
    finally:
        probe.close()
        serve.close()


def test_the_replays_node_configuration_pools_the_workers_tiers_into_one_node_cache(tmp_path):
    """`replay --configs node` (the demo's node row): the same memory and disk as every worker's
    own tiers together, in one node cache the two workers share."""
    from dynamo_flexkv.replay.configs import CONFIGURATIONS, node_cache_config

    assert CONFIGURATIONS["node"].node
    config = apply_overrides(
        load_config(str(ROOT / "configs" / "agg_router_vllm.yaml")),
        ["Frontend.http-port=0", "VllmWorker.cache.cpu_cache_gb=0.0625"],
    )
    pooled = node_cache_config(config, "VllmWorker", tmp_path)
    assert pooled["VllmWorker"]["cache"] == {"mode": "node"}
    assert pooled["NodeCache"]["cache"] == {
        "cpu_cache_gb": 0.125,
        "ssd_cache_gb": 2.0,
        "eviction_policy": "lru",
        "ssd_cache_dir": str(tmp_path / "node-ssd"),
    }
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg_router_vllm.py")), pooled, run_dir=tmp_path / "run")
    assert [p.kind for p in plan.processes].count(Kind.CACHE) == 1 and len(plan.workers) == 2


def reference_tokens(prompts, max_tokens: int = 4):
    """What the no-offload graph answers: the tiny preset's engine in this process, greedy, ending
    at the served tokenizer's end-of-sequence id as the frontend does."""
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

    cfg = EngineModelConfig.preset("tiny")
    with tempfile.TemporaryDirectory() as d:
        eos = json.loads((write_model_dir(cfg, d, context_length=1024) / "config.json").read_text())["eos_token_id"]
    engine = LLMEngine(cfg, num_device_blocks=256, device_prefix_cache=False)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(eos,))
    return [r.output for r in engine.generate(prompts, params)]


@pytest.mark.served
def test_a_killed_node_cache_costs_no_request_and_its_disk_prefix_loads_again(tmp_path):
    """SIGKILL the node's cache service while requests flow: every request is answered 200 with the
    no-offload tokens (the engines recompute during the outage), serve restarts the service, both
    workers re-attach by themselves, and the prefix the restarted service re-adopted from disk loads
    on a worker that never computed it and reaches the router for both workers."""
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    import threading
    import time

    from node_helpers import BS, prompt
    from served import wait_until

    serve, ids, probe = served_node_graph(tmp_path)
    try:
        names = WORKERS
        kept = [t % 500 + 10 for t in prompt(31, 20 * BS + 3)]  # on disk before the kill, loaded after
        n = len(kept) // BS
        traffic = [[t % 500 + 10 for t in prompt(200 + i, (4 + i % 9) * BS + i)] for i in range(12)]
        want = reference_tokens([kept, *traffic])
        assert complete(serve.base_url, kept, ids[names[0]])["ids"] == want[0]
        wait_until(
            "the prompt is on the node's disk",
            lambda: {w: v for w, v in probe.scores(kept).items()}.get(ids[names[1]], (0, 0, 0))[2] == n,
            timeout=60,
        )

        answers: list = []  # (prompt index, status or exception, token ids)
        stop = threading.Event()

        def flow() -> None:
            i, deadline = 0, time.monotonic() + 240
            while not stop.is_set() and time.monotonic() < deadline:  # bounded: 4 minutes at most
                k = i % len(traffic)
                try:
                    got = complete(serve.base_url, traffic[k], ids[names[i % 2]] if i % 3 else 0)
                    answers.append((k, 200, got["ids"]))
                except Exception as e:  # noqa: BLE001 - recorded, asserted below
                    answers.append((k, repr(e), None))
                i += 1

        loader = threading.Thread(target=flow, daemon=True)
        loader.start()
        wait_until("requests flow", lambda: len(answers) >= 6)
        cache_pid = next(p for p in serve.children if b"cache-server" in open(f"/proc/{p}/cmdline", "rb").read())
        since, before = len(serve.lines), len(answers)
        os.kill(cache_pid, signal.SIGKILL)
        serve.wait_for(r"NodeCache is ready again after \S+ s", 120, since)
        wait_until("both workers re-attached", lambda: node_metric(serve, "flexkv_node_engines") == 2, timeout=60)
        after = len(answers)
        wait_until("requests flow after the restart", lambda: len(answers) >= after + 6, timeout=120)
        stop.set()
        loader.join(120)
        assert len(answers) > before + 6, "no request was sent during the outage"
        bad = [(k, status, got, want[1 + k]) for k, status, got in answers if status != 200 or got != want[1 + k]]
        assert bad == [], f"{len(bad)} of {len(answers)} requests failed or differ: {bad[:5]}"

        # The restarted service re-adopted the prompt from disk: both workers are credited with it
        # again, and the worker that never computed it loads it from there.
        seen: list = []

        def credited() -> bool:
            seen[:] = [probe.scores(kept).get(ids[x], (0, 0, 0)) for x in names]
            return all(v[2] == n for v in seen)

        try:
            wait_until("the router credits both workers with the re-adopted prefix", credited, timeout=60)
        except AssertionError:
            raise AssertionError(f"the router's (device, host, disk) blocks of {n} per worker: {seen}") from None
        other = complete(serve.base_url, kept, ids[names[1]])
        assert other["ids"] == want[0] and other["tiers"]["disk"] + other["tiers"]["host"] == n * BS, other
        assert other["tiers"]["disk"] > 0, other  # the host tier died with the service
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=90) == 0, "\n".join(serve.lines[-40:])
        assert not [x for x in serve.lines if "engine thread failed" in x]
    finally:
        probe.close()
        serve.close()


@pytest.mark.served
def test_a_reference_graph_attaches_to_a_cache_server_the_operator_started(tmp_path):
    """The shipped agg graph, its worker's cache set to node mode with the socket of a cache server
    started before it and apart from it (its own process, a private socket): serve starts no
    service of its own, says where the worker attaches, and the worker attaches there (the service's
    counters); a prompt sent twice, the device keeping none of it (no device prefix cache), is the
    second time loaded from the service's host tier; serve's stop leaves that service running."""
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    from node_helpers import BS, CacheServerProcess, prompt
    from served import Serve, wait_until

    ops = CacheServerProcess(tmp_path, "cpu_cache_gb=0.02")
    try:
        serve = Serve(
            tmp_path,
            "ext",
            graph="agg",
            base=[
                "Common.model=tiny",
                "Common.served-model-name=flexkv-tiny",
                "Frontend.http-port=0",
                "FlexKVWorker.num-device-blocks=64",
                "FlexKVWorker.device-prefix-cache=false",  # every repeat comes from the tiers
                "FlexKVWorker.cache.mode=node",
                f"FlexKVWorker.cache.node_socket={ops.socket}",
            ],
        )
        try:
            assert f"note: FlexKVWorker: attaches to the cache server at {ops.socket}" in "\n".join(serve.lines)
            assert "NodeCache" not in serve.metrics and "cache-server" not in "".join(
                open(f"/proc/{p}/cmdline").read() for p in serve.children
            )
            wait_until("the worker attached", lambda: ops.metric("flexkv_node_engines") == 1, timeout=60)
            assert ops.metric("flexkv_node_attached_total") == 1
            tokens = [t % 500 + 10 for t in prompt(41, 12 * BS + 5)]
            n = len(tokens) // BS
            first = complete(serve.base_url, tokens)
            assert first["tiers"]["host"] == 0
            wait_until(
                "the prompt stored in the service's host tier",
                lambda: ops.metric("flexkv_pool_blocks", state="used", tier="host") >= n,
            )
            hits = ops.metric("flexkv_hit_blocks_total", tier="host")
            second = complete(serve.base_url, tokens)
            got = ops.metric("flexkv_hit_blocks_total", tier="host") - hits
            print(
                f"\nserve ready in {serve.ready_s:.1f} s; {len(tokens)} tokens: first {first['tiers']}, "
                f"second {second['tiers']}; the service's host hits +{got:.0f} blocks, "
                f"attached {ops.metric('flexkv_node_attached_total'):.0f}"
            )
            assert second["tiers"]["host"] == n * BS and second["ids"] == first["ids"], second
            assert got >= n
            serve.proc.send_signal(signal.SIGINT)
            assert serve.proc.wait(timeout=90) == 0, "\n".join(serve.lines[-40:])
        finally:
            serve.close()
        # The operator's service outlived the graph: the worker detached, the blocks stayed.
        assert ops.proc.poll() is None
        wait_until("the worker detached", lambda: ops.metric("flexkv_node_engines") == 0)
        assert ops.metric("flexkv_pool_blocks", state="used", tier="host") >= n
    finally:
        assert ops.stop() == 0, ops.log.read_text()[-3000:]
