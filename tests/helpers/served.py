"""Helpers for tests of served graphs (not a test module): plans of the shipped graphs with the
tiny model, ``dynamo-flexkv serve`` run as a user runs it, streamed completions read chunk by
chunk, the workers' /metrics, and the checks that a graph left no process and no port behind."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_paths import ROOT
from sse import DONE, sse_data

from dynamo_flexkv.core.http_client import http_json, samples, scrape, sums_by, total
from dynamo_flexkv.core.procgroup import members
from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.plan import LaunchPlan, RestartPolicy, apply_overrides, build_plan, load_config

AGG_ROUTER = str(ROOT / "graphs" / "agg_router.py")
CONFIG = str(ROOT / "configs" / "agg_router.yaml")
# Dynamo's words for events it could not apply or never received (dynamo_kv_router / dynamo_llm).
CONTRADICTIONS = ("Failed to find block to remove", "Failed to find parent block", "dropping the newest batch")
TINY = [
    "Common.model=tiny",
    "Common.served-model-name=flexkv-tiny",
    "Frontend.http-port=0",
    "FlexKVWorker.num-device-blocks=64",
    "FlexKVWorker.cache.cpu_cache_gb=0.02",
    "FlexKVWorker.cache.ssd_cache_gb=0.05",
]


def make_plan(tmp_path, graph: str, *overrides: str, **kw):
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        [*TINY, f"FlexKVWorker.cache.ssd_cache_dir={tmp_path}/ssd{{replica}}", *overrides],
    )
    return build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run", **kw)


MODEL = "flexkv-tiny"  # TINY's served model name
TIMEOUT = 60  # no request of a test may take longer: a hang fails the test instead of holding the suite


def _base_url(target) -> str:
    return target if isinstance(target, str) else target.base_url


def send(target, path: str, raw: bytes, content_type: str | None = "application/json", *, timeout: float = TIMEOUT):
    """(status, body text) of one POST of ``raw`` to a graph (a base URL, or a plan, Serve or
    launcher's plan: anything with ``base_url``); HTTP errors are returned, not raised."""
    headers = {"content-type": content_type} if content_type else {}
    req = urllib.request.Request(_base_url(target) + path, raw, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post(target, body: dict, path: str = "/v1/completions", *, timeout: float = TIMEOUT) -> tuple[int, Any]:
    """(status, parsed JSON body, or its text when it is not JSON) of one POST of
    ``{"model": MODEL, **body}``; HTTP errors are returned, not raised."""
    status, text = send(target, path, json.dumps({"model": MODEL, **body}).encode(), timeout=timeout)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def flexkv_metrics(port: int) -> dict:
    """A worker's flexkv_* samples, as ``name{label="v",...} -> value`` with only the tier, state
    and link labels (sorted); a missing key is a KeyError, never a 0."""
    out = {}
    for m in re.finditer(r"^(flexkv_[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$", scrape(port), re.M):
        ours = sorted(kv for kv in (m.group(2) or "").split(",") if kv.split("=")[0] in ("tier", "state", "link"))
        out[m.group(1) + (f"{{{','.join(ours)}}}" if ours else "")] = float(m.group(3))
    return out


def complete(plan, prompt, max_tokens=4) -> dict:
    return http_json(
        f"{plan.base_url}/v1/completions",
        {"model": plan.served_model_name, "prompt": prompt, "max_tokens": max_tokens},
    )


def metric(port: int, name: str, **labels) -> float:
    found = [v for have, v in samples(scrape(port), name) if all(have.get(k) == str(w) for k, w in labels.items())]
    assert found, f"{name}{labels} not on /metrics"
    return found[0]


def published_events(worker_metrics: list[str]) -> float:
    """KV events the workers published (each worker's counter, from its current life)."""
    return sum(sum(sums_by(scrape(u), "flexkv_kv_events_published_total").values()) for u in worker_metrics)


def applied_events(frontend_metrics: str) -> float:
    """KV events the frontend's router applied (to its index, or refused with a status)."""
    return sum(sums_by(scrape(frontend_metrics), "dynamo_component_kv_cache_events_applied").values())


def events_applied(frontend_metrics: str, worker_metrics: list[str], timeout: float = 60) -> dict:
    """Waits until the frontend's router applied as many KV events as the workers published
    (every one arrived), then returns the applied events by (event_type, status): a status other
    than "ok" is an event the router could not apply (a parent or block it did not know)."""
    deadline = time.monotonic() + timeout
    while True:
        want = published_events(worker_metrics)
        applied = sums_by(scrape(frontend_metrics), "dynamo_component_kv_cache_events_applied", "event_type", "status")
        if sum(applied.values()) >= want:
            return {k: v for k, v in applied.items() if v}
        assert time.monotonic() < deadline, f"the router applied {sum(applied.values())} of {want} KV events"
        time.sleep(0.05)


def assert_gone(launcher: Launcher) -> None:
    for p in launcher.running.values():  # nothing of any process group is left
        assert members(p.pid) == []  # no live process (zombies wait for init)
    for proc in launcher.plan.processes + launcher.plan.infra:
        with socket.socket() as s:  # nobody listens on its port any more (TIME_WAIT is fine)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", proc.port))
            s.listen()


STREAM_TOKENS = 300  # long enough that a kill lands mid-stream on this slow machine


@dataclass
class Streamed:
    status: int = 0
    chunks: int = 0
    error: dict | None = None  # the SSE error event, if the stream ended with one
    usage: dict | None = None
    done: bool = False  # saw data: [DONE]
    seconds: float = 0.0


def stream(
    base_url: str, model: str, prompt, max_tokens: int = STREAM_TOKENS, out: Streamed | None = None, **extra
) -> Streamed:
    """One streamed completion, read to its end. ``out`` is filled as chunks arrive (another
    thread may watch it); ``extra`` goes into the request body."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    out, t0 = out if out is not None else Streamed(), time.monotonic()
    try:
        r = urllib.request.urlopen(req, timeout=60)  # a hang fails the test here
    except urllib.error.HTTPError as e:  # refused before the stream began (e.g. its worker was dead)
        body = json.loads(e.read() or b"{}")
        out.status, out.error, out.seconds = e.code, body.get("error", body), time.monotonic() - t0
        return out
    with r:
        out.status = r.status
        for doc in sse_data(r):
            if doc is DONE:
                out.done = True
                continue
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
    """Requests in flight on a worker (Dynamo's gauge, every endpoint)."""
    return total(scrape(port), "dynamo_component_inflight_requests")


def routed_workers(base_url: str) -> int:
    """How many workers the frontend's router has registered (its own gauge on /metrics)."""
    return len(re.findall(r"^dynamo_component_router_worker_registered\{[^}]*\} 1$", scrape(base_url), re.M))


def holder_of(plan, prompt: str):
    """Sends ``prompt`` once and returns the worker that served it (its request counter moved)."""
    before = {w.name: metric(w.port, "flexkv_requests_total") for w in plan.workers}
    complete(plan, prompt, 2)
    served = [w for w in plan.workers if metric(w.port, "flexkv_requests_total") > before[w.name]]
    assert len(served) == 1
    return served[0]


def assert_all_gone(pids: list[int], ports: list[int]) -> None:
    for pid in pids:  # every process group ever started, restarted workers' earlier lives included
        assert members(pid) == []  # no live process (zombies wait for init)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


class Serve:
    """``dynamo-flexkv serve`` as a user runs it, its output collected line by line."""

    def __init__(
        self,
        tmp_path,
        name: str,
        *overrides: str,
        graph: str = "agg_router",
        base: list[str] | None = None,
        ready_timeout: float = 120,
        command: list[str] | None = None,
        config: str | None = None,
        console: str = "all",
        own_run_dir: bool = False,
        env: dict | None = None,
        args: list[str] | None = None,
    ) -> None:
        """``graph``: graphs/<graph>.py with configs/<config or graph>.yaml; ``base``: the --set values
        before ``overrides`` (default: the tiny FlexKV workers, their SSD directories under the run
        dir); ``command``: what runs ``serve ...`` (default the CLI); ``console``: serve --console
        (all: tests read the components' lines); ``own_run_dir``: no --run-dir (serve makes and
        removes its own temp one; ``run`` is then read from its ready lines); ``env``: serve's
        environment (default this process's); ``args``: more serve arguments (e.g. --nodes FILE)."""
        self.run = run = tmp_path / name
        sets = [
            *(base if base is not None else [*TINY, f"FlexKVWorker.cache.ssd_cache_dir={run}/ssd{{replica}}"]),
            *overrides,
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                *(command or [sys.executable, "-m", "dynamo_flexkv.cli"]),
                "serve",
                str(ROOT / "graphs" / f"{graph}.py"),
                "-f",
                str(ROOT / "configs" / f"{config or graph}.yaml"),
                *([] if own_run_dir else ["--run-dir", str(run)]),
                "--console",
                console,
                *[a for s in sets for a in ("--set", s)],
                *(args or []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self.wait_for(rf"graph {graph} ready: (http://\S+)/v1", ready_timeout)
        except BaseException:
            self.close()  # never ready: its components must not outlive the failed test
            raise
        self.ready_s = time.monotonic() - self.started
        self.base_url = ready.group(1)
        if own_run_dir:
            self.run = Path(self.wait_for(r"^  run directory: (\S+) ", 5).group(1))
        self.metrics = {
            m.group(1): m.group(2) for m in (re.match(r"\s+(\S+) metrics: (http://\S+)", x) for x in self.lines) if m
        }
        self.children = [
            int(x)
            for x in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        ]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> re.Match:
        """The first line matching ``pattern`` from line ``since`` on (``len(lines)`` before an
        action: a restart's lines, not an earlier restart's)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines)[since:]:
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None or self._reader.is_alive(), (
                f"serve exited with {self.proc.returncode}:\n" + "\n".join(self.lines[-40:])
            )
            assert time.monotonic() < deadline, f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:])
            time.sleep(0.1)

    def worker_port(self, name: str) -> int:
        return int(self.metrics[name].rsplit(":", 1)[1].split("/")[0])

    def worker_pid(self, name: str) -> int:
        """The pid of ``name``'s current life (serve's children are read again: a restarted worker
        is a new child; every one started is kept in ``children``)."""
        port = self.worker_port(name)
        now = [
            int(x)
            for x in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        self.children += [p for p in now if p not in self.children]
        for pid in now:
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if f"DYN_SYSTEM_PORT={port}".encode() in env:
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


def agg_router_plan(tmp_path, *overrides, graph=AGG_ROUTER, **kw):
    """The shipped agg_router config (reference workers, full size) with an SSD under tmp_path."""
    config = apply_overrides(
        load_config(CONFIG),
        ["Frontend.http-port=0", f"FlexKVWorker.cache.ssd_cache_dir={tmp_path}/ssd{{replica}}", *overrides],
    )
    return build_plan(load_graph(graph), config, run_dir=tmp_path / "run", source="agg_router.yaml", **kw)


def sleeper_plan(tmp_path, policy: RestartPolicy) -> LaunchPlan:
    """A frontend and a worker that are real processes (sleep) under the launcher's supervision."""
    p = agg_router_plan(tmp_path, "FlexKVWorker.replicas=1", "Common.model=tiny")
    front, worker = p.processes
    for proc in (front, worker):
        proc.argv = ["sleep", "60"]
    worker.restart = policy
    return p


def vplan(tmp_path, *overrides, graph="agg_router_vllm", **kw):
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        ["Frontend.http-port=0", f"VllmWorker.cache.ssd_cache_dir={tmp_path}/ssd{{replica}}", *overrides],
    )
    return build_plan(
        load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run", source=f"{graph}.yaml", **kw
    )
