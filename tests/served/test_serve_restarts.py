"""Restarts, signals and hung components of a served graph, through
its public interface only: ``dynamo-flexkv serve graphs/agg_router.py`` with ``--set`` overrides
(Dynamo's frontend with the KV router and migration, our workers) on 127.0.0.1, HTTP to the
frontend, signals to serve and to its components, the workers' /metrics and RUN_DIR/logs.

Claims tried (README "Shutdown, restart and migration policy", worker "Shutdown policy"): a worker
killed inside its restart's start-up window, and again right after it is ready, spends its
restart budget one death at a time and then serve stops the graph loudly with exit 1; a client
hanging up as its request migrates; two SIGINTs within 0.2 s, SIGINT while a restart waits in
backoff, SIGTERM while a worker drains; a SIGSTOPped (hung) worker under load and Ctrl-C after it;
the frontend's death; a worker SIGKILLed during heavy SSD writes with its disk tier full re-adopts
its blocks and answers the same greedy prompts with the same text. After each: no process of the
graph (every life of every component), no port, no Python traceback in any log.

Each test starts its own graph (about 10-30 s on this machine), so all are ``slow``."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dynamo_flexkv.core.procgroup import members

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import MODEL, Serve, Streamed, inflight, post, routed_workers, scrape, stream, total, wait_until

WORKERS = ("FlexKVWorker-0", "FlexKVWorker-1")
TRACEBACK = "Traceback (most recent call last)"
NUL = bytes(1)


class Graph(Serve):
    """``Serve`` plus what a test needs to prove nothing is left: every pid and port it ever saw."""

    def __init__(self, tmp_path, name: str, *overrides: str) -> None:
        super().__init__(tmp_path, name, *overrides)
        self.run_dir = tmp_path / name
        self.pids: set[int] = set(self.children)
        self.ports: set[int] = {int(self.base_url.rsplit(":", 1)[1])} | {
            self.worker_port(w) for w in self.metrics if w != "Frontend"
        }
        for pid in self.children:  # the event broker's two ports, say
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            self.ports |= {int(p) for p in re.findall(r"tcp://127\.0\.0\.1:(\d+)", cmd)}

    def pid_of(self, name: str) -> int:
        """The live process of a component now (a restarted worker's too), remembered for the end."""
        for pid in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split():
            try:
                if name == "Frontend":
                    hit = b"dynamo.frontend" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                else:
                    hit = f"DYN_SYSTEM_PORT={self.worker_port(name)}".encode() in open(
                        f"/proc/{pid}/environ", "rb"
                    ).read().split(b"\0")
            except OSError:
                continue
            if hit:
                self.pids.add(int(pid))
                return int(pid)
        raise AssertionError(f"no live child of serve runs {name}")

    def restarted_pid(self, name: str, n: int, timeout: float = 60) -> int:
        m = self.wait_for(rf"{name} restarted \(restart {n}, pid (\d+)\)", timeout)
        self.pids.add(int(m.group(1)))
        return int(m.group(1))

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted((self.run_dir / "logs").glob("*.log")))

    def output(self) -> str:
        return "\n".join(self.lines)

    def leftovers(self) -> list[str]:
        """Processes whose command line or environment names this graph's run directory."""
        found, mark = [], str(self.run_dir).encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                blob = (d / "cmdline").read_bytes() + b"\0" + (d / "environ").read_bytes()
            except OSError:
                continue
            if mark in blob:
                cmd = (d / "cmdline").read_bytes().replace(NUL, b" ")[:160]
                found.append(f"{d.name}: {cmd!r}")
        return found

    def assert_clean(self, tracebacks_ok: bool = False) -> None:
        """Nothing of the graph is left: no process group, no process naming its run dir, no port,
        and (unless a process was killed in a way that may print one) no traceback anywhere."""
        alive = [pid for pid in self.pids if members(pid)]  # live ones (zombies wait for init)
        assert not alive, f"process groups left: {alive}"
        assert not self.leftovers(), self.leftovers()
        busy = []
        for port in self.ports:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                    s.listen()
                except OSError:
                    busy.append(port)
        assert not busy, f"ports still in use: {busy}"
        if not tracebacks_ok:
            assert TRACEBACK not in self.logs() and TRACEBACK not in self.output(), (
                self.logs()[self.logs().find(TRACEBACK) - 200 :][:3000] if TRACEBACK in self.logs() else self.output()
            )

    def close(self) -> None:
        super().close()
        # after a failure: whatever a broken shutdown left is stopped too (these are ours)
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def exit_code(graph: Graph, timeout: float) -> int:
    try:
        return graph.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve still running {timeout} s later:\n" + "\n".join(graph.lines[-40:])) from None


