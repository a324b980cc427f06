"""The serve graphs end to end, on 127.0.0.1: Dynamo's real frontend (KV router mode) and our worker
processes started by the launcher from graphs/*.py and configs/*.yaml, driven over the OpenAI HTTP
API. Each test checks that the graph leaves no process and no port behind."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import ROOT, TINY, assert_gone, complete, make_plan, metric

from dynamo_flexkv.serve.launcher import Launcher


def test_agg_graph_serves_completions_and_reports_offload_metrics(tmp_path):
    plan = make_plan(tmp_path, "agg")
    worker = plan.workers[0]
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        prompt = "Offload keeps this long shared prefix around. " * 8
        for _ in range(2):
            r = complete(plan, prompt, 6)
            assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] in ("stop", "length")
            assert 1 <= r["usage"]["completion_tokens"] <= 6 and r["usage"]["prompt_tokens"] > 64
        # The offload metrics ride on Dynamo's /metrics of the worker.
        assert metric(worker.port, "flexkv_requests_total") == 2
        assert metric(worker.port, "flexkv_prompt_tokens_total") == 2 * r["usage"]["prompt_tokens"]
        assert metric(worker.port, "flexkv_stored_blocks_total", tier="host") > 0
        assert metric(worker.port, "flexkv_pool_blocks", tier="host", state="capacity") > 0
        assert metric(worker.port, "flexkv_link_bytes_total", link="d2h") > 0
        assert metric(worker.port, "flexkv_device_blocks", state="total") == 64
    assert_gone(launcher)


@pytest.mark.skipif(
    not (os.path.exists("/usr/bin/etcd") and os.path.exists("/usr/sbin/nats-server")),
    reason="etcd-server and nats-server are installed by make test",
)
def test_repeated_prefix_goes_to_the_worker_holding_it_offloaded_on_etcd_and_nats(tmp_path):
    """Two workers without a device prefix cache: a prompt's KV survives only in the host/disk
    tier of the worker that served it. The router must send each repeat there (a cache hit);
    a request sent to the other worker would find nothing. On etcd discovery and NATS events (the
    multi-node backends; file discovery and ZMQ events serve every other graph test)."""
    plan = make_plan(
        tmp_path, "agg_router", "FlexKVWorker.device-prefix-cache=false", discovery_backend="etcd", event_plane="nats"
    )
    assert [p.name for p in plan.infra] == ["etcd", "nats"]
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        prompts = [f"conversation {i}: " + "a long shared system prompt with history. " * 9 for i in range(4)]
        for p in prompts:
            first = complete(plan, p)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for p in prompts:  # every repeat finds its prefix: the router chose the holder each time
            again = complete(plan, p)
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= again["usage"]["prompt_tokens"] - 16, (cached, again["usage"])
        served = sum(
            metric(w.port, "flexkv_prompt_tokens_cached_total", tier=t) for w in plan.workers for t in ("host", "disk")
        )
        assert served >= sum(len(p) for p in prompts) - 4 * 16  # the hits came from offload tiers
        assert all(metric(w.port, "flexkv_prompt_tokens_cached_total", tier="device") == 0 for w in plan.workers)
    assert_gone(launcher)


def test_serve_stops_the_graph_on_ctrl_c_and_when_a_component_dies(tmp_path):
    base = [
        sys.executable,
        "-m",
        "dynamo_flexkv.cli",
        "serve",
        str(ROOT / "graphs" / "agg_router.py"),
        "-f",
        str(ROOT / "configs" / "agg_router.yaml"),
        *[a for s in TINY for a in ("--set", s)],
    ]

    def start(name, *extra):
        run = tmp_path / name
        p = subprocess.Popen(
            base + ["--set", f"FlexKVWorker.cache.ssd_cache_dir={run}/ssd{{replica}}", "--run-dir", str(run), *extra],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        for line in p.stdout:
            if "graph agg_router ready" in line:
                threading.Thread(target=p.stdout.read, daemon=True).start()  # keep its log pipe flowing
                return p, run
            assert time.monotonic() < deadline and p.poll() is None, "serve never became ready"
        raise AssertionError(f"serve exited with {p.wait()} before it was ready")

    def children(serve):
        out = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True).stdout.split()
        return {int(x): Path(f"/proc/{x}/cmdline").read_bytes().replace(b"\0", b" ").decode() for x in out}

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    serve, run = start("ctrl-c")
    kids = children(serve)
    assert sum("dynamo.frontend" in c for c in kids.values()) == 1
    assert sum("dynamo_flexkv.integrations.dynamo_worker" in c for c in kids.values()) == 2
    serve.send_signal(signal.SIGINT)
    assert serve.wait(timeout=60) == 0
    assert all(gone(pid) for pid in kids)
    for log in (run / "logs").glob("FlexKVWorker*.log"):  # Dynamo's drain ran: no KeyboardInterrupt
        text = log.read_text()
        assert "Traceback" not in text and "flexkv worker stopped" in text, log

    serve, run = start("death", "--set", "FlexKVWorker.on-death=stop")  # (restart is the default)
    kids = children(serve)
    os.kill(next(pid for pid, c in kids.items() if "dynamo_flexkv.integrations.dynamo_worker" in c), signal.SIGKILL)
    assert serve.wait(timeout=60) == 1
    assert all(gone(pid) for pid in kids)
