"""One disaggregated graph over three nodes (network namespaces, dynamo_flexkv.serve.nodes), driven
from node A, where it runs (tests/unit/test_nodes.py starts it with ``ip netns exec``):

    python tests/helpers/nodes_scenario.py NODES_FILE TMP_DIR OUT.json

Node A: the frontend, etcd and NATS; node B: the prefill worker; node C: the decode worker; the
remote tier: a Redis Cluster with one master on each node. It records, for the test to judge:
the texts the graph served against the aggregated graph's (served on A's loopback); the bytes
decode received on C's link against the KV bytes its handovers reported; a prompt prefilled on B
loaded on C from the remote tier after C's worker restarted empty; and C's link, then B's, taken
down (what a request gets, how fast) and brought back (how soon requests succeed again)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from disagg_helpers import agg_plan, complete, disagg_plan, prompts
from served import assert_gone, scrape, total, wait_until

from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.nodes import Nodes
from dynamo_flexkv.serve.redis_server import RedisCluster

TOKENS = 4
OUTAGE_S = 30.0  # long enough for C's worker to lose its etcd lease (10 s) and stop


def metric(proc, name: str, **labels) -> float:
    """A worker's metric, read at its node's address."""
    return total(scrape(proc.metrics_url), name, **labels)


def texts(plan, batch):
    return [complete(plan, p, TOKENS)["choices"][0]["text"] for p in batch]


def timed(plan, prompt):
    """(HTTP status, seconds) of one request."""
    t0 = time.monotonic()
    try:
        complete(plan, prompt, TOKENS)
        code = 200
    except urllib.error.HTTPError as e:
        code = e.code
    except OSError:
        code = 0  # no answer at all
    return code, round(time.monotonic() - t0, 2)


PLACED = (
    "Frontend.node=A",
    "PrefillWorker.node=B",
    "DecodeWorker.node=C",
    "DecodeWorker.cache.ssd_cache_gb=0",
    "DecodeWorker.restart-backoff-s=0.2",
)


@contextmanager
def node_graph(tmp: Path, nodes: Nodes, report: dict, *overrides: str):
    """The disagg graph placed on the nodes, supervised as serve runs it (restarts, liveness);
    on exit every process has exited (their codes go to report["exit_codes"])."""
    plan = disagg_plan(tmp, "disagg", *PLACED, *overrides, discovery_backend="etcd", event_plane="nats", nodes=nodes)
    report["hosts"] = {p.name: p.host for p in plan.processes + plan.infra}
    with Launcher(plan) as launcher:
        launcher.wait_ready(180)
        stop = threading.Event()
        supervisor = threading.Thread(target=lambda: launcher.supervise(stop), daemon=True)
        supervisor.start()
        try:
            yield plan, launcher
        finally:
            stop.set()
            supervisor.join(30)
    assert_gone(launcher)
    codes = report.setdefault("exit_codes", {})
    for name, p in launcher.running.items():
        codes[name] = codes.get(name) or p.returncode  # a non-zero code of either graph stays


def outage(nodes: Nodes, name: str, plan, prompts_: list) -> dict:
    """Node ``name``'s link down OUTAGE_S, requests sent all along, then up: the first answer,
    the longest, the statuses seen, and how soon a request succeeded once the link was back."""
    nodes.set_link(name, False)
    down_at, answers = time.monotonic(), []
    try:
        while time.monotonic() - down_at < OUTAGE_S:
            answers.append(timed(plan, prompts_[len(answers) % len(prompts_)]))
            time.sleep(0.5)
    finally:
        nodes.set_link(name, True)
    t0, code = time.monotonic(), 0
    while code != 200 and time.monotonic() - t0 < 180:
        code, _ = timed(plan, prompts_[2])
        if code != 200:
            time.sleep(0.5)
    return {
        "first": answers[0],
        "max_s": max(s for _, s in answers),
        "statuses": sorted({c for c, _ in answers}),
        "recovered_s": round(time.monotonic() - t0, 1) if code == 200 else None,
    }


def main(nodes_file: str, tmp: Path, out: Path) -> None:
    nodes = Nodes.load(nodes_file)
    base, extra = prompts(8, seed=41)
    batch = base + extra
    report: dict = {}
    with Launcher(agg_plan(tmp)) as agg:  # the reference: one aggregated worker on A's loopback
        agg.wait_ready(120)
        report["agg"] = texts(agg.plan, batch)

    # Without a remote tier decode's only source is the handover: NIXL over C's link.
    with node_graph(tmp / "nixl", nodes, report) as (plan, launcher):
        prefill, decode = plan.workers
        rx0 = nodes.link_bytes("C")["rx"]
        pulled0 = metric(decode, "flexkv_handover_bytes_total")
        report["disagg"] = texts(plan, batch)
        report["c_rx_bytes"] = nodes.link_bytes("C")["rx"] - rx0
        report["handover_bytes"] = metric(decode, "flexkv_handover_bytes_total") - pulled0
        report["prefill_computed"] = metric(prefill, "flexkv_prompt_tokens_computed_total")

        # Each worker node's cable out for OUTAGE_S in turn (decode's C, then prefill's B): each
        # request in that time ends (cleanly or not) within the bound; the cable back in, the
        # graph serves again.
        for name in ("C", "B"):
            report[f"link_down_{name}"] = outage(nodes, name, plan, base)
        report["after_link"] = texts(plan, batch[:4])
        report["events"] = list(launcher.events)

    # With a Redis Cluster spread over A, B and C: B stores what it prefills; C, restarted with
    # nothing (no disk tier, host and device gone), loads that prefix from the cluster.
    with RedisCluster(on=[(n.address, n.netns) for n in nodes.nodes.values()], maxmemory="64mb") as cluster:
        report["redis_masters"] = [s.url for s in cluster.servers]
        remote = [
            f"{w}.cache.{k}"
            for w in ("PrefillWorker", "DecodeWorker")
            for k in ("enable_remote=true", f"remote_cache_url={cluster.url}")
        ]
        with node_graph(tmp / "remote", nodes, report, *remote) as (plan, launcher):
            prefill, decode = plan.workers
            texts(plan, [batch[0]])
            wait_until(
                "B's writes to the remote tier",
                lambda: metric(prefill, "flexkv_remote_stored_blocks_total") > 0,
                timeout=60,
            )
            os.kill(launcher.running[decode.name].pid, signal.SIGKILL)
            wait_until(
                "the decode worker restarted and ready",
                lambda: decode.name in launcher.ready and launcher.restarts.get(decode.name, 0) >= 1,
                timeout=120,
                every=0.2,
            )
            remote0 = metric(decode, "flexkv_prompt_tokens_cached_total", tier="remote")
            code, deadline = 0, time.monotonic() + 60
            while code != 200 and time.monotonic() < deadline:  # the frontend re-learns the restarted worker
                code, _ = timed(plan, "warm up " + base[1])
            report["after_restart"] = texts(plan, [batch[0]])[0]
            report["c_remote_tokens"] = metric(decode, "flexkv_prompt_tokens_cached_total", tier="remote") - remote0
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
