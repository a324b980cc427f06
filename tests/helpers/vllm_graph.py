"""Helpers for tests that drive a served vLLM graph (graphs/agg_router_vllm.py) over HTTP: greedy
completions with their token ids and serving worker, the workers' /metrics, the frontend's own
routing log, a second KV router attached to the graph (vllm_router_probe.py), and what a run left
behind. ``ours_left`` and ``group`` are the same checks as in test_serve_vllm.py."""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exactness import Generation
from served import Serve, scrape  # noqa: F401 (vg.scrape, vg.metric: the shared /metrics helpers)
from served import total as metric
from sse import DONE, sse_data

MODEL = "vllm-small"
VOCAB = (100, 31000)  # token ids drawn from here: the small preset's vocabulary is 32000
# Dynamo's and our words for KV events that were lost or could not be applied.
EVENT_TROUBLE = re.compile(r"Failed to find block|dropping the newest batch|lane is full")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(*VOCAB) for _ in range(n)]


class VllmServe(Serve):
    """served.Serve (``dynamo-flexkv serve`` as a user runs it, output collected) through
    vllm_serve.py, whose readiness deadline is ``ready_timeout`` instead of the CLI's 300 s."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        *overrides: str,
        graph: str,
        base: list[str],
        ready_timeout: float = 900,
        config: str | None = None,
        prefix: list[str] | None = None,
        **kw: Any,
    ) -> None:
        """``prefix``: what runs serve's interpreter (e.g. ``ip netns exec NS``: serve on a node);
        ``kw``: served.Serve's other options (console, own_run_dir, env, args)."""
        super().__init__(
            tmp_path,
            name,
            *overrides,
            graph=graph,
            base=base,
            ready_timeout=ready_timeout + 30,
            command=[
                *(prefix or []),
                sys.executable,
                str(Path(__file__).with_name("vllm_serve.py")),
                str(ready_timeout),
            ],
            config=config,
            **kw,
        )


# ---- requests ----------------------------------------------------------------------------------


def complete(
    base_url: str, prompt: list[int], max_tokens: int = 8, timeout: float = 120, model: str = MODEL, worker: int = 0
) -> dict:
    """One greedy completion of a token-id prompt (``worker``: a Dynamo instance id the router
    books it on, nvext.backend_instance_id). Returns ids (the generated token ids), gen (ids and
    their logprobs: exactness.Generation), worker (the frontend's decode worker id), cached (usage
    cached_tokens), rid (the router's request id)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
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
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        doc = json.loads(r.read())
    nvext = doc.get("nvext") or {}
    usage = doc.get("usage") or {}
    ids = list(nvext.get("completion_token_ids") or [])
    return {
        "ids": ids,
        "gen": Generation.of_completion(doc, ids),
        "worker": int((nvext.get("worker_id") or {}).get("decode_worker_id") or 0),
        "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "rid": str(doc.get("id", "")).removeprefix("cmpl-"),
        "seconds": time.monotonic() - t0,
    }


@dataclass
class Stream:
    """A streamed completion read on a thread; its fields fill in as chunks arrive."""

    status: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)  # decode worker of each chunk, in order
    rid: str = ""  # the router's request id (the chunks' id without "cmpl-")
    error: dict | None = None  # an SSE error event or an HTTP error body
    cached: int = 0
    done: bool = False  # saw data: [DONE]
    finished: bool = False  # the thread is over
    exception: str | None = None
    seconds: float = 0.0

    @property
    def gen(self) -> Generation:
        return Generation(self.ids, self.logprobs)


def stream(
    base_url: str, prompt: list[int], max_tokens: int, out: Stream, timeout: float = 120, model: str = MODEL
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
        "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        try:
            r = urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            out.status = e.code
            raw = e.read() or b"{}"
            try:
                out.error = json.loads(raw)
            except ValueError:
                out.error = {"body": raw[:300].decode(errors="replace")}
            return
        with r:
            out.status = r.status
            for chunk in sse_data(r):
                if chunk is DONE:
                    out.done = True
                    continue
                out.rid = out.rid or str(chunk.get("id", "")).removeprefix("cmpl-")
                if "error" in chunk:
                    out.error = chunk["error"]
                    continue
                nvext = chunk.get("nvext") or {}
                wid = (nvext.get("worker_id") or {}).get("decode_worker_id")
                if wid is not None:
                    out.workers.append(int(wid))
                out.ids += list(nvext.get("completion_token_ids") or [])
                out.logprobs += Generation.of_completion(chunk, []).logprobs
                usage = chunk.get("usage") or {}
                if usage:
                    out.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except Exception as e:  # noqa: BLE001 - the test reads it
        out.exception = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
        out.finished = True


def stream_in_thread(base_url: str, prompt: list[int], max_tokens: int) -> tuple[Stream, threading.Thread]:
    out = Stream()
    t = threading.Thread(target=stream, args=(base_url, prompt, max_tokens, out), daemon=True)
    t.start()
    return out, t


def send_and_hang_up(base_url: str, prompt: list[int], max_tokens: int, until, timeout: float = 60) -> float:
    """Sends a streamed completion on a raw connection and closes it as soon as ``until()`` is true
    (e.g. the worker has the request in flight). Returns the seconds from sending to the hang-up."""
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    body = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        t0 = time.monotonic()
        while not until():
            assert time.monotonic() < t0 + timeout, "the request never reached a worker"
            time.sleep(0.002)
        return time.monotonic() - t0
    finally:
        conn.close()  # the client hangs up: the frontend sees the connection drop


# ---- metrics -----------------------------------------------------------------------------------


def loaded(text: str) -> dict[str, float]:
    """FlexKVConnector's loaded tokens by tier (vllm:flexkv_prompt_tokens_cached_total{tier})."""
    return {t: metric(text, "vllm:flexkv_prompt_tokens_cached_total", tier=t) for t in ("host", "disk")}


