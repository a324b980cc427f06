"""Runs a LaunchPlan on this machine: infrastructure first (etcd, NATS when asked for), then the
frontend and the workers, each in its own process group with its log streamed under its name;
waits until every worker reports ready and the OpenAI endpoint lists the model; then supervises:
a worker that dies is restarted under its RestartPolicy (same replica, ports and SSD directory),
a ready worker whose /health fails for its liveness-timeout-s is SIGKILLed as hung and handled as
dead, the death of anything else, a worker over its restart budget, Ctrl-C or SIGTERM stop everything,
leaving no process behind."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.http_client import http_json
from dynamo_flexkv.core.procgroup import kill_group, signal_group, stop_group, wait_group
from dynamo_flexkv.core.sysutil import UnsafeDirectory, private_dir
from dynamo_flexkv.serve.discovery import Discovery, owned_by, registered, worker_ids
from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.logs import Console, ConsoleFilter, plain
from dynamo_flexkv.serve.options import OnDeath
from dynamo_flexkv.serve.plan import LaunchPlan
from dynamo_flexkv.serve.process import Process

STOP_TIMEOUT_S = 30.0  # what a component has to stop on serve's signal before SIGKILL (docs/SERVING.md)
PROBE_EVERY_S = 5.0  # a ready worker's /health is asked at most this often
PROBE_TIMEOUT_S = 2.0
# Until a starting worker has registered in discovery its /health is not asked: Dynamo's system
# server logs every 503 it answers as an ERROR line. Past this long without a registration serve
# asks anyway, once a second (a worker kind that registers no model card still becomes ready).
UNREGISTERED_PROBE_AFTER_S = 600.0
MODEL_GONE_TIMEOUT_S = 5.0  # at a stop: how long the frontend may take to drop the stopped workers' model


class _Liveness:
    """One life of a ready worker: its /health probed on a short thread (a stopped process answers
    nothing and its probe runs into the timeout; supervision never waits for it). step() reads the
    results: a ready answer resets the clock, anything else (no answer, a refused connection, a
    non-ready status) keeps it running from the first failed probe's start."""

    def __init__(self, now: float) -> None:
        self.due = now + PROBE_EVERY_S
        self.failing_since: float | None = None
        self.thread: threading.Thread | None = None
        self.sent = 0.0
        self.ok: bool | None = None  # the running probe's answer, once it has one


class Interrupted(RuntimeError, FlexKVError):
    pass


class ComponentDied(RuntimeError, FlexKVError):
    def __init__(self, proc: Process, code: int, tail: str) -> None:
        super().__init__(
            f"{proc.name} exited with {exit_status(code)} before the graph was ready; its last log lines:\n{tail}"
        )
        self.proc, self.code = proc, code


class GraphStopped(RuntimeError, FlexKVError):
    """A component died and its policy (or spent restart budget) says the graph stops."""


def exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _unignore_sigint() -> None:
    """A shell runs a background job (`make demo &`) with SIGINT ignored, and children inherit an
    ignored signal across exec; shutdown() stops every component with SIGINT, so each would sit out
    the 30 s grace and be SIGKILLed. A handled signal is reset to default on exec: handle it here."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def write_private(path: str, text: str) -> None:
    """Writes ``path`` readable by this user only (0600) from its first byte: a new file made with
    O_EXCL (mkstemp) in its directory, renamed over ``path``. Opening ``path`` itself would keep the
    mode of a file already there (a run directory used before) and follow a link planted in its place."""
    directory = private_dir(os.path.dirname(os.path.abspath(path)), f"the directory of {path}")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_files(proc: Process) -> None:
    """The files a process reads at start (redis.conf, a worker's cache YAML), each 0600: none
    may show another user a secret, even one a later change puts there."""
    for path, text in proc.files.items():
        write_private(path, text)


def run_dirs(plan: LaunchPlan) -> None:
    """The directories serve makes for a run, owner-only (0700, docs/SERVING.md): the run directory
    (the node cache's socket, the discovery store, configs), logs/, each process's own (a vLLM
    worker's HOME). A run directory given that exists is used if it is yours and nobody else can
    write to it (others may list it; nothing in it is theirs to read); the ones inside it that
    serve names are made 0700. Anything else: GraphError naming the directory and the fix."""
    try:
        private_dir(str(plan.run_dir), "the run directory (--run-dir)")
        private_dir(str(plan.run_dir / "logs"), "the run's log directory", tighten=True)
        for proc in plan.processes:
            for d in proc.dirs:
                private_dir(d, f"{proc.name}'s directory", tighten=True)
    except UnsafeDirectory as e:
        raise GraphError(str(e)) from None
    except OSError as e:  # a path that cannot be made (a file in the way, no permission)
        raise GraphError(f"cannot make {e.filename}: {e.strerror or e}: choose another --run-dir") from None


class Launcher:
    def __init__(
        self,
        plan: LaunchPlan,
        echo: IO[str] | None = None,
        probe: Callable[[Process, float], bool] | None = None,
        console: Console = Console.ALL,
    ) -> None:
        self.plan = plan
        self.echo = echo  # where component logs are streamed (None: only to run_dir/logs)
        self.console = console  # which component lines echo shows (the log files get every line)
        # probe(process, timeout_s): whether it answers ready (default: a worker's /health says so)
        self.probe: Callable[[Process, float], bool] = probe or self._worker_ready
        self.log_dir = plan.run_dir / "logs"
        self.running: dict[str, subprocess.Popen] = {}
        self._order: list[Process] = []
        self._readers: list[threading.Thread] = []
        self._echo_lock = threading.Lock()
        self._width = max(len(p.name) for p in plan.infra + plan.processes)
        self.interrupted = threading.Event()  # set by a signal handler: stop waiting for readiness
        self.stopping = threading.Event()  # set when shutdown() begins (logs.py STOP_RACES)
        self.spawned: list[subprocess.Popen] = []  # every process ever started, restarts included
        self.deaths: dict[str, list[float]] = {}  # name -> monotonic times of its deaths in its window
        self.restarts: dict[str, int] = {}  # name -> how often it was restarted
        self.pending: dict[str, float] = {}  # name -> when its restart is due (monotonic)
        self.starting: dict[str, float] = {}  # restarted, /health not ready yet -> when it was spawned
        self.ready: set[str] = set()  # workers whose current life reported ready
        self.liveness: dict[str, _Liveness] = {}  # ready workers' /health probes (liveness-timeout-s)
        self.events: list[str] = []  # what supervise() said, also written to echo
        self._buried: set[subprocess.Popen] = set()  # dead, group killed, reaped: never signal again
        # The components' temp folder (TMPDIR): what they leave there (vLLM's IPC sockets, torch's
        # caches) goes when serve stops. Made at start, in serve's own temp folder, with a short
        # name: Unix socket paths in it (vLLM's, the connector's lookup socket when the run
        # directory is too deep for one) must stay within 107 bytes.
        self.tmp_dir: str | None = None
        self._unregistered_since: dict[str, float] = {}  # starting worker -> when serve began waiting for it

    # ---- start -------------------------------------------------------------------------------
    def start(self) -> None:
        from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset

        run_dirs(self.plan)
        _unignore_sigint()
        self.tmp_dir = tempfile.mkdtemp(prefix="flexkv-tmp-")
        if self.plan.write_model:
            write_preset(self.plan.model, self.plan.run_dir / "model", weights=self.plan.model_weights)
        try:
            for proc in self.plan.infra:
                write_files(proc)  # e.g. redis.conf, which holds a password
                self._spawn(proc)
                self._wait_port(proc, timeout=30)
            for proc in self.plan.processes:
                write_files(proc)
                self._spawn(proc)
                if proc.kind is Kind.CACHE:  # its workers attach at once (they would retry without it)
                    self._wait_port(proc, timeout=60)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, proc: Process) -> None:
        restart = proc.name in self.running
        # a restart keeps the old log; _pump closes it when the process's output ends
        log_file = open(self.log_dir / f"{proc.name}.log", "a" if restart else "w")  # noqa: SIM115
        if restart:
            log_file.write(f"---- restart {self.restarts[proc.name]} of {proc.name} ----\n")
            log_file.flush()
        p = subprocess.Popen(
            proc.argv,
            env={**os.environ, **proc.env, **({"TMPDIR": self.tmp_dir} if self.tmp_dir else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(self.plan.run_dir),
        )
        self.running[proc.name] = p
        self.spawned.append(p)
        if not restart:
            self._order.append(proc)
        t = threading.Thread(target=self._pump, args=(proc.name, p.stdout, log_file), daemon=True)
        t.start()
        self._readers.append(t)

    def _pump(self, name: str, stream: IO[bytes], log_file: IO[str]) -> None:
        shown = ConsoleFilter(self.console, self.stopping)
        with log_file:
            for raw in iter(stream.readline, b""):
                line = plain(raw.decode(errors="replace").rstrip("\n"))
                log_file.write(line + "\n")
                log_file.flush()
                if shown.show(line):
                    self.emit(f"{name:>{self._width}} | {line}\n")
        stream.close()

    # ---- readiness ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 180) -> None:
        """Every worker's /health says ready, then the frontend lists the model."""
        started = time.monotonic()
        deadline = started + timeout
        pending = [p for p in self.plan.processes if p.kind is Kind.WORKER]
        due: dict[str, float] = {}
        while pending:
            self.check_alive()
            now = time.monotonic()
            # Each refused probe is an ERROR line in the worker's log (Dynamo's system server logs its
            # 503s): after the first seconds (our worker is ready by then), ask once a second, so a
            # slow start (vLLM: a minute or more on CPUs) does not bury its own log lines.
            ask = [p for p in pending if now >= due.get(p.name, 0.0)]
            pending = [p for p in pending if p not in ask or not self._mark_ready(p)]
            for p in ask:
                due[p.name] = now + (0.25 if now - started < 10 else 1.0)
            self._tick(deadline, f"workers {[p.name for p in pending]} not ready")
        models_url = f"{self.plan.base_url}/v1/models"
        while True:
            self.check_alive()
            try:
                if any(
                    m.get("id") == self.plan.served_model_name for m in http_json(models_url, timeout=2).get("data", [])
                ):
                    break
            except (OSError, ValueError, http.client.HTTPException):
                pass
            self._tick(deadline, f"{models_url} does not list {self.plan.served_model_name}")
        # The router learns of workers through discovery, a moment after the model card appears.
        time.sleep(0.5 + 0.5 * len(self.plan.workers))

    def _mark_ready(self, proc: Process) -> bool:
        if self.probe(proc, 2):
            self.ready.add(proc.name)
            return True
        return False

    def _worker_ready(self, proc: Process, timeout: float = 2) -> bool:
        if proc.kind is Kind.CACHE:  # the node cache: its metrics port answers once it serves
            try:
                socket.create_connection((proc.host, proc.port), timeout=timeout).close()
                return True
            except OSError:
                return False
        if not self._registered(proc):
            return False
        try:
            return http_json(f"http://{proc.host}:{proc.port}/health", timeout=timeout).get("status") == "ready"
        except (OSError, ValueError, http.client.HTTPException):  # not up yet, or cut off mid-answer
            return False

    def _registered(self, proc: Process) -> bool:
        """Whether a worker's /health may be asked: it registered in discovery (its model card and
        endpoint), or serve cannot read discovery, or it has waited UNREGISTERED_PROBE_AFTER_S.
        A starting worker answers 503 until then, and Dynamo logs each 503 as an ERROR line."""
        entries = Discovery(proc.env).entries()
        if entries is None or registered(entries, proc.host, int(proc.port or 0)):
            self._unregistered_since.pop(proc.name, None)
            return True
        since = self._unregistered_since.setdefault(proc.name, time.monotonic())
        return time.monotonic() - since > UNREGISTERED_PROBE_AFTER_S

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
                socket.create_connection((proc.host, proc.port), timeout=1).close()
                return
            except OSError:
                self._tick(deadline, f"{proc.name} not listening on {proc.port}")

    # ---- liveness and shutdown ---------------------------------------------------------------
    def dead(self) -> tuple | None:
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

    # ---- supervision: restart policy ----------------------------------------------------------
    def supervise(self, stop: threading.Event, poll_s: float = 0.25) -> int:
        """After wait_ready: until ``stop`` is set (0), or a death the policy does not forgive (1)."""
        while not stop.wait(poll_s):
            try:
                self.step()
            except GraphStopped as e:
                self._say(f"error: {e}")
                return 1
        return 0

    def step(self) -> None:
        """One supervision pass: restarts that are due, restarted workers that became ready, deaths."""
        now = time.monotonic()
        for proc in self._order:
            name = proc.name
            if name in self.pending:
                if now >= self.pending[name]:
                    del self.pending[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._spawn(proc)
                    self.starting[name] = now
                    self._say(f"{name} restarted (restart {self.restarts[name]}, pid {self.running[name].pid})")
                continue
            code = self.running[name].poll()
            if code is not None:
                self._died(proc, code, now)
            elif name in self.starting:
                if self._mark_ready(proc):
                    took = now - self.starting.pop(name)
                    self._say(f"{name} is ready again after {took:.1f} s; metrics at {proc.metrics_url}")
            elif name in self.ready and proc.restart.liveness_s > 0:
                self._check_liveness(proc, now)

    def _check_liveness(self, proc: Process, now: float) -> None:
        """A ready worker whose /health probes failed for liveness-timeout-s is hung (SIGSTOPped,
        deadlocked): SIGKILL its group and let _died apply its on-death policy, as for any death."""
        name = proc.name
        live = self.liveness.get(name)
        if live is None:
            live = self.liveness[name] = _Liveness(now)
        if live.thread is not None and not live.thread.is_alive():
            live.thread = None
            if live.ok:
                live.failing_since = None
            else:
                if live.failing_since is None:
                    live.failing_since = live.sent
                silent = now - live.failing_since
                if silent >= proc.restart.liveness_s:
                    p = self.running[name]
                    self._say(f"{name} did not answer /health for {silent:.0f} s: killing it (SIGKILL) as hung")
                    kill_group(p)
                    self._died(proc, p.wait(), now)
                    return
        if live.thread is None and now >= live.due:
            live.sent, live.due, live.ok = now, now + PROBE_EVERY_S, None

            def probe(live: _Liveness = live) -> None:
                live.ok = self.probe(proc, PROBE_TIMEOUT_S)

            live.thread = threading.Thread(target=probe, name=f"health {name}", daemon=True)
            live.thread.start()

    def _died(self, proc: Process, code: int, now: float) -> None:
        name, policy = proc.name, proc.restart
        p = self.running[name]
        stop_group(p)  # what its process group left behind (a port, the SSD lock, shared memory)
        self._buried.add(p)
        self.starting.pop(name, None)
        self.ready.discard(name)
        self.liveness.pop(name, None)  # a probe of this life still running answers into nothing
        deaths = [t for t in self.deaths.get(name, []) if now - t < policy.window_s] + [now]
        self.deaths[name] = deaths
        gone = self._deregister(proc) if proc.kind is Kind.WORKER else 0
        what = f"{name} exited with {exit_status(code)}"
        if policy.on_death is OnDeath.STOP:
            raise GraphStopped(
                f"{what}; its on-death policy is stop: stopping the graph. "
                f"Its last log lines ({self.log_dir / (name + '.log')}):\n{self.tail(name)}"
            )
        if len(deaths) > policy.max_restarts:
            raise GraphStopped(
                f"{what}: it died {len(deaths)} times within {policy.window_s:g} s, more than "
                f"its restart budget (max-restarts={policy.max_restarts}); stopping the graph. "
                f"Its last log lines ({self.log_dir / (name + '.log')}):\n{self.tail(name)}"
            )
        delay = policy.delay(len(deaths))
        self.pending[name] = now + delay
        self._say(
            f"{what} (death {len(deaths)} within {policy.window_s:g} s, budget {policy.max_restarts})"
            + (f"; removed its {gone} discovery entries" if gone else "")
            + f"; restarting it in {delay:.1f} s with the same ports and SSD directory"
        )

    def _deregister(self, proc: Process) -> int:
        """File discovery: deletes a dead worker's registrations (its instances, model card and event
        sources), so the router drops it now rather than when they expire (Dynamo's 10 s TTL, which
        also applies to etcd leases). Its model card names its system port, which identifies it."""
        store = Discovery(proc.env)
        if not store.root:
            return 0
        entries = store.entries() or []
        ids = worker_ids(entries, proc.host, int(proc.port or 0))
        # The model card last: once the frontend dropped the model (what a stop waits for), it has
        # been sent every other deletion.
        owned = sorted(owned_by(entries, ids), key=lambda e: e.doc.get("type") == "Model")
        return sum(store.delete(e) for e in owned)

    def _say(self, line: str) -> None:
        self.events.append(line)
        self.emit(line + "\n")

    def emit(self, text: str) -> None:
        """Writes to echo. A closed terminal or pipe only ends the echo: the logs keep flowing to
        their files (a pump that stopped reading would block its component) and shutdown still runs."""
        with self._echo_lock:
            if self.echo is None:
                return
            try:
                self.echo.write(text)
                self.echo.flush()
            except (OSError, ValueError):
                self.echo = None

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """The workers first: each stops taking requests and drains what it accepted while the
        frontend, still up, relays it. Then the frontend, once it has dropped the workers' model
        (stopped while it still watched them, Dynamo's frontend logs an ERROR "channel closed"
        at every stop; dropping the model, at about half of them), then the node cache (its
        workers detached cleanly), then infrastructure.
        Each group gets SIGINT and ``timeout`` to exit, then SIGKILL; every process group is
        reaped. A worker that has not reported ready (a restart still starting) has accepted
        nothing and its SSD journal survives any stop: it is stopped at once (_stop_starting).
        The frontend may still log one of Dynamo's benign ERROR races as it drops the model or
        stops (serve/logs.py STOP_RACES): from here on the quiet console shows them as INFO."""
        self.stopping.set()
        for live in list(self.liveness.values()):  # a stopping worker answers /health 503: an ERROR line
            if live.thread is not None:
                live.thread.join(PROBE_TIMEOUT_S + 1)
        workers = [p for p in self._order if p.kind is Kind.WORKER]
        self._stop(workers, timeout)
        for proc in workers:  # file discovery keeps a stopped worker's model card until its TTL
            self._deregister(proc)
        frontends = [p for p in self._order if p.kind is Kind.FRONTEND]
        if workers and frontends and self.running[frontends[0].name].poll() is None:
            self._wait_model_gone()
        self._stop(frontends, timeout)
        self._stop([p for p in self._order if p.kind is Kind.CACHE], timeout)
        self._stop([p for p in self._order if p.kind is None], timeout)
        self.pending.clear()  # a restart that was due never happens
        for t in self._readers:
            t.join(timeout=5)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def _stop(self, group: list[Process], timeout: float) -> None:
        # A worker whose death _died handled (restart pending) was group-killed and reaped then:
        # its pid may belong to someone else by now.
        group = [proc for proc in group if self.running[proc.name] not in self._buried]
        for proc in group:
            p = self.running[proc.name]
            if proc.kind is Kind.WORKER and proc.name not in self.ready and not self.probe(proc, 1):
                _stop_starting(p, proc.stop_group)
            elif proc.stop_group:
                signal_group(p, signal.SIGINT)
            else:  # it stops its children itself, in order, once it has drained
                try:
                    p.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in group:
            p = self.running[proc.name]
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Its children drain on their own signal (vLLM's EngineCore and Worker, which write
            # their last tier stores) and may outlive it by moments: within the same deadline.
            wait_group(p, deadline)
            kill_group(p)  # stragglers of the group, or the process itself
            p.wait()

    def _wait_model_gone(self) -> None:
        """Until the frontend no longer lists the model (it dropped the stopped workers), at most
        MODEL_GONE_TIMEOUT_S."""
        url = f"{self.plan.base_url}/v1/models"
        deadline = time.monotonic() + MODEL_GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                models = http_json(url, timeout=2).get("data", [])
            except (OSError, ValueError, http.client.HTTPException):
                return  # not answering: nothing left to wait for
            if not any(m.get("id") == self.plan.served_model_name for m in models):
                return
            time.sleep(0.1)

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stop_starting(p: subprocess.Popen, as_group: bool) -> None:
    """Stops a worker that has not reported ready. Before Dynamo's Worker owns the signals, SIGTERM
    ends a process quietly (a SIGINT would raise KeyboardInterrupt in an import and log a
    traceback); a worker stopped as a group (the reference worker) gets just that. A vLLM worker's
    main process owns them before it builds its engine, but vLLM's engine startup blocks the loop
    that would act on them for tens of seconds, and a signal to the engine's processes fails that
    startup with a traceback ("Engine core initialization failed ... Failed core proc(s): {}"). So
    its main process, which holds no request and nothing to drain, is SIGKILLed, and the rest of
    its group gets SIGTERM, as after a death (stop_group); the caller waits for the group."""
    if as_group:
        signal_group(p, signal.SIGTERM)
        return
    try:
        p.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
    signal_group(p, signal.SIGTERM)


def serve(
    plan: LaunchPlan,
    echo: IO[str],
    ready_timeout: float = 300,
    console: Console = Console.QUIET,
    remove_run_dir: bool = False,
) -> int:
    """``dynamo-flexkv serve``: runs until Ctrl-C / SIGTERM (exit 0), or until a component dies and
    its policy says stop, or a worker spends its restart budget (exit 1). ``remove_run_dir``: the
    run directory is serve's own (a temp one): removed once everything stopped, unless the graph
    failed (exit 1: its logs are what tells why)."""
    launcher = Launcher(plan, echo, console=console)
    stop = launcher.interrupted
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    for note in plan.notes:
        launcher.emit(f"note: {note}\n")
    names = [p.name for p in plan.infra + plan.processes]
    logs = f"{launcher.log_dir}/{names[0]}.log" if len(names) == 1 else f"{launcher.log_dir}/{{{','.join(names)}}}.log"
    try:
        launcher.emit(f"graph {plan.graph.name}: starting {', '.join(p.name for p in plan.processes)}; logs: {logs}\n")
        launcher.start()
        launcher.wait_ready(ready_timeout)
        kept = "removed when serve stops; --keep-run-dir keeps it" if remove_run_dir else "kept"
        launcher.emit(
            f"graph {plan.graph.name} ready: {plan.base_url}/v1 serves {plan.served_model_name} "
            f"({len(plan.workers)} worker(s)); Ctrl-C stops it\n"
            f"  run directory: {plan.run_dir} ({kept})\n"
            f"  logs: {logs}\n" + "".join(f"  {proc.name} metrics: {proc.metrics_url}\n" for proc in plan.processes)
        )
        code = launcher.supervise(stop)
    except (ComponentDied, TimeoutError, GraphError) as e:
        launcher.emit(f"error: {e}\n")
        code = 1
    except Interrupted:
        pass
    finally:
        launcher.emit("stopping...\n")
        launcher.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
    if remove_run_dir and code == 0:
        shutil.rmtree(plan.run_dir, ignore_errors=True)
    elif remove_run_dir:
        launcher.emit(f"the run directory stays for its logs: {plan.run_dir} (remove it when done)\n")
    return code
