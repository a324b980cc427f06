"""A served graph survives a worker's death: the real frontend (KV router, request migration) and
our workers started by the launcher on 127.0.0.1, a worker SIGKILLed while requests stream.
Each test checks that nothing of any process group (restarted lives included) and no port is left."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from test_dynamo_worker import ROOT, TINY, assert_gone, complete, make_plan, metric  # noqa: E402

from dynamo_flexkv.serve.launcher import Launcher  # noqa: E402

STREAM_TOKENS = 300  # long enough that a kill lands mid-stream on this slow machine


@dataclass
class Streamed:
    status: int = 0
    chunks: int = 0
    error: Optional[dict] = None  # the SSE error event, if the stream ended with one
    usage: Optional[dict] = None
    done: bool = False  # saw data: [DONE]
    seconds: float = 0.0


def stream(base_url: str, model: str, prompt, max_tokens: int = STREAM_TOKENS,
           out: Optional[Streamed] = None, **extra) -> Streamed:
    """One streamed completion, read to its end. ``out`` is filled as chunks arrive (another
    thread may watch it); ``extra`` goes into the request body."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    out, t0 = out if out is not None else Streamed(), time.monotonic()
    try:
        r = urllib.request.urlopen(req, timeout=60)  # a hang fails the test here
    except urllib.error.HTTPError as e:  # refused before the stream began (e.g. its worker was dead)
        body = json.loads(e.read() or b"{}")
        out.status, out.error, out.seconds = e.code, body.get("error", body), time.monotonic() - t0
        return out
    with r:
        out.status = r.status
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                out.error = doc["error"]
            elif doc.get("usage"):
                out.usage = doc["usage"]
            else:
                out.chunks += 1
    out.seconds = time.monotonic() - t0
    return out


def wait_until(what: str, cond, timeout: float = 60, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def inflight(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^dynamo_component_inflight_requests(?:\{[^}]*\})? ([0-9.e+-]+)$",
                                             text, re.M))