def worker_id(text: str) -> int:
    """The Dynamo instance id of the worker whose /metrics this is (its worker_id label, hex)."""
    m = re.search(r'dynamo_endpoint="generate"[^}]*worker_id="([0-9a-f]+)"', text)
    assert m, "no worker_id label on the worker's generate metrics"
    return int(m.group(1), 16)


def healthy(metrics_url: str) -> bool:
    try:
        with urllib.request.urlopen(metrics_url.rsplit("/", 1)[0] + "/health", timeout=5) as r:
            return r.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


# ---- the frontend's routing log ----------------------------------------------------------------


def routing_log(log: Path) -> dict[str, dict]:
    """The frontend's KV router decisions by request id: the worker it selected and the host/disk
    blocks it counted for that worker ("Selected worker" lines), and the overlap (device) blocks of
    the routed request ("route request completed")."""
    out: dict[str, dict] = {}
    for line in ANSI.sub("", log.read_text(errors="replace")).splitlines():
        m = re.search(
            r'Selected worker .*request_id="([^"]+)" worker_id=(\d+) .*host_pinned_blocks=(\d+) '
            r"disk_blocks=(\d+)",
            line,
        )
        if m:
            out.setdefault(m.group(1), {}).update(worker=int(m.group(2)), host=int(m.group(3)), disk=int(m.group(4)))
            continue
        m = re.search(r"route request completed .*request_id=([0-9a-f-]{36}) .*overlap_blocks=(\d+)", line)
        if m:
            out.setdefault(m.group(1), {})["device"] = int(m.group(2))
    return out


def attempts(log: Path, rid: str) -> list[dict]:
    """The frontend's routing attempts of request ``rid`` (a migrated request has several): the
    worker, the attempt number and how it ended. (nvext.worker_id keeps naming the first worker.)"""
    out = []
    for line in ANSI.sub("", log.read_text(errors="replace")).splitlines():
        m = re.search(
            rf"route request (completed|failed) .*request_id={re.escape(rid)} .*worker_id=(\d+) "
            r"request\.attempt=(\d+)",
            line,
        )
        if m:
            out.append({"outcome": m.group(1), "worker": int(m.group(2)), "attempt": int(m.group(3))})
    return out


def event_trouble(*dirs: Path) -> list[str]:
    """Lines of any log under ``dirs`` that say KV events were dropped or could not be applied."""
    bad = []
    for d in dirs:
        for path in sorted(Path(d).rglob("*.log")):
            for line in ANSI.sub("", path.read_text(errors="replace")).splitlines():
                if EVENT_TROUBLE.search(line):
                    bad.append(f"{path.name}: {line[:300]}")
    return bad


# ---- a second router on the served graph -------------------------------------------------------


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


