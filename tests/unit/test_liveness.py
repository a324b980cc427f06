"""Liveness supervision: a ready worker whose /health probes fail for liveness-timeout-s is hung
(SIGSTOPped, deadlocked): serve SIGKILLs it and its on-death policy applies (restart, migration of
its streams, discovery deregistration). Option checks and the launcher's clock run fast with sleep
processes and a stubbed /health; one served graph SIGSTOPs a worker under load (slow)."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from served import agg_router_plan, sleeper_plan

from dynamo_flexkv.core.procgroup import members
from dynamo_flexkv.serve import GraphError
from dynamo_flexkv.serve import launcher as launcher_mod
from dynamo_flexkv.serve.launcher import GraphStopped, Launcher
from dynamo_flexkv.serve.options import OnDeath, RestartPolicy

# --- the option -------------------------------------------------------------------------------------


def test_liveness_timeout_defaults_to_30_s_and_rides_on_the_restart_policy(tmp_path):
    p = agg_router_plan(tmp_path)
    assert {w.restart.liveness_s for w in p.workers} == {30.0}
    assert {w.restart.liveness_s for w in agg_router_plan(tmp_path, "FlexKVWorker.liveness-timeout-s=0").workers} == {
        0.0
    }
    assert agg_router_plan(tmp_path, "FlexKVWorker.liveness-timeout-s=5").workers[0].restart.liveness_s == 5.0
    assert agg_router_plan(tmp_path, "FlexKVWorker.liveness-timeout-s=3600").workers[0].restart.liveness_s == 3600.0
    # YAML 1.1 reads 1e3 as a string: a number to the user, as for the other seconds options
    assert agg_router_plan(tmp_path, "FlexKVWorker.liveness-timeout-s=1e3").workers[0].restart.liveness_s == 1000.0


@pytest.mark.parametrize(
    "value, message",
    [
        ("4", "FlexKVWorker.liveness-timeout-s=4.0 must be 0 (off) or between 5 and 3600 seconds"),
        ("-1", "FlexKVWorker.liveness-timeout-s=-1.0 must be 0 (off) or between 5 and 3600 seconds"),
        ("3601", "FlexKVWorker.liveness-timeout-s=3601.0 must be 0 (off) or between 5 and 3600 seconds"),
        (".nan", "FlexKVWorker.liveness-timeout-s=nan must be 0 (off) or between 5 and 3600 seconds"),
        (".inf", "FlexKVWorker.liveness-timeout-s=inf must be 0 (off)"),
        ("1e9", "FlexKVWorker.liveness-timeout-s=1000000000.0 must be"),
        ("soon", "FlexKVWorker.liveness-timeout-s='soon': expected a number"),
        ("true", "FlexKVWorker.liveness-timeout-s=True: expected a number"),
    ],
)
def test_bad_liveness_timeouts_are_refused_naming_the_option(tmp_path, value, message):
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace(")", r"\)")):
        agg_router_plan(tmp_path, f"FlexKVWorker.liveness-timeout-s={value}")


@pytest.mark.parametrize(
    "key, value", [("restart-window-s", ".nan"), ("restart-window-s", ".inf"), ("restart-backoff-s", ".nan")]
)
def test_the_other_seconds_options_now_refuse_nan_and_inf_too(tmp_path, key, value):
    with pytest.raises(GraphError, match=rf"FlexKVWorker\.{key}=(nan|inf) must be .*a finite number"):
        agg_router_plan(tmp_path, f"FlexKVWorker.{key}={value}")


# --- the launcher's clock (sleep processes, /health stubbed) ---------------------------------------


class _Health:
    """The launcher's probe (Launcher(probe=...)): answers what the test says, counts the probes."""

    def __init__(self, answer: bool = True) -> None:
        self.answer, self.calls = answer, 0

    def __call__(self, proc, timeout: float = 2) -> bool:
        self.calls += 1
        return self.answer


def _supervised(tmp_path, monkeypatch, policy: RestartPolicy, health: _Health):
    monkeypatch.setattr(launcher_mod, "PROBE_EVERY_S", 0.05)
    launcher = Launcher(sleeper_plan(tmp_path, policy), probe=health)
    launcher.start()
    worker = launcher.plan.workers[0]
    launcher.ready.add(worker.name)  # as wait_ready would
    return launcher, worker


