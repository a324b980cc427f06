"""The disaggregated graphs served end to end on 127.0.0.1: Dynamo's real frontend and its prefill
router, a prefill worker and a decode worker that pulls the prompt's KV over NIXL (UCX). Greedy
tokens must equal the aggregated graph's; faults must end in exact tokens or a clean error, with
no lease, block or process left behind."""

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from disagg_helpers import agg_plan, clean_exit, complete, disagg_plan, prompts, serve_all
from served import (
    assert_gone,
    metric,
    wait_until,
)

from dynamo_flexkv.serve.launcher import Launcher


@pytest.fixture(scope="module")
def disagg_graph(tmp_path_factory):
    """One disagg graph for the tests whose faults it survives (they check counters as deltas);
    every process exits 0 at the end."""
    plan = disagg_plan(tmp_path_factory.mktemp("disagg"))
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        yield launcher
    clean_exit(launcher)
    assert_gone(launcher)


def _lease_ends(port: int) -> dict:
    return {
        how: metric(port, "flexkv_handover_leases_ended_total", how=how) for how in ("released", "expired", "unclaimed")
    }


def test_disagg_graph_generates_the_aggregated_graphs_tokens_with_kv_pulled_over_nixl(disagg_graph, tmp_path):
    waves = prompts(50)
    with Launcher(agg_plan(tmp_path)) as launcher:
        launcher.wait_ready(120)
        want = [r["choices"][0]["text"] for r in serve_all(launcher.plan, waves)]
    plan = disagg_graph.plan
    prefill, decode = plan.workers
    requests = [metric(w.port, "flexkv_requests_total") for w in (prefill, decode)]
    cached = sum(metric(prefill.port, "flexkv_prompt_tokens_cached_total", tier=t) for t in ("device", "host", "disk"))
    stored = metric(decode.port, "flexkv_stored_blocks_total", tier="host")
    ends = _lease_ends(prefill.port)
    replies = serve_all(plan, waves)
    assert [r["choices"][0]["text"] for r in replies] == want
    pulled = [r["nvext"]["engine_data"]["flexkv"].get("handover_tokens") for r in replies]
    assert all(t is not None for t in pulled), "a request reached decode without a handover"
    assert sum(pulled) > 0
    # Every request went through the prefill worker; repeated prefixes came from its tiers.
    assert [metric(w.port, "flexkv_requests_total") - n for w, n in zip((prefill, decode), requests)] == [50, 50]
    assert (
        sum(metric(prefill.port, "flexkv_prompt_tokens_cached_total", tier=t) for t in ("device", "host", "disk"))
        > cached
    )
    # The decode worker offloads what it received to its own tiers too.
    assert metric(decode.port, "flexkv_stored_blocks_total", tier="host") > stored
    # Each lease ends on decode's release notice, a NIXL message that may land a little after the
    # reply (the 30 s lease timeout is far off): each released, none expired or unclaimed.
    wait_until(
        "the prefill worker's leases released",
        lambda: (
            metric(prefill.port, "flexkv_handover_leases") == 0
            and metric(prefill.port, "flexkv_device_blocks", state="used") == 0
        ),
        timeout=10,
    )
    ended = {how: n - ends[how] for how, n in _lease_ends(prefill.port).items()}
    assert ended["released"] > 0 and ended["expired"] == ended["unclaimed"] == 0, ended


def test_decode_stopped_then_killed_while_holding_a_lease_the_lease_expires_and_the_graph_keeps_serving(tmp_path):
    """SIGSTOP the decode worker, send a request: the prefill worker computes it and leases its
    blocks; SIGKILL the decode worker while the lease is held. The lease expires (3 s) and its
    blocks come back; the request ends in exact tokens (migrated to the restarted decode worker,
    which recomputes: the lease is gone) or a clean HTTP error; the graph serves exact tokens
    after the restart, and every process exits 0 at the end."""
    import os
    import signal
    import threading
    import time
    import urllib.error

    from served import assert_all_gone

    plan = disagg_plan(tmp_path, "disagg", "PrefillWorker.handover-lease-s=3", "DecodeWorker.restart-backoff-s=0.5")
    prefill, decode = plan.workers
    launcher = Launcher(plan)
    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: launcher.supervise(stop))
    base, extra = prompts(4, seed=11)
    try:
        launcher.start()
        launcher.wait_ready(120)
        supervisor.start()
        want = {p: complete(plan, p, 3)["choices"][0]["text"] for p in base + extra}
        wait_until("no prefill block leased", lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0)
        first_pid = launcher.running[decode.name].pid
        os.kill(first_pid, signal.SIGSTOP)
        outcome = {}

        def ask():
            try:
                outcome["reply"] = complete(plan, extra[0], 3)
            except (urllib.error.HTTPError, OSError) as e:
                outcome["error"] = e

        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(
            "a lease held on the prefill worker",
            lambda: metric(prefill.port, "flexkv_device_blocks", state="used") > 0,
            every=0.05,
        )
        os.kill(first_pid, signal.SIGKILL)
        wait_until(
            "the lease expired",
            lambda: "expired" in (plan.run_dir / "logs" / f"{prefill.name}.log").read_text(),
            timeout=20,
        )
        wait_until("its blocks back", lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0)
        asker.join(150)
        assert not asker.is_alive()
        if "reply" in outcome:
            assert outcome["reply"]["choices"][0]["text"] == want[extra[0]]
        wait_until(
            "the decode worker restarted",
            lambda: decode.name not in launcher.starting and launcher.restarts.get(decode.name) == 1,
            timeout=90,
        )
        # README's bound: once the restarted worker is ready, a new short request is answered within
        # 30 s (the frontend answers 404/503 until it re-discovered the decode worker).
        t0, refused = time.monotonic(), []
        while True:
            try:
                short = complete(plan, "a new short request after the restart", 3)
                break
            except urllib.error.HTTPError as e:
                refused.append(e.code)
                assert e.code in (404, 503) and time.monotonic() - t0 < 30, refused
                time.sleep(0.2)
        answered = time.monotonic() - t0
        print(f"\na new short request answered {answered:.1f} s after the restarted decode was ready ({refused})")
        assert answered < 30 and short["choices"][0]["text"]
        for p in base:
            assert complete(plan, p, 3)["choices"][0]["text"] == want[p]
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join()
        launcher.shutdown()
    clean_exit(launcher)
    assert_gone(launcher)
    assert_all_gone([p.pid for p in launcher.spawned], [])