def streams(graph: Graph, n: int, max_tokens: int = 300, tag: str = "s") -> list:
    pool = ThreadPoolExecutor(n)
    outs = [Streamed() for _ in range(n)]
    futs = [
        pool.submit(stream, graph.base_url, MODEL, f"{tag} {i}: " + "x y z " * 30, max_tokens, out=outs[i])
        for i in range(n)
    ]
    pool.shutdown(wait=False)
    return futs


# --- restart budget under deaths inside and right after the start-up window ------------------------


@pytest.mark.slow
def test_deaths_during_and_right_after_a_restarts_startup_each_spend_one_restart_then_exit_1(tmp_path):
    """max-restarts=3: death 1 (ready worker), death 2 inside restart 1's start-up window (right
    after its process began), death 3 right after restart 2 is ready, death 4 inside restart 3's
    start-up window: serve counts each death once, doubles the backoff, and stops the graph with
    exit 1 naming the worker and 4 deaths; nothing is left."""
    g = Graph(tmp_path, "budget", "FlexKVWorker.restart-backoff-s=0.3")
    victim = "FlexKVWorker-1"
    try:
        os.kill(g.pid_of(victim), signal.SIGKILL)
        g.wait_for(
            rf"{victim} exited with signal SIGKILL \(death 1 within 300 s, budget 3\).*restarting it in 0.3 s", 10
        )
        pid = g.restarted_pid(victim, 1)
        os.kill(pid, signal.SIGKILL)  # inside its start-up window: not ready yet
        g.wait_for(
            rf"{victim} exited with signal SIGKILL \(death 2 within 300 s, budget 3\).*restarting it in 0.6 s", 10
        )
        assert not any(re.search(rf"{victim} is ready again", x) for x in g.lines), g.lines[-10:]
        pid = g.restarted_pid(victim, 2)
        g.wait_for(rf"{victim} is ready again", 60)
        os.kill(pid, signal.SIGKILL)  # right after it became ready
        g.wait_for(
            rf"{victim} exited with signal SIGKILL \(death 3 within 300 s, budget 3\).*restarting it in 1.2 s", 10
        )
        # The graph still serves on the other worker meanwhile.
        status, body = post(g, {"prompt": "still here", "max_tokens": 2})
        assert status == 200, body
        pid = g.restarted_pid(victim, 3)
        os.kill(pid, signal.SIGKILL)
        assert exit_code(g, 60) == 1, g.output()[-3000:]
        out = g.output()
        assert re.search(
            rf"error: {victim} exited with signal SIGKILL: it died 4 times within 300 s, more than "
            r"its restart budget \(max-restarts=3\)",
            out,
        ), out[-3000:]
        assert f"{victim} restarted (restart 4" not in out
        g.assert_clean()
    finally:
        g.close()


# --- a client hanging up as its request migrates ---------------------------------------------------


@pytest.mark.slow
def test_client_hanging_up_as_its_request_migrates_leaves_no_work_behind(tmp_path):
    """8 long streams; the worker holding some is SIGKILLed and the clients close their connections
    within ~100 ms, as the frontend migrates their requests. The surviving worker must end up with
    no request in flight and no device block in use (the migrated requests were aborted), serve
    keeps serving, restarts the victim, and Ctrl-C leaves nothing."""
    g = Graph(tmp_path, "hangup", "FlexKVWorker.restart-backoff-s=0.3", "FlexKVWorker.device-prefix-cache=false")
    victim, other = WORKERS[1], WORKERS[0]
    socks = []
    try:
        port = int(g.base_url.rsplit(":", 1)[1])
        for i in range(8):
            raw = json.dumps(
                {
                    "model": MODEL,
                    "prompt": f"hang {i}: " + "a b c " * 30,
                    "max_tokens": 400,
                    "stream": True,
                    "ignore_eos": True,
                }
            ).encode()
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n\r\n".encode()
                + raw
            )
            socks.append(s)
        wait_until(
            "streams on both workers",
            lambda: inflight(g.worker_port(victim)) > 0 and inflight(g.worker_port(other)) > 0,
            every=0.05,
            timeout=30,
        )
        os.kill(g.pid_of(victim), signal.SIGKILL)
        time.sleep(0.08)
        for s in socks:
            s.close()
        socks.clear()

        def idle():
            m = scrape(g.worker_port(other))
            return (
                total(m, "dynamo_component_inflight_requests") == 0
                and total(m, "flexkv_device_blocks", state="used") == 0
                and total(m, "flexkv_tasks_in_flight") == 0
            )

        wait_until("the surviving worker idle", idle, timeout=20, every=0.2)
        g.restarted_pid(victim, 1)
        g.wait_for(rf"{victim} is ready again", 60)
        status, body = post(g, {"prompt": "after the hang-ups", "max_tokens": 4})
        assert status == 200, body
        g.proc.send_signal(signal.SIGINT)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        g.assert_clean()
    finally:
        for s in socks:
            s.close()
        g.close()