def _steps(launcher: Launcher, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        launcher.step()
        time.sleep(0.01)


@pytest.mark.integration
def test_a_worker_answering_ready_is_left_alone_and_failures_shorter_than_the_timeout_are_forgiven(
    tmp_path, monkeypatch
):
    health = _Health(True)
    launcher, worker = _supervised(tmp_path, monkeypatch, RestartPolicy(liveness_s=1.5, backoff_s=0), health)
    try:
        pid = launcher.running[worker.name].pid
        _steps(launcher, 0.6)
        assert health.calls >= 3  # probed repeatedly, never more than one at a time
        for _ in range(3):  # failing 0.2 s, then one ready answer resets the clock
            health.answer = False
            _steps(launcher, 0.2)
            health.answer = True
            _steps(launcher, 0.15)
        assert launcher.running[worker.name].pid == pid and launcher.running[worker.name].poll() is None
        assert not any("hung" in e for e in launcher.events), launcher.events
    finally:
        launcher.shutdown()


@pytest.mark.integration
def test_a_worker_failing_its_probes_for_the_timeout_is_killed_as_hung_and_restarted(tmp_path, monkeypatch):
    health = _Health(False)  # a non-ready answer counts as failing, like no answer
    launcher, worker = _supervised(tmp_path, monkeypatch, RestartPolicy(liveness_s=0.3, backoff_s=0), health)
    try:
        first = launcher.running[worker.name]
        os.kill(first.pid, signal.SIGSTOP)  # hung for real: only SIGKILL ends it
        _steps(launcher, 0.3)
        deadline = time.monotonic() + 5
        while not any("as hung" in e for e in launcher.events):
            assert time.monotonic() < deadline, launcher.events
            launcher.step()
            time.sleep(0.01)
        hung = next(e for e in launcher.events if "as hung" in e)
        assert hung.startswith(f"{worker.name} did not answer /health for ") and hung.endswith(
            " s: killing it (SIGKILL) as hung"
        ), hung
        assert first.returncode == -signal.SIGKILL
        assert f"{worker.name} exited with signal SIGKILL (death 1 within 300 s" in launcher.events[-1]
        assert worker.name not in launcher.ready and worker.name not in launcher.liveness
        launcher.step()  # backoff 0: restarted now, starting (not ready: not probed for liveness)
        assert launcher.restarts[worker.name] == 1 and launcher.running[worker.name] is not first
        calls = health.calls
        _steps(launcher, 0.2)
        assert worker.name in launcher.starting  # the stub says not ready: it stays starting, never "hung"
        assert sum("as hung" in e for e in launcher.events) == 1
        assert health.calls > calls  # readiness checks of the starting life, not liveness probes
    finally:
        launcher.shutdown()
    assert members(first.pid) == []  # no live process (zombies wait for init)


@pytest.mark.integration
def test_a_hung_worker_with_on_death_stop_stops_the_graph_and_zero_turns_probing_off(tmp_path, monkeypatch):
    health = _Health(False)
    launcher, worker = _supervised(tmp_path, monkeypatch, RestartPolicy(OnDeath.STOP, liveness_s=0.2), health)
    try:
        with pytest.raises(
            GraphStopped, match=f"{worker.name} exited with signal SIGKILL; its on-death policy is stop"
        ):
            _steps(launcher, 5)
    finally:
        launcher.shutdown()
    health = _Health(False)
    launcher, worker = _supervised(tmp_path / "off", monkeypatch, RestartPolicy(liveness_s=0), health)
    try:
        _steps(launcher, 0.3)
        assert health.calls == 0 and launcher.running[worker.name].poll() is None
    finally:
        launcher.shutdown()


# --- a served graph: SIGSTOP a worker under load -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.served
def test_a_sigstopped_worker_is_killed_as_hung_its_streams_migrate_and_it_serves_again(tmp_path):
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    from served import Serve, Streamed, inflight, metric, routed_workers, stream, wait_until

    g = Serve(tmp_path, "liveness", "FlexKVWorker.liveness-timeout-s=5", "FlexKVWorker.restart-backoff-s=0.5")
    names = ("FlexKVWorker-0", "FlexKVWorker-1")
    stopped = None
    try:
        assert routed_workers(g) == 2
        outs = [Streamed() for _ in range(8)]
        pool = ThreadPoolExecutor(8)
        futs = [
            pool.submit(stream, g.base_url, "flexkv-tiny", f"hang {i}: " + "x y z " * 30, 400, out=outs[i])
            for i in range(8)
        ]
        wait_until(
            "streams on both workers",
            lambda: all(inflight(g.worker_port(n)) > 0 for n in names),
            every=0.05,
            timeout=30,
        )
        stopped = g.worker_pid(names[1])
        t0 = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        g.wait_for(rf"{names[1]} did not answer /health for \d+ s: killing it \(SIGKILL\) as hung", 30)
        took = time.monotonic() - t0
        g.wait_for(rf"{names[1]} exited with signal SIGKILL \(death 1 within", 5)
        results = [f.result(timeout=120) for f in futs]
        pool.shutdown()
        # migration-limit 3 (the shipped config): the hung worker's streams finish on the other one
        assert all(
            r.status == 200 and r.error is None and r.done and r.usage["completion_tokens"] == 400 for r in results
        ), results
        g.wait_for(rf"{names[1]} is ready again after", 90)
        wait_until("the router routes to both workers again", lambda: routed_workers(g) == 2, timeout=30)
        before = metric(g.worker_port(names[1]), "flexkv_requests_total")
        for i in range(8):  # some fresh requests reach the restarted worker
            r = stream(g.base_url, "flexkv-tiny", f"after {i}: " + "p q " * (10 + i), 4)
            assert r.status == 200 and r.done, r
        assert metric(g.worker_port(names[1]), "flexkv_requests_total") > before
        print(f"SIGSTOP -> killed as hung after {took:.1f} s")
    finally:
        if stopped:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        g.close()
    assert g.proc.returncode == 0, "\n".join(g.lines[-30:])