def test_prefill_killed_mid_handover_decode_recomputes_and_the_restarted_prefill_serves_again(tmp_path):
    """SIGSTOP the decode worker and send a request: the prefill worker computes it and leases its
    blocks, the frontend hands the request to decode, which cannot pull yet. SIGKILL the prefill
    worker, SIGCONT decode: its pull finds the peer gone and it recomputes the prompt (exact greedy
    tokens) or the request ends in a clean HTTP error. The launcher restarts the prefill worker and
    the graph serves exact tokens again; decode holds no device block, no task is in flight and
    every process exits 0."""
    import os
    import signal
    import threading
    import urllib.error

    from served import assert_all_gone, inflight

    plan = disagg_plan(tmp_path, "disagg", "PrefillWorker.restart-backoff-s=0.5")
    prefill, decode = plan.workers
    launcher = Launcher(plan)
    stop = threading.Event()
    supervisor = threading.Thread(target=lambda: launcher.supervise(stop))
    base, extra = prompts(4, seed=17)
    decode_pid = None
    try:
        launcher.start()
        launcher.wait_ready(120)
        supervisor.start()
        want = {p: complete(plan, p, 3)["choices"][0]["text"] for p in base + extra}
        wait_until("no prefill block leased", lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0)
        # A prompt neither worker has seen: decode must pull all of it or recompute all of it.
        fresh = extra[0] + " " + " ".join(reversed(base[0].split()))
        first_prefill = launcher.running[prefill.name].pid
        decode_pid = launcher.running[decode.name].pid
        os.kill(decode_pid, signal.SIGSTOP)
        outcome = {}

        def ask():
            try:
                outcome["reply"] = complete(plan, fresh, 3)
            except (urllib.error.HTTPError, OSError) as e:
                outcome["error"] = e

        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(
            "a lease held on the prefill worker",
            lambda: metric(prefill.port, "flexkv_device_blocks", state="used") > 0,
            every=0.05,
        )
        # The prefill worker answered (its lease granted, its stream ended): the frontend sends the
        # request on to the stopped decode worker.
        wait_until(
            "the prefill worker's answer sent",
            lambda: metric(prefill.port, "flexkv_handover_leases") == 1 and inflight(prefill.port) == 0,
            every=0.05,
        )
        os.kill(first_prefill, signal.SIGKILL)
        wait_until(
            "the prefill worker reaped",
            lambda: (
                launcher.running[prefill.name].pid != first_prefill or launcher.running[prefill.name].poll() is not None
            ),
            timeout=10,
        )
        os.kill(decode_pid, signal.SIGCONT)
        decode_pid = None
        asker.join(120)
        assert not asker.is_alive(), "the request neither finished nor failed"
        if "reply" in outcome:  # decode recomputed the prompt it could not pull
            reply = outcome["reply"]
            assert reply["nvext"]["engine_data"]["flexkv"].get("handover_tokens") == 0
            log = (plan.run_dir / "logs" / f"{decode.name}.log").read_text()
            # Its pull failed (logged), or, on a loaded machine, the prefill worker died before the
            # frontend had its handover and decode got the request without one: computed either way.
            pulled = [ln for ln in log.splitlines() if "KV handover from" in ln]
            assert all("failed, recomputing" in ln for ln in pulled), pulled
        else:
            assert isinstance(outcome["error"], urllib.error.HTTPError), outcome["error"]
        wait_until(
            "the prefill worker restarted",
            lambda: prefill.name not in launcher.starting and launcher.restarts.get(prefill.name) == 1,
            timeout=90,
        )
        # The frontend registers the new prefill instance a moment after its /health is ready.
        wait_until(
            "the graph serving exact tokens again",
            lambda: _text_or_none(plan, base[1]) == want[base[1]],
            timeout=30,
            every=0.5,
        )
        for p in base + extra:
            assert complete(plan, p, 3)["choices"][0]["text"] == want[p]
        if "reply" in outcome:
            assert outcome["reply"]["choices"][0]["text"] == complete(plan, fresh, 3)["choices"][0]["text"]
        assert launcher.restarts.get(decode.name) is None, "the decode worker died too"
        wait_until(
            "decode holds no device block",
            lambda: metric(decode.port, "flexkv_device_blocks", state="used") == 0,
            timeout=20,
        )
        wait_until("no task in flight", lambda: inflight(decode.port) == 0 and inflight(prefill.port) == 0, timeout=20)
        wait_until(
            "the new prefill worker's leases released",
            lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0,
            timeout=20,
        )
    finally:
        if decode_pid is not None:
            os.kill(decode_pid, signal.SIGCONT)
        stop.set()
        if supervisor.is_alive():
            supervisor.join()
        launcher.shutdown()
    clean_exit(launcher)
    assert_gone(launcher)
    assert_all_gone([p.pid for p in launcher.spawned], [])