# --- signals to serve -----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_sigints_within_0_2_s_during_a_restart_backoff_stop_everything_exit_0(tmp_path):
    """A worker dies and waits out a 30 s backoff; streams run on the other one; serve gets SIGINT
    twice within 0.2 s: it stops everything with exit 0, the restart never happens, no traceback."""
    g = Graph(tmp_path, "dblint", "FlexKVWorker.restart-backoff-s=30", "Frontend.migration-limit=0")
    try:
        os.kill(g.pid_of(WORKERS[1]), signal.SIGKILL)
        g.wait_for(rf"{WORKERS[1]} exited with signal SIGKILL .*restarting it in 30.0 s", 10)
        futs = streams(g, 4, 300, "dbl")
        wait_until("streams in flight", lambda: inflight(g.worker_port(WORKERS[0])) > 0, every=0.05)
        t0 = time.monotonic()
        g.proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
        g.proc.send_signal(signal.SIGINT)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        took = time.monotonic() - t0
        for f in futs:
            f.result(timeout=60)  # every client got an answer or a closed connection, no hang
        assert f"{WORKERS[1]} restarted" not in g.output()
        g.assert_clean()
        print(f"double SIGINT: serve exited in {took:.1f} s")
    finally:
        g.close()


@pytest.mark.slow
def test_ctrl_c_inside_a_restarts_startup_window_and_a_death_during_shutdown_restart_nothing(tmp_path):
    """A worker is killed; the moment its restart's process exists (not ready yet) serve gets SIGINT;
    while serve is stopping, the other worker is SIGKILLed. Exit 0, no further restart, the
    half-started worker's process group gone too, nothing left."""
    g = Graph(tmp_path, "startint", "FlexKVWorker.restart-backoff-s=0.3")
    try:
        g.pid_of(WORKERS[0])
        os.kill(g.pid_of(WORKERS[1]), signal.SIGKILL)
        g.restarted_pid(WORKERS[1], 1)
        g.proc.send_signal(signal.SIGINT)
        g.wait_for("stopping", 10)
        try:
            os.kill(next(p for p in g.pids if p != g.proc.pid and _is_worker0(g, p)), signal.SIGKILL)
        except (ProcessLookupError, StopIteration):
            pass
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        assert not any(re.search(r"restarted \(restart 1, pid \d+\)", x) for x in g.lines if WORKERS[0] in x), (
            g.output()[-2000:]
        )
        assert sum(f"{WORKERS[1]} restarted" in x for x in g.lines) == 1
        g.assert_clean(tracebacks_ok=True)  # worker 0 is SIGKILLed while it drains
    finally:
        g.close()


@pytest.mark.slow
def test_ctrl_c_inside_a_restarts_startup_window_leaves_no_traceback(tmp_path):
    g = Graph(tmp_path, "startint2", "FlexKVWorker.restart-backoff-s=0.3")
    try:
        os.kill(g.pid_of(WORKERS[1]), signal.SIGKILL)
        g.restarted_pid(WORKERS[1], 1)
        g.proc.send_signal(signal.SIGINT)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        g.assert_clean(tracebacks_ok=True)
        assert TRACEBACK not in g.logs(), g.logs()[g.logs().find(TRACEBACK) - 100 :][:1500]
    finally:
        g.close()


def _is_worker0(g: Graph, pid: int) -> bool:
    try:
        return f"DYN_SYSTEM_PORT={g.worker_port(WORKERS[0])}".encode() in open(
            f"/proc/{pid}/environ", "rb"
        ).read().split(NUL)
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.ci_slow  # CI's reference-engine served path: the cheapest slow one (about 16 s)
def test_sigterm_to_serve_during_a_workers_drain_grace_stops_everything_exit_0(tmp_path):
    """SIGTERM one worker (it withdraws and waits its 5 s grace before draining), and once the
    router no longer lists it (inside that grace) SIGTERM serve: exit 0, no restart, no traceback,
    nothing left; the streams end."""
    g = Graph(tmp_path, "drain", "FlexKVWorker.restart-backoff-s=0.3")
    try:
        futs = streams(g, 6, 300, "drain")
        wait_until(
            "streams on both workers",
            lambda: inflight(g.worker_port(WORKERS[0])) > 0 and inflight(g.worker_port(WORKERS[1])) > 0,
            every=0.05,
            timeout=30,
        )
        os.kill(g.pid_of(WORKERS[1]), signal.SIGTERM)
        wait_until("the SIGTERMed worker withdrawn", lambda: routed_workers(g.base_url) == 1, timeout=4, every=0.05)
        g.proc.send_signal(signal.SIGTERM)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        for f in futs:
            f.result(timeout=60)
        assert f"{WORKERS[1]} restarted" not in g.output()
        g.assert_clean()
    finally:
        g.close()


