"""A served graph survives a worker's death: the real frontend (KV router, request migration) and
our workers started by the launcher on 127.0.0.1, a worker SIGKILLed while requests stream.
Each test checks that nothing of any process group (restarted lives included) and no port is left."""

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import (
    Serve,
    applied_events,
    assert_all_gone,
    assert_gone,
    complete,
    holder_of,
    inflight,
    make_plan,
    metric,
    published_events,
    routed_workers,
    stream,
    wait_until,
)

from dynamo_flexkv.serve.launcher import Launcher


def test_a_killed_worker_is_restarted_its_requests_migrate_and_a_second_death_spends_its_budget(tmp_path):
    """Two workers, no device prefix cache (a prompt's KV lives only in the host/disk tiers of the
    worker that served it). Kill the holder of prompt P while 8 requests stream: the frontend
    migrates its in-flight requests to the other worker (all 8 complete), the launcher restarts it
    on the same ports and SSD directory, it re-adopts P from disk and announces it, and the router
    sends P to it again (a disk hit on the restarted worker). Killed again, it has spent its budget
    (max-restarts=1): the graph stops with exit 1, naming it, and leaves nothing behind."""
    plan = make_plan(
        tmp_path,
        "agg_router",
        "FlexKVWorker.device-prefix-cache=false",
        "FlexKVWorker.restart-backoff-s=0.5",
        "FlexKVWorker.max-restarts=1",
    )
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
            futures = [
                pool.submit(stream, plan.base_url, plan.served_model_name, f"stream {i}: " + "x y z " * 30)
                for i in range(8)
            ]
            wait_until("requests in flight on the victim", lambda: inflight(victim.port) > 0, every=0.05)
            first_pid = launcher.running[victim.name].pid
            os.kill(first_pid, signal.SIGKILL)
            results = [f.result() for f in futures]
        urls = {w.name: f"http://127.0.0.1:{w.port}/metrics" for w in (victim, other, front)}
        applied_before, other_before = applied_events(urls[front.name]), published_events([urls[other.name]])
        assert all(r.status == 200 and r.done and r.error is None for r in results), results
        assert all(r.usage and r.usage["completion_tokens"] >= 1 for r in results), results
        migrated = metric(front.port, "dynamo_frontend_model_migration_duration_seconds_count", outcome="success")
        assert migrated >= 1  # the victim's in-flight requests finished on the other worker

        wait_until(
            "the restarted worker ready",
            lambda: victim.name not in launcher.starting and launcher.restarts.get(victim.name) == 1,
            timeout=90,
        )
        wait_until("the router routing to it", lambda: routed_workers(plan.base_url) == 2)
        assert launcher.running[victim.name].pid != first_pid
        assert any(
            f"{victim.name} exited with signal SIGKILL" in e and "discovery entries" in e for e in launcher.events
        ), launcher.events

        seen: dict = {}

        def announced() -> bool:  # a copy of the restarted worker's announcement reached the router
            seen["restarted published"] = mine = published_events([urls[victim.name]])
            seen["other published since"] = others = published_events([urls[other.name]]) - other_before
            seen["router applied since"] = applied = applied_events(urls[front.name]) - applied_before
            return mine > 0 and applied >= others + 1

        # The announcement leaves before the restarted worker's model card exists (on_endpoint_ready),
        # so the router gets it in the recovery dump it reads when it activates the worker; it is
        # repeated after the card is out for a router that read the dump too early. Every copy
        # carries every re-adopted block, so any one applied makes the router's view whole.
        try:
            wait_until("the restarted worker's disk blocks at the router", announced, timeout=60)
        except AssertionError as e:
            raise AssertionError(f"{e}: {seen}") from None
        again = complete(plan, prompt, 2)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
        # The new process counts from zero: this disk hit happened on the restarted worker.
        assert metric(victim.port, "flexkv_requests_total") == 1
        assert metric(victim.port, "flexkv_prompt_tokens_cached_total", tier="disk") > 0
        assert seen["restarted published"] >= 1  # it re-adopted P from disk and announced it
        assert metric(other.port, "flexkv_requests_total") >= 4  # both workers served

        os.kill(launcher.running[victim.name].pid, signal.SIGKILL)
        supervisor.join(timeout=30)
        assert launcher.exit_code == 1
        assert re.match(
            rf"error: {victim.name} exited with signal SIGKILL: it died 2 times within 300 s, more "
            r"than its restart budget \(max-restarts=1\); stopping the graph. Its last log lines",
            launcher.events[-1],
        ), launcher.events[-1]
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join()  # no restart may race the shutdown
        launcher.shutdown()
    assert_gone(launcher)
    assert_all_gone([p.pid for p in launcher.spawned], [])


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
        assert all(
            r.seconds < 30 and (r.status == 503 or (r.status == 200 and r.done and r.error["code"] == 503))
            for r in failed
        ), failed
        assert all(r.usage and r.usage["completion_tokens"] >= 1 for r in results if r.error is None)
        serve.wait_for(
            rf"{victim} exited with signal SIGKILL .*removed its \d+ discovery entries; restarting "
            r"it in 30.0 s",
            10,
        )
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