def routed_workers(base_url: str) -> int:
    """How many workers the frontend's router has registered (its own gauge on /metrics)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return len(re.findall(r"^dynamo_component_router_worker_registered\{[^}]*\} 1$", text, re.M))


def holder_of(plan, prompt: str):
    """Sends ``prompt`` once and returns the worker that served it (its request counter moved)."""
    before = {w.name: metric(w.port, "flexkv_requests_total") for w in plan.workers}
    complete(plan, prompt, 2)
    served = [w for w in plan.workers if metric(w.port, "flexkv_requests_total") > before[w.name]]
    assert len(served) == 1
    return served[0]


def assert_all_gone(pids: List[int], ports: List[int]) -> None:
    for pid in pids:  # every process group ever started, restarted workers' earlier lives included
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_killed_worker_is_restarted_its_requests_migrate_and_a_second_death_spends_its_budget(tmp_path):
    """Two workers, no device prefix cache (a prompt's KV lives only in the host/disk tiers of the
    worker that served it). Kill the holder of prompt P while 8 requests stream: the frontend
    migrates its in-flight requests to the other worker (all 8 complete), the launcher restarts it
    on the same ports and SSD directory, it re-adopts P from disk and announces it, and the router
    sends P to it again (a disk hit on the restarted worker). Killed again, it has spent its budget
    (max-restarts=1): the graph stops with exit 1, naming it, and leaves nothing behind."""
    plan = make_plan(tmp_path, "agg_router", "FlexKVWorker.device-prefix-cache=false",
                     "FlexKVWorker.restart-backoff-s=0.5", "FlexKVWorker.max-restarts=1")
    front = plan.processes[0]
    assert front.argv[front.argv.index("--migration-limit") + 1] == "3"  # on by default in the config
    launcher = Launcher(plan)
    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: setattr(launcher, "exit_code", launcher.supervise(stop)))
    try:
        launcher.start()
        launcher.wait_ready(120)
        supervisor.start()
        prompt = "the prefix that only one worker holds on disk. " * 6
        victim = holder_of(plan, prompt)
        other = next(w for w in plan.workers if w is not victim)
        wait_until("P on the holder's disk", lambda: metric(victim.port, "flexkv_stored_blocks_total", tier="disk") > 0)

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, plan.base_url, plan.served_model_name, f"stream {i}: " + "x y z " * 30)
                       for i in range(8)]
            wait_until("requests in flight on the victim", lambda: inflight(victim.port) > 0, every=0.05)
            first_pid = launcher.running[victim.name].pid
            os.kill(first_pid, signal.SIGKILL)
            results = [f.result() for f in futures]
        assert all(r.status == 200 and r.done and r.error is None for r in results), results
        assert all(r.usage and r.usage["completion_tokens"] >= 1 for r in results), results
        migrated = metric(front.port, "dynamo_frontend_model_migration_duration_seconds_count", outcome="success")
        assert migrated >= 1  # the victim's in-flight requests finished on the other worker

        wait_until("the restarted worker ready", lambda: victim.name not in launcher.starting
                   and launcher.restarts.get(victim.name) == 1, timeout=90)
        wait_until("the router routing to it", lambda: routed_workers(plan.base_url) == 2)
        assert launcher.running[victim.name].pid != first_pid
        assert any(f"{victim.name} exited with signal SIGKILL" in e and "discovery entries" in e
                   for e in launcher.events), launcher.events
        time.sleep(2)  # its re-announced disk blocks reach the router
        again = complete(plan, prompt, 2)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
        # The new process counts from zero: this disk hit happened on the restarted worker.
        assert metric(victim.port, "flexkv_requests_total") == 1
        assert metric(victim.port, "flexkv_prompt_tokens_cached_total", tier="disk") > 0
        assert metric(other.port, "flexkv_requests_total") >= 4  # both workers served

        os.kill(launcher.running[victim.name].pid, signal.SIGKILL)
        supervisor.join(timeout=30)
        assert launcher.exit_code == 1
        assert re.match(rf"error: {victim.name} exited with signal SIGKILL: it died 2 times within 300 s, more "
                        r"than its restart budget \(max-restarts=1\); stopping the graph. Its last log lines",
                        launcher.events[-1]), launcher.events[-1]
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join()  # no restart may race the shutdown
        launcher.shutdown()
    assert_gone(launcher)
    assert_all_gone([p.pid for p in launcher.spawned], [])


class Serve:
    """``dynamo-flexkv serve`` as a user runs it, its output collected line by line."""

    def __init__(self, tmp_path, name: str, *overrides: str, graph: str = "agg_router",
                 base: Optional[List[str]] = None, ready_timeout: float = 120) -> None:
        """``graph``: graphs/<graph>.py with configs/<graph>.yaml; ``base``: the --set values before
        ``overrides`` (default: the tiny FlexKV workers, their SSD directories under the run dir)."""
        self.run = run = tmp_path / name
        sets = [*(base if base is not None else [*TINY, f"FlexKVWorker.cache.ssd_cache_dir={run}/ssd{{replica}}"]),
                *overrides]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_flexkv.cli", "serve", str(ROOT / "graphs" / f"{graph}.py"),
             "-f", str(ROOT / "configs" / f"{graph}.yaml"), "--run-dir", str(run),
             *[a for s in sets for a in ("--set", s)]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: List[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self.wait_for(rf"graph {graph} ready: (http://\S+)/v1", ready_timeout)
        except BaseException:
            self.close()  # never ready: its components must not outlive the failed test
            raise
        self.ready_s = time.monotonic() - self.started
        self.base_url = ready.group(1)
        self.metrics = {m.group(1): m.group(2) for m in (re.match(r"\s+(\S+) metrics: (http://\S+)", x)
                                                          for x in self.lines) if m}
        self.children = [int(x) for x in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                                        text=True).stdout.split()]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None or self._reader.is_alive(), \
                f"serve exited with {self.proc.returncode}:\n" + "\n".join(self.lines[-40:])
            assert time.monotonic() < deadline, f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:])
            time.sleep(0.1)

    def worker_port(self, name: str) -> int:
        return int(self.metrics[name].rsplit(":", 1)[1].split("/")[0])

    def worker_pid(self, name: str) -> int:
        port = self.worker_port(name)
        for pid in self.children:
            if f"DYN_SYSTEM_PORT={port}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                return pid
        raise AssertionError(f"no child of serve runs {name}")

    def close(self) -> None:
        """After a failure too: serve's own shutdown stops its components (SIGKILL would orphan them)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_without_migration_the_dead_workers_requests_fail_clearly_and_ctrl_c_stops_a_pending_restart(tmp_path):
    """migration-limit=0: the killed worker's streams end at once with a 503 error event (no hang),
    the others complete, and the graph keeps serving on the healthy worker while the restart waits
    out its backoff; Ctrl-C then stops everything (exit 0) and the restart never happens."""
    serve = Serve(tmp_path, "nomigrate", "Frontend.migration-limit=0", "FlexKVWorker.restart-backoff-s=30")
    try:
        assert set(serve.metrics) == {"Frontend", "FlexKVWorker-0", "FlexKVWorker-1"}  # where each /metrics is
        assert serve.metrics["Frontend"] == serve.base_url + "/metrics"
        victim = "FlexKVWorker-1"
        model = "flexkv-tiny"
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, serve.base_url, model, f"stream {i}: " + "x y z " * 30) for i in range(8)]
            wait_until("requests in flight on the victim", lambda: inflight(serve.worker_port(victim)) > 0, every=0.05)
            os.kill(serve.worker_pid(victim), signal.SIGKILL)
            results = [f.result() for f in futures]
        failed = [r for r in results if r.error is not None]
        assert failed and len(failed) < 8, results
        # A stream under way ends with an error event; one not yet begun is refused with a 503.
        assert all(r.seconds < 30 and (r.status == 503 or (r.status == 200 and r.done and r.error["code"] == 503))
                   for r in failed), failed
        assert all(r.usage and r.usage["completion_tokens"] >= 1 for r in results if r.error is None)
        serve.wait_for(rf"{victim} exited with signal SIGKILL .*removed its \d+ discovery entries; restarting "
                       r"it in 30.0 s", 10)
        # Deregistered at once: the router drops it within moments (not after Dynamo's 10 s TTL).
        wait_until("the router dropping the dead worker", lambda: routed_workers(serve.base_url) == 1, timeout=5)
        for i in range(4):  # the healthy worker serves every new request; none is routed to the dead one
            r = stream(serve.base_url, model, f"after the death {i}: " + "a b " * 20, 8)
            assert r.status == 200 and r.error is None and r.done, r
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=60) == 0, "\n".join(serve.lines[-60:])
        assert not any(f"{victim} restarted" in x for x in serve.lines)
        assert_all_gone(serve.children, [serve.worker_port(n) for n in ("FlexKVWorker-0", "FlexKVWorker-1")])
    finally:
        serve.close()