@pytest.mark.slow
def test_a_worker_that_drains_by_itself_is_restarted_or_reported(tmp_path):
    """A worker SIGTERMed on its own (not serve) drains and exits 0. Serve must not silently run on
    with one worker fewer: it restarts it (on-death: restart) or says why it does not."""
    g = Graph(tmp_path, "selfdrain", "FlexKVWorker.restart-backoff-s=0.3")
    try:
        os.kill(g.pid_of(WORKERS[1]), signal.SIGTERM)
        m = g.wait_for(rf"{WORKERS[1]} (exited|restarted|stopped).*", 40)
        print("serve said:", m.group(0))
        g.proc.send_signal(signal.SIGINT)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        g.assert_clean()
    finally:
        g.close()


# --- a hung (SIGSTOPped) worker -------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_with_a_sigstopped_worker_stops_everything_within_the_kill_deadline(tmp_path):
    """A worker SIGSTOPped while it streams: its clients stall (it is hung, not dead) until its
    liveness-timeout-s (30 s by default; tests/unit/test_liveness.py covers the kill and restart). Ctrl-C
    before that must still stop the graph: serve SIGKILLs the hung worker 30 s after its SIGINT,
    exits 0, leaves no process, no port, no traceback."""
    g = Graph(tmp_path, "stopped", "FlexKVWorker.restart-backoff-s=0.3")
    hung = None
    try:
        futs = streams(g, 6, 400, "hung")
        wait_until(
            "streams on both workers",
            lambda: inflight(g.worker_port(WORKERS[0])) > 0 and inflight(g.worker_port(WORKERS[1])) > 0,
            every=0.05,
            timeout=30,
        )
        hung = g.pid_of(WORKERS[1])
        os.kill(hung, signal.SIGSTOP)
        wait_until("the worker stopped", lambda: _state(hung) == "T", every=0.01, timeout=10)
        # New requests while it is stopped: the router still lists it, so a request routed there
        # stalls until the client gives up (10 s); one routed to the other worker is answered.
        with ThreadPoolExecutor(4) as pool:
            fresh = list(pool.map(lambda i: _try(g, f"while hung {i}: " + "q r " * 20), range(4)))
        print(f"while a worker is SIGSTOPped: {fresh.count(200)}/4 new requests answered within 10 s")
        assert set(fresh) <= {200, None}, fresh
        assert routed_workers(g.base_url) == 2
        # serve treats a stopped process neither as dead nor, before liveness-timeout-s (30 s), as hung
        assert _state(hung) == "T"
        assert not any(f"{WORKERS[1]} exited" in x for x in g.lines), g.lines[-5:]
        t0 = time.monotonic()
        g.proc.send_signal(signal.SIGINT)
        rc = exit_code(g, 75)
        took = time.monotonic() - t0
        assert rc == 0, g.output()[-3000:]
        assert took < 45, took
        for f in futs:
            f.result(timeout=60)
        g.assert_clean(tracebacks_ok=False)
        print(f"Ctrl-C with a stopped worker: serve exited in {took:.1f} s")
    finally:
        if hung:
            try:
                os.kill(hung, signal.SIGCONT)
            except ProcessLookupError:
                pass
        g.close()


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _try(g: Graph, prompt: str):
    try:
        return post(g, {"prompt": prompt, "max_tokens": 4}, timeout=10)[0]
    except OSError:  # timed out: routed to the hung worker
        return None


# --- the frontend's death -------------------------------------------------------------------------


@pytest.mark.slow
def test_the_frontends_death_stops_the_graph_with_exit_1_and_leaves_nothing(tmp_path):
    g = Graph(tmp_path, "front", "FlexKVWorker.restart-backoff-s=0.3")
    try:
        futs = streams(g, 4, 300, "front")
        wait_until(
            "streams in flight",
            lambda: inflight(g.worker_port(WORKERS[0])) + inflight(g.worker_port(WORKERS[1])) > 0,
            every=0.05,
        )
        os.kill(g.pid_of("Frontend"), signal.SIGKILL)
        assert exit_code(g, 60) == 1, g.output()[-3000:]
        assert re.search(r"Frontend exited with signal SIGKILL", g.output()), g.output()[-2000:]
        for f in futs:  # the clients' connections end (the frontend is gone): no hang
            f.exception(timeout=60)
        g.assert_clean()
    finally:
        g.close()


