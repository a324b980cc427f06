"""The worker behaves like a production backend, on a served graph (Dynamo's real frontend and our
worker, started by the launcher, driven over HTTP): a client that disconnects stops its request
and frees its blocks; refusals say what is wrong and the limit; each response carries its exact
cached tokens per tier; SIGINT drains in-flight requests and pending SSD writes, exits 0 without a
traceback; nothing listens beyond 127.0.0.1. The tests that leave the graph serving share one;
the SIGINT test stops a graph of its own."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import MODEL, flexkv_metrics, make_plan, post, wait_until

from dynamo_flexkv import CacheConfig, KVManager
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig
from dynamo_flexkv.serve.launcher import Launcher

BLOCKS = 512  # device blocks of the worker: context window 512 x 16 = 8,192 tokens
WINDOW = BLOCKS * 16
EVICT_BLOCKS = 250  # two prompts this long push everything else out of the device cache


@contextlib.contextmanager
def agg_graph(tmp):
    plan = make_plan(tmp, "agg", f"FlexKVWorker.num-device-blocks={BLOCKS}")
    launcher = Launcher(plan)
    try:
        launcher.start()
        launcher.wait_ready(180)
        yield plan, launcher
    finally:
        launcher.shutdown()


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """One graph for the tests that leave it serving (they check counters as deltas)."""
    with agg_graph(tmp_path_factory.mktemp("robust")) as g:
        yield g


@pytest.fixture
def own_graph(tmp_path):
    """A graph of its own, for a test that stops it."""
    with agg_graph(tmp_path) as g:
        yield g


def tier(metrics: dict, name: str, t: str) -> float:
    return metrics[f'{name}{{tier="{t}"}}']


def test_nothing_listens_beyond_loopback(graph):
    plan, launcher = graph
    pid = launcher.running[plan.workers[0].name].pid
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    mine = [ln.split()[3] for ln in lines if f"pid={pid}," in ln]
    assert mine, "the worker listens on nothing?"
    assert all(addr.startswith("127.0.0.1:") for addr in mine), mine


@pytest.mark.integration
def test_worker_without_broker_refuses_to_bind_every_interface(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DYN_ZMQ_BROKER_URL"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.integrations.dynamo_worker",
            "--model",
            "tiny",
            "--model-dir",
            str(tmp_path / "m"),
            "--no-offload",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "0.0.0.0" in p.stderr and "DYN_ZMQ_BROKER_URL" in p.stderr and "dynamo-flexkv serve" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "body, status, message",
    [
        (
            {"prompt": "x" * (WINDOW + 5), "max_tokens": 2},
            400,
            f"prompt has {WINDOW + 5:,} tokens; this model's context window is {WINDOW:,}",
        ),
        (
            {"prompt": [1, 2, 3], "max_tokens": WINDOW},
            400,
            f"prompt has 3 tokens and max_tokens is {WINDOW:,}: {WINDOW + 3:,} exceeds this model's context window "
            f"of {WINDOW:,}; use max_tokens <= {WINDOW - 3:,}",
        ),
        ({"prompt": "hi", "max_tokens": 0}, 400, "Max tokens must be greater than 0, got 0"),  # the frontend's
        ({"prompt": "hi", "max_tokens": 2, "n": 3}, 400, "n=3 is not supported"),
        ({"prompt": "hi", "max_tokens": 2, "best_of": 2}, 400, "best_of=2 is not supported"),
        ({"prompt": "hi", "max_tokens": 2, "top_p": 0.5}, 400, "top_p=0.5 is not supported"),
        ({"prompt": "hi", "max_tokens": 2, "logprobs": 1}, 400, "logprobs=1 is not supported"),
        ({"prompt": "hi", "max_tokens": 2, "logprobs": 0}, 400, "logprobs=0 is not supported"),  # 0 asks too
        ({"prompt": "hi", "max_tokens": 2, "frequency_penalty": 1.0}, 400, "frequency_penalty=1.0 is not supported"),
    ],
    ids=[
        "prompt-over-window",
        "max-tokens-over-window",
        "max-tokens-0",
        "n",
        "best_of",
        "top_p",
        "logprobs",
        "logprobs-0",
        "penalty",
    ],
)
def test_refusals_name_the_limit(graph, body, status, message):
    plan, _ = graph
    code, reply = post(plan, body)
    assert code == status and message in reply["message"], reply


def test_chat_refusal_reaches_the_client(graph):
    plan, _ = graph
    code, reply = post(
        plan, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}, "/v1/chat/completions"
    )
    assert code == 400 and "n=2 is not supported" in reply["message"]


def test_concurrent_requests_account_cached_tokens_exactly(graph):
    """Many requests in flight, prefixes shared and evicted to host/disk between rounds: each
    response's per-tier counts are exact — they sum to the worker's metric totals — and the
    engine batches requests together."""
    plan, _ = graph
    port = plan.workers[0].port
    before = flexkv_metrics(port)
    prefixes = [[(7 * p + i) % 250 + 1 for i in range(6 * 16)] for p in range(4)]

    def ask(i):
        prompt = prefixes[i % 4] + [(i * 13 + k) % 250 + 1 for k in range(20)]
        code, r = post(plan, {"prompt": prompt, "max_tokens": 8, "nvext": {"extra_fields": ["engine_data"]}})
        assert code == 200, r
        return r

    replies = []
    with ThreadPoolExecutor(12) as pool:
        for round_ in range(2):
            replies += list(pool.map(ask, range(round_ * 12, round_ * 12 + 12)))
            # unrelated long prompts push the shared prefixes out of the device cache
            list(pool.map(lambda j: post(plan, {"prompt": [200 + j] * (EVICT_BLOCKS * 16), "max_tokens": 1}), range(2)))
    after = flexkv_metrics(port)
    sums = {t: 0 for t in ("device", "host", "disk")}
    for r in replies:
        by_tier = r["nvext"]["engine_data"]["flexkv"]["cached_tokens"]
        assert sum(by_tier.values()) == r["usage"]["prompt_tokens_details"]["cached_tokens"]
        for t in sums:
            sums[t] += by_tier[t]
    extra = 2 * 2  # the eviction prompts (their cached tokens, if any, are counted below too)
    assert after["flexkv_requests_total"] - before["flexkv_requests_total"] == len(replies) + extra
    evict_cached = {
        t: tier(after, "flexkv_prompt_tokens_cached_total", t)
        - tier(before, "flexkv_prompt_tokens_cached_total", t)
        - sums[t]
        for t in sums
    }
    assert all(v >= 0 for v in evict_cached.values()), evict_cached
    assert sum(evict_cached.values()) <= 2 * 2 * EVICT_BLOCKS * 16  # only the eviction prompts are unaccounted
    assert sums["host"] + sums["disk"] > 0, sums  # the second round found prefixes offloaded
    assert sums["device"] > 0, sums  # and, within a round, on the device
    steps = after["flexkv_engine_steps_total"] - before["flexkv_engine_steps_total"]
    batched = after["flexkv_engine_step_requests_total"] - before["flexkv_engine_step_requests_total"]
    assert batched / steps > 1.5, (batched, steps)  # decode steps interleave several requests


def test_concurrent_accounting_matches_metrics_exactly(graph):
    """The same, without the eviction prompts: per-response sums equal the metric deltas."""
    plan, _ = graph
    port = plan.workers[0].port
    before = flexkv_metrics(port)
    prompts = [[(3 * p + i) % 250 + 1 for i in range(5 * 16 + p)] for p in range(16)]

    def ask(prompt):
        code, r = post(plan, {"prompt": prompt, "max_tokens": 4, "nvext": {"extra_fields": ["engine_data"]}})
        assert code == 200, r
        return r

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, prompts + prompts))
    after = flexkv_metrics(port)
    for t in ("device", "host", "disk"):
        got = sum(r["nvext"]["engine_data"]["flexkv"]["cached_tokens"][t] for r in replies)
        assert got == tier(after, "flexkv_prompt_tokens_cached_total", t) - tier(
            before, "flexkv_prompt_tokens_cached_total", t
        ), t
    assert (
        sum(r["usage"]["prompt_tokens"] for r in replies)
        == after["flexkv_prompt_tokens_total"] - before["flexkv_prompt_tokens_total"]
    )


def _open_and_close_after_first_chunk(plan, i: int) -> None:
    host, port = plan.base_url.split("//")[1].split(":")
    body = json.dumps(
        {"model": MODEL, "prompt": [i % 200 + 1] * 40 + [5, 6, 7], "max_tokens": 300, "stream": True}
    ).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        buf = b""
        while b"data:" not in buf:
            chunk = s.recv(4096)
            assert chunk, buf
            buf += chunk


def test_disconnected_streams_free_their_blocks_and_tasks(graph):
    plan, _ = graph
    port = plan.workers[0].port
    before = flexkv_metrics(port)
    n = 30
    threads = [threading.Thread(target=_open_and_close_after_first_chunk, args=(plan, i)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    closed = time.monotonic()
    while True:
        m = flexkv_metrics(port)
        idle = m['flexkv_device_blocks{state="used"}'] == 0 and m["flexkv_tasks_in_flight"] == 0
        aborted = m["flexkv_requests_aborted_total"] - before["flexkv_requests_aborted_total"]
        # The random model may emit its end-of-text token within the first few tokens: such a
        # stream ended by itself before its client left.
        ended = m["flexkv_requests_total"] - before["flexkv_requests_total"]
        if idle and aborted + ended == n:
            break
        # A bound against a leak, not a speed check: the worker frees them within ms when quiet.
        assert time.monotonic() - closed < 30.0, (aborted, ended, m)
        time.sleep(0.05)
    assert aborted >= n - 3, (aborted, ended)


def test_sigint_drains_in_flight_requests_and_ssd_writes(own_graph):
    """Stops the worker. Requests in flight when SIGINT arrives still complete; the worker exits 0
    without a traceback; every prompt block is on disk afterwards (a restarted manager re-adopts
    them from the journal)."""
    plan, launcher = own_graph
    worker = plan.workers[0]
    proc = launcher.running[worker.name]
    prompts = [[(11 * p + i) % 250 + 1 for i in range(8 * 16 + 3)] for p in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, plan, {"prompt": p, "max_tokens": 40}) for p in prompts]
        # All four admitted: each distinct 131-token prompt holds at least 9 blocks of 16 (or one
        # already finished, so it was in the worker).
        need = len(prompts) * -(-len(prompts[0]) // 16)
        wait_until(
            "every request running in the worker",
            lambda: (
                any(f.done() for f in futures)
                or flexkv_metrics(worker.port)['flexkv_device_blocks{state="used"}'] >= need
            ),
            every=0.02,
        )
        os.killpg(proc.pid, signal.SIGINT)
        replies = [f.result() for f in futures]
    assert [code for code, _ in replies] == [200] * 4, replies
    assert all(r["usage"]["completion_tokens"] >= 1 for _, r in replies)
    assert proc.wait(timeout=60) == 0
    log = (launcher.log_dir / f"{worker.name}.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert "flexkv worker stopped" in log
    cfg = CacheConfig.load(worker.env["FLEXKV_CONFIG_PATH"])
    # as the worker names its weights (model|served-model-name): its disk tier is keyed by them
    with KVManager(EngineModelConfig.preset("tiny").kv_spec(), cfg, model_id="tiny|flexkv-tiny") as kv:
        for p in prompts:
            assert kv.match(p).get("disk", 0) == 8 * 16, kv.match(p)