def _text_or_none(plan, prompt: str):
    """The greedy text, or None while a request still fails (e.g. no prefill worker registered yet)."""
    import urllib.error

    try:
        return complete(plan, prompt, 3)["choices"][0]["text"]
    except (urllib.error.HTTPError, OSError):
        return None


def test_a_lease_no_decode_worker_claims_ends_after_the_renewal_window_not_the_lease_ttl(disagg_graph):
    """SIGSTOP the decode worker and send a request: the prefill worker computes it and leases its
    blocks, but no decode worker claims the lease. It ends ``renew_s`` (5 s) after the grant, far
    before the 30 s ``handover-lease-s``, counted as unclaimed. (Dynamo's frontend gives up on the
    stopped decode worker after its 5 s TCP request timeout and migrates the request: it prefills it
    again, and that lease goes unclaimed too.) SIGCONT decode: the request ends in exact tokens or a
    clean HTTP error, every lease ends (none held until its ttl), later requests pull as before and
    no lease is claimed and then lost."""
    import os
    import signal
    import threading
    import time
    import urllib.error

    launcher = disagg_graph
    plan = launcher.plan
    prefill, decode = plan.workers
    base, extra = prompts(4, seed=23)
    want = {p: complete(plan, p, 3)["choices"][0]["text"] for p in base + extra}
    wait_until("no prefill block leased", lambda: metric(prefill.port, "flexkv_device_blocks", state="used") == 0)
    ends = _lease_ends(prefill.port)
    decode_pid = launcher.running[decode.name].pid
    fresh = extra[0] + " " + " ".join(reversed(base[0].split()))
    os.kill(decode_pid, signal.SIGSTOP)
    outcome = {}

    def ask():
        try:
            outcome["reply"] = complete(plan, fresh, 3)
        except (urllib.error.HTTPError, OSError) as e:
            outcome["error"] = e

    asker = threading.Thread(target=ask)
    try:
        asker.start()
        wait_until(
            "a lease held on the prefill worker",
            lambda: metric(prefill.port, "flexkv_handover_leases") >= 1,
            every=0.05,
        )
        held = time.monotonic()
        wait_until(
            "the unclaimed lease ended",
            lambda: _lease_ends(prefill.port)["unclaimed"] > ends["unclaimed"],
            timeout=25,
            every=0.1,
        )
        assert time.monotonic() - held < 15, "an unclaimed lease was held about as long as the 30 s lease ttl"
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    asker.join(120)
    assert not asker.is_alive(), "the request neither finished nor failed"
    if "reply" in outcome:
        assert outcome["reply"]["choices"][0]["text"] == complete(plan, fresh, 3)["choices"][0]["text"]
    else:
        assert isinstance(outcome["error"], urllib.error.HTTPError), outcome["error"]
    wait_until("every lease ended", lambda: metric(prefill.port, "flexkv_handover_leases") == 0, timeout=15)
    assert "expired unclaimed" in (plan.run_dir / "logs" / f"{prefill.name}.log").read_text()
    wait_until(
        "the graph serving exact tokens again",
        lambda: _text_or_none(plan, base[1]) == want[base[1]],
        timeout=30,
        every=0.5,
    )
    failed = metric(decode.port, "flexkv_handovers_total", result="failed")
    for p in base:  # pulled again, exact
        assert complete(plan, p, 3)["choices"][0]["text"] == want[p]
    assert metric(decode.port, "flexkv_handovers_total", result="failed") == failed
    wait_until(
        "the prefill worker's leases released", lambda: metric(prefill.port, "flexkv_handover_leases") == 0, timeout=10
    )
    # No lease was claimed and then lost: each ended by release or unclaimed.
    assert _lease_ends(prefill.port)["expired"] == ends["expired"]
    assert metric(prefill.port, "flexkv_device_blocks", state="used") == 0