# --- SSD tier full, worker SIGKILLed during heavy offload writes ----------------------------------


def _greedy_texts(g: Graph, prompts) -> list[str]:
    texts = []
    for p in prompts:
        status, body = post(g, {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    return texts


@pytest.mark.slow
def test_worker_killed_during_heavy_ssd_writes_readopts_and_answers_the_same_text(tmp_path):
    """One worker, no device prefix cache, a small disk tier (0.005 GB) filled past capacity by
    distinct prompts, SIGKILLed while offload writes are in flight. The restarted worker re-adopts
    its disk tier (disk blocks in use > 0 before any request) and answers the same greedy prompts
    with the same text as before the kill."""
    g = Graph(
        tmp_path,
        "ssdfull",
        "FlexKVWorker.replicas=1",
        "FlexKVWorker.device-prefix-cache=false",
        "FlexKVWorker.restart-backoff-s=0.3",
        "FlexKVWorker.cache.ssd_cache_gb=0.005",
        "FlexKVWorker.cache.cpu_cache_gb=0.005",
    )
    w = "FlexKVWorker"  # a single replica has no number
    try:
        probes = [f"probe {k}: " + "the quick brown fox jumps " * (10 + 3 * k) for k in range(4)]
        before = _greedy_texts(g, probes)
        m = scrape(g.worker_port(w))
        cap = total(m, "flexkv_pool_blocks", tier="disk", state="capacity")
        assert cap > 0, m
        # Fill the disk tier past capacity, then kill while a burst of distinct prompts is offloading.
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: post(g, {"prompt": f"fill {i}: " + f"w{i} " * 200, "max_tokens": 1}), range(40)))
        m = scrape(g.worker_port(w))
        assert (
            total(m, "flexkv_evicted_blocks_total", tier="disk") > 0
            or total(m, "flexkv_pool_blocks", tier="disk", state="used") >= cap * 0.9
        ), m
        before_probe = _greedy_texts(g, probes)  # the probes again (re-offloaded): the text is stable
        assert before_probe == before
        pool = ThreadPoolExecutor(6)
        base = total(scrape(g.worker_port(w)), "flexkv_link_ops_total", link="h2disk")
        burst = [
            pool.submit(post, g, {"prompt": f"burst {i}: " + f"b{i} " * 200, "max_tokens": 1}, timeout=30)
            for i in range(48)
        ]

        def writing():  # an offload task in flight, or disk writes under way with the burst still running
            m = scrape(g.worker_port(w))
            return total(m, "flexkv_tasks_in_flight") > 0 or (
                total(m, "flexkv_link_ops_total", link="h2disk") > base and sum(not f.done() for f in burst) > 2
            )

        wait_until("offload writes in flight", writing, every=0.02, timeout=30)
        os.kill(g.pid_of(w), signal.SIGKILL)
        pool.shutdown(wait=True)
        g.restarted_pid(w, 1)
        g.wait_for(rf"{w} is ready again", 60)
        m = scrape(g.worker_port(w))
        readopted = total(m, "flexkv_pool_blocks", tier="disk", state="used")
        assert 0 < readopted <= cap, m
        log = (g.run_dir / "logs" / f"{w}.log").read_text(errors="replace")
        adopted = [int(x) for x in re.findall(r"disk tier: adopted (\d+) blocks, dropped \d+ torn", log)]
        assert len(adopted) == 2 and adopted[-1] == readopted, adopted  # first life: 0; restart: what /metrics says
        assert f"announced {adopted[-1]} re-adopted disk blocks to the router" in log
        # Same text whether or not the router applied those events yet (the disk hits printed below
        # count only what it had).
        after = _greedy_texts(g, probes)
        assert after == before, (before, after)
        m = scrape(g.worker_port(w))
        assert total(m, "flexkv_failed_ops_total") == 0, m
        print(
            f"disk capacity {cap:.0f} blocks, re-adopted {readopted:.0f}; disk hits after restart "
            f"{total(m, 'flexkv_prompt_tokens_cached_total', tier='disk'):.0f} tokens"
        )
        g.proc.send_signal(signal.SIGINT)
        assert exit_code(g, 60) == 0, g.output()[-3000:]
        g.assert_clean()
    finally:
        g.close()
