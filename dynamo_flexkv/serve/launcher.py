"""Runs a LaunchPlan on this machine: infrastructure first (etcd, NATS when asked for), then the
frontend and the workers, each in its own process group with its log streamed under its name;
waits until every worker reports ready and the OpenAI endpoint lists the model; stops everything
on Ctrl-C, SIGTERM, or when any component dies, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Dict, List, Optional

from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.plan import LOOPBACK, LaunchPlan, Process


class Interrupted(RuntimeError):
    pass


class ComponentDied(RuntimeError):
    def __init__(self, proc: Process, code: int, tail: str) -> None:
        super().__init__(f"{proc.name} exited with code {code} before the graph was ready; its last log lines:\n{tail}")
        self.proc, self.code = proc, code


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Launcher:
    def __init__(self, plan: LaunchPlan, echo: Optional[IO[str]] = None) -> None:
        self.plan = plan
        self.echo = echo  # where component logs are streamed (None: only to run_dir/logs)
        self.log_dir = plan.run_dir / "logs"
        self.running: Dict[str, subprocess.Popen] = {}
        self._order: List[Process] = []
        self._readers: List[threading.Thread] = []
        self._echo_lock = threading.Lock()
        self._width = max(len(p.name) for p in plan.infra + plan.processes)
        self.interrupted = threading.Event()  # set by a signal handler: stop waiting for readiness

    # ---- start -------------------------------------------------------------------------------
    def start(self) -> None:
        from dynamo_flexkv.dynamo.model_dir import write_model_dir
        from dynamo_flexkv.engine import EngineModelConfig

        self.log_dir.mkdir(parents=True, exist_ok=True)
        write_model_dir(EngineModelConfig.load(self.plan.model), self.plan.run_dir / "model")
        try:
            for proc in self.plan.infra:
                self._spawn(proc)
                self._wait_port(proc, timeout=30)
            for proc in self.plan.processes:
                for path, text in proc.files.items():
                    Path(path).write_text(text)
                self._spawn(proc)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, proc: Process) -> None:
        log_file = open(self.log_dir / f"{proc.name}.log", "w")
        p = subprocess.Popen(proc.argv, env={**os.environ, **proc.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             cwd=str(self.plan.run_dir))
        self.running[proc.name] = p
        self._order.append(proc)
        t = threading.Thread(target=self._pump, args=(proc.name, p.stdout, log_file), daemon=True)
        t.start()
        self._readers.append(t)

    def _pump(self, name: str, stream: IO[bytes], log_file: IO[str]) -> None:
        with log_file:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                log_file.write(line + "\n")
                log_file.flush()
                if self.echo is not None:
                    with self._echo_lock:
                        self.echo.write(f"{name:>{self._width}} | {line}\n")
                        self.echo.flush()
        stream.close()

    # ---- readiness ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 180) -> None:
        """Every worker's /health says ready, then the frontend lists the model."""
        deadline = time.monotonic() + timeout
        pending = [p for p in self.plan.processes if p.kind is Kind.WORKER]
        while pending:
            self.check_alive()
            pending = [p for p in pending if not self._worker_ready(p)]
            self._tick(deadline, f"workers {[p.name for p in pending]} not ready")
        models_url = f"{self.plan.base_url}/v1/models"
        while True:
            self.check_alive()
            try:
                if any(m.get("id") == self.plan.served_model_name
                       for m in http_json("GET", models_url, timeout=2).get("data", [])):
                    break
            except (OSError, ValueError):
                pass
            self._tick(deadline, f"{models_url} does not list {self.plan.served_model_name}")
        # The router learns of workers through discovery, a moment after the model card appears.
        time.sleep(0.5 + 0.5 * len(self.plan.workers))

    def _worker_ready(self, proc: Process) -> bool:
        try:
            return http_json("GET", f"http://{LOOPBACK}:{proc.port}/health", timeout=2).get("status") == "ready"
        except (OSError, ValueError):
            return False

    def _tick(self, deadline: float, waiting_for: str) -> None:
        if self.interrupted.is_set():
            raise Interrupted("interrupted before the graph was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"graph {self.plan.graph.name} not ready: {waiting_for}; logs in {self.log_dir}")
        time.sleep(0.25)

    def _wait_port(self, proc: Process, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                socket.create_connection((LOOPBACK, proc.port), timeout=1).close()
                return
            except OSError:
                self._tick(deadline, f"{proc.name} not listening on {proc.port}")

    # ---- liveness and shutdown ---------------------------------------------------------------
    def dead(self) -> Optional[tuple]:
        for proc in self._order:
            code = self.running[proc.name].poll()
            if code is not None:
                return proc, code
        return None

    def check_alive(self) -> None:
        d = self.dead()
        if d is not None:
            proc, code = d
            raise ComponentDied(proc, code, self.tail(proc.name))

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def shutdown(self, timeout: float = 30) -> None:
        """SIGINT to the frontend first (no new requests), then workers, then infrastructure; what
        has not exited after ``timeout`` gets SIGKILL. Every process group is reaped."""
        order = [p for p in self._order if p.kind is Kind.FRONTEND] + \
                [p for p in self._order if p.kind is Kind.WORKER] + [p for p in self._order if p.kind is None]
        for group in ([p for p in order if p.kind is not None], [p for p in order if p.kind is None]):
            for proc in group:
                _signal_group(self.running[proc.name], signal.SIGINT)
            deadline = time.monotonic() + timeout
            for proc in group:
                p = self.running[proc.name]
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(p, signal.SIGKILL)  # stragglers of the group, or the process itself
                p.wait()
        for t in self._readers:
            t.join(timeout=5)

    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def serve(plan: LaunchPlan, echo: IO[str], ready_timeout: float = 300) -> int:
    """``dynamo-flexkv serve``: runs until Ctrl-C / SIGTERM (exit 0) or a component dies (exit 1)."""
    launcher = Launcher(plan, echo)
    stop = launcher.interrupted
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        launcher.start()
        launcher.wait_ready(ready_timeout)
        echo.write(f"graph {plan.graph.name} ready: {plan.base_url}/v1 serves {plan.served_model_name} "
                   f"({len(plan.workers)} worker(s)); Ctrl-C stops it\n")
        echo.flush()
        while not stop.wait(0.5):
            d = launcher.dead()
            if d is not None:
                echo.write(f"{d[0].name} exited with code {d[1]}: stopping the graph\n")
                code = 1
                break
    except (ComponentDied, TimeoutError, GraphError) as e:
        echo.write(f"error: {e}\n")
        code = 1
    except Interrupted:
        pass
    finally:
        echo.write("stopping...\n")
        echo.flush()
        launcher.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
    return code