class RouterProbe:
    """Dynamo's KvRouter in its own process (vllm_router_probe.py), attached to the graph whose
    frontend runs as ``frontend_pid``: same discovery directory and event plane. It learns only
    from the KV events published after it started (start it before the requests it is asked about)."""

    def __init__(
        self,
        frontend_pid: int,
        log_path: Path,
        endpoint: str = "dynamo.backend.generate",
        block_size: int = 64,
        timeout: float = 60,
    ) -> None:
        fe = environ(frontend_pid)
        env = dict(os.environ, DYN_LOG="warn")
        for k in (
            "DYN_FILE_KV",
            "DYN_ZMQ_BROKER_URL",
            "DYN_TCP_RPC_HOST",
            "DYN_EVENT_PLANE_HOST",
            "DYN_SYSTEM_HOST",
            "DYN_TCP_RESPONSE_STREAM_HOST",
        ):
            if k in fe:
                env[k] = fe[k]
        assert "DYN_FILE_KV" in env and "DYN_ZMQ_BROKER_URL" in env, "the frontend has no file discovery / broker"
        self.log_path = log_path
        self._log = open(log_path, "w")
        script = Path(__file__).with_name("vllm_router_probe.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), endpoint, str(block_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=str(script.parent),
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._next(timeout).get("ready"), "the router probe did not start"

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, (
                    f"the router probe did not answer (exit {self.proc.poll()}); see {self.log_path}"
                )
                self._cond.wait(min(left, 0.5))
            return json.loads(self._lines.pop(0))

    def scores(
        self, prompt: list[int], timeout: float = 30, lora_name: str | None = None
    ) -> dict[int, tuple[int, int, int]]:
        """worker id -> (device, host_pinned, disk) blocks of ``prompt``'s prefix the router counts
        (each tier's count covers the faster tiers: disk >= host >= device), for the base model or
        the LoRA adapter ``lora_name`` (the router hashes blocks with the adapter's name)."""
        self.proc.stdin.write(json.dumps({"tokens": prompt, "lora_name": lora_name}) + "\n")
        self.proc.stdin.flush()
        out = self._next(timeout)
        assert "error" not in out, out
        return {r["worker_id"]: (r["device"], r["host"], r["disk"]) for r in out["workers"]}

    def rank_scores(self, prompt: list[int], timeout: float = 30) -> dict[tuple[int, int], tuple[int, int, int]]:
        """As ``scores``, per (worker id, data-parallel rank)."""
        self.proc.stdin.write(json.dumps({"tokens": prompt}) + "\n")
        self.proc.stdin.flush()
        out = self._next(timeout)
        assert "error" not in out, out
        return {(r["worker_id"], r["dp_rank"]): (r["device"], r["host"], r["disk"]) for r in out["workers"]}

    def call(self, endpoint: str, body: dict, timeout: float = 120) -> list[Any]:
        """Each reply of one request-plane call of ``endpoint`` (NAMESPACE.COMPONENT.ENDPOINT), e.g.
        dynamo.vllm's ``dynamo.backend.load_lora``: the calls a user's operator makes."""
        self.proc.stdin.write(json.dumps({"call": endpoint, "body": body}) + "\n")
        self.proc.stdin.flush()
        out = self._next(timeout)
        assert "error" not in out, out
        return list(out["replies"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"quit": true}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of process ``pid`` so far, in clock ticks (1/100 s)."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class Busy:
    """True once process ``pid`` (vLLM's Worker: it runs the forward, and the connector's layerwise
    load inside it) burned ``ticks`` more CPU than its idle rate since this object was made."""

    def __init__(self, pid: int, ticks: int = 3, idle_s: float = 0.5, settle_s: float = 15.0) -> None:
        self.pid, self.ticks = pid, ticks
        # vLLM's Worker spins for a second after each step: wait until it stopped, or the idle rate
        # measured here is that spin, and a short step on a fast machine ends before it shows.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            t0 = cpu_ticks(pid)
            time.sleep(0.2)
            if cpu_ticks(pid) - t0 <= 2:
                break
        t0 = cpu_ticks(pid)
        time.sleep(idle_s)
        self.idle_rate = (cpu_ticks(pid) - t0) / idle_s
        self.start, self.t0 = cpu_ticks(pid), time.monotonic()
        self.burned = 0

    def __call__(self) -> bool:
        self.burned = cpu_ticks(self.pid) - self.start
        return self.burned - self.idle_rate * (time.monotonic() - self.t0) >= self.ticks


# ---- what is left ------------------------------------------------------------------------------


def ours_left(run: Path) -> list:
    """Processes whose environment points into ``run`` (vLLM's children too)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if str(run).encode() in env:
            left.append(int(pid))
    return left


def group(pgid: int) -> list:
    """The live (not zombie) processes of process group ``pgid``: (pid, name)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if rest[0] != "Z" and int(rest[2]) == pgid:
            out.append((int(pid), name))
    return out


def crash(pgid: int) -> None:
    """SIGKILLs every process of a served worker's group (serve starts each as a group leader) but
    Python's resource trackers: an engine crash as a user meets it. A tracker unlinks the shared
    memory its processes registered once they are gone; killed with them, it leaks vLLM's message
    queues in /dev/shm (hundreds of MiB per kill)."""
    for pid, _ in group(pgid):
        try:
            if b"multiprocessing.resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone already


def listening(port: int) -> bool:
    """Whether anything listens on 127.0.0.1:``port`` (/proc/net/tcp, state 0A)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return True
    return False
