"""A served graph behaves like production (refusals, hang-ups, deaths, shutdown), through its
public interface only: ``dynamo-flexkv serve`` (agg_router: Dynamo's
real frontend with the KV router and migration, two of our workers) on 127.0.0.1, HTTP requests
to the frontend, signals to processes, the workers' /metrics and the logs in RUN_DIR/logs.

Claims tried: refusals say what is wrong and the limit (edges of the context window and the
vocabulary, n/best_of, options the worker cannot honour); clients that hang up at any moment
(before the first token, mid-prefill of a long prompt, mid-decode, non-streaming, chat) stop their
requests and free their blocks; no router event is dropped after a burst; a worker SIGKILLed
during long prefills loses no request and is routed to again once restarted; SIGTERM followed by a
second signal drains in-flight requests and exits 0 without a traceback, and a new graph on the
same SSD directories serves the prefix from disk.

What Dynamo 1.6.1's frontend does before our worker sees a request (docs/LIMITATIONS.md) is pinned
as it is today: each such test asserts what happens, names the upstream defect and its
consequence, and fails if the behaviour changes in either direction. The tests share one graph and
run in file order (the last default test stops it)."""

import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import (
    MODEL,
    TIMEOUT,
    Serve,
    Streamed,
    assert_all_gone,
    events_applied,
    post,
    routed_workers,
    scrape,
    stream,
    total,
    wait_until,
)

WINDOW = 64 * 16  # the Serve helper's graph: 64 device blocks of 16 tokens per worker
VOCAB = 512
WORKERS = ("FlexKVWorker-0", "FlexKVWorker-1")
EVENT_DROPS = re.compile(
    r"Failed to find block|block to remove|unknown parent|parent block .* not found|"
    r"dropp(ed|ing) (kv )?event|event gap|missed \d+ events",
    re.I,
)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 37 + k * 7) % (VOCAB - 12) + 1 for k in range(n)]


def _serve(tmp) -> Serve:
    serve = Serve(tmp, "g", "FlexKVWorker.restart-backoff-s=0.5")
    serve.run_dir = tmp / "g"
    serve.tmp = tmp
    return serve


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """One graph for the tests that leave it serving (a worker they kill is restarted and routed to
    again before they end)."""
    serve = _serve(tmp_path_factory.mktemp("advserve"))
    try:
        yield serve
    finally:
        serve.close()


@pytest.fixture
def own_graph(tmp_path):
    """A graph of its own, for a test that stops it."""
    serve = _serve(tmp_path)
    try:
        yield serve
    finally:
        serve.close()


def disk_ready(port: int) -> float:
    return total(scrape(port), "flexkv_pool_blocks", tier="disk", state="ready")


def counts(port: int) -> dict:
    """What the tests here watch on a worker's /metrics."""
    text = scrape(port)
    return {
        "used": total(text, "flexkv_device_blocks", state="used"),
        "tasks": total(text, "flexkv_tasks_in_flight"),
        "aborted": total(text, "flexkv_requests_aborted_total"),
        "done": total(text, "flexkv_requests_total"),
        "disk_hits": total(text, "flexkv_prompt_tokens_cached_total", tier="disk"),
    }


def all_workers(serve) -> list[dict]:
    return [counts(serve.worker_port(w)) for w in WORKERS]


def logs(serve) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((serve.run_dir / "logs").glob("*.log")))


def open_stream(serve, body: dict, path: str = "/v1/completions") -> socket.socket:
    raw = json.dumps({"model": MODEL, **body}).encode()
    s = socket.create_connection(("127.0.0.1", int(serve.base_url.rsplit(":", 1)[1])), timeout=TIMEOUT)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return s


def hang_up(serve, body: dict, after_events: int, delay: float = 0.0, path: str = "/v1/completions") -> bytes:
    """Sends a request and closes the connection after ``after_events`` SSE data events (0: after
    ``delay`` seconds, whatever arrived). Returns what was received."""
    s = open_stream(serve, body, path)
    buf = b""
    try:
        if after_events == 0:
            time.sleep(delay)
        else:
            while buf.count(b"data:") < after_events:
                chunk = s.recv(4096)
                assert chunk, buf  # the stream must not end before the client hangs up
                buf += chunk
    finally:
        s.close()
    return buf


def wait_idle(serve, before: list[dict], n: int, timeout: float = 15.0):
    """Until both workers hold no device block and no offload task and all ``n`` requests ended
    (aborted, or finished by themselves). Returns (seconds, aborted, finished)."""
    t0 = time.monotonic()
    while True:
        now = all_workers(serve)
        aborted = sum(m["aborted"] for m in now) - sum(m["aborted"] for m in before)
        done = sum(m["done"] for m in now) - sum(m["done"] for m in before)
        if all(m["used"] == 0 and m["tasks"] == 0 for m in now) and aborted + done >= n:
            return time.monotonic() - t0, aborted, done
        assert time.monotonic() - t0 < timeout, (aborted, done, now)
        time.sleep(0.05)


# --- limits at their edges -------------------------------------------------------------------------

SERVED = {  # id: (path, body without model, completion tokens)
    "prompt-window-minus-1": ("/v1/completions", {"prompt": ids(WINDOW - 1, 1), "max_tokens": 1}, 1),
    "prompt-window-minus-1-default-max": ("/v1/completions", {"prompt": ids(WINDOW - 1, 2)}, 1),
    "prompt-plus-max-tokens-exactly-window": (
        "/v1/completions",
        {"prompt": ids(WINDOW - 4, 3), "max_tokens": 4, "ignore_eos": True},
        None,
    ),
    "stream-prompt-window-minus-1": (
        "/v1/completions",
        {"prompt": ids(WINDOW - 1, 4), "max_tokens": 1, "stream": True},
        None,
    ),
    "token-id-vocab-minus-1": ("/v1/completions", {"prompt": [VOCAB - 1, 0, VOCAB - 1], "max_tokens": 2}, 2),
    "n-1": ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 1}, 2),
    "best_of-1": ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "best_of": 1}, 2),
    "chat-n-1": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 1}, 2),
    "top_p-1-is-off": ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "top_p": 1.0}, 2),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_limits_at_their_edge_are_served(graph, case):
    path, body, tokens = SERVED[case]
    code, reply = post(graph, body, path)
    assert code == 200, reply
    if body.get("stream"):
        assert "data: [DONE]" in reply and '"error"' not in reply, reply
        return
    assert len(reply["choices"]) == 1
    if tokens is not None:
        assert reply["usage"]["completion_tokens"] == tokens, reply["usage"]
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] <= WINDOW


REFUSED = {  # id: (path, body without model, what the 4xx message must contain)
    "prompt-exactly-window": (
        "/v1/completions",
        {"prompt": ids(WINDOW, 5), "max_tokens": 1},
        f"prompt has {WINDOW:,} tokens; this model's context window is {WINDOW:,}",
    ),
    "prompt-exactly-window-default-max": (
        "/v1/completions",
        {"prompt": ids(WINDOW, 6)},
        f"context window is {WINDOW:,}",
    ),
    "max-tokens-one-over-room": (
        "/v1/completions",
        {"prompt": ids(WINDOW - 4, 7), "max_tokens": 5},
        f"{WINDOW + 1:,} exceeds this model's context window of {WINDOW:,}; use max_tokens <= 4",
    ),
    "n-0": ("/v1/completions", {"prompt": [5], "max_tokens": 2, "n": 0}, "n must be between 1 and 128, got 0"),
    "n-string": ("/v1/completions", {"prompt": [5], "max_tokens": 2, "n": "2"}, 'invalid type: string "2"'),
    "max-tokens-string-digits": ("/v1/completions", {"prompt": [5], "max_tokens": "2"}, 'invalid type: string "2"'),
    "best_of-0": ("/v1/completions", {"prompt": [5], "max_tokens": 2, "best_of": 0}, "best_of=0 is not supported"),
    "chat-n-2": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2},
        "n=2 is not supported",
    ),
    "chat-best_of": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "best_of": 3},
        "best_of",
    ),
    "chat-logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True},
        "logprobs=1 is not supported",
    ),
    "chat-logprobs-top-0": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 0},
        "logprobs=0 is not supported",
    ),
    "top_k": ("/v1/completions", {"prompt": [5], "max_tokens": 2, "top_k": 5}, "top_k=5 is not supported"),
    "repetition_penalty": (
        "/v1/completions",
        {"prompt": [5], "max_tokens": 2, "repetition_penalty": 1.5},
        "repetition_penalty=1.5 is not supported",
    ),
    "use_beam_search": (
        "/v1/completions",
        {"prompt": [5], "max_tokens": 2, "use_beam_search": True},
        "use_beam_search",
    ),
    "json-response-format": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "json_object"}},
        "is not supported",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_what_is_wrong(graph, case):
    path, body, message = REFUSED[case]
    code, reply = post(graph, body, path)
    assert 400 <= code < 500 and message in reply["message"], (code, reply)


def _greedy(graph, **extra):
    code, reply = post(graph, {"prompt": [5, 9, 33], "max_tokens": 6, **extra})
    return code, reply


def _same_answer(plain: dict, other: dict) -> None:
    """Two greedy replies of the same prompt give the same choices (text, finish reason, logprobs)."""
    strip = [{k: v for k, v in c.items() if k != "index"} for c in plain["choices"]]
    assert [{k: v for k, v in c.items() if k != "index"} for c in other["choices"]] == strip, (plain, other)


def test_logit_bias_is_dropped_by_the_frontend_and_has_no_effect(graph):
    """Upstream defect (Dynamo 1.6.1's frontend): logit_bias is accepted (200) and dropped before
    the worker, so the worker can neither honour nor refuse it. Probed (the request dict the
    worker's generate() gets): model, token_ids, stop_conditions, sampling_options (n, best_of,
    penalties, temperature, top_p, top_k, min_p, use_beam_search, length_penalty, seed,
    include_stop_str_in_output, guided_decoding), output_options (logprobs, prompt_logprobs,
    skip_special_tokens, formatted_prompt, return_tokens_as_token_ids), eos_token_ids, mdc_sum,
    annotations, routing, router_config_override: identical with and without logit_bias.
    Consequence: a client that bans every token of the vocabulary gets the unbiased answer and no
    error. Pinned as it is: this fails if the frontend starts honouring it (the text changes) or
    refusing it (a 4xx)."""
    code, plain = _greedy(graph, temperature=0)
    assert code == 200, plain
    code, biased = _greedy(graph, temperature=0, logit_bias={str(t): -100 for t in range(VOCAB)})
    assert code == 200, biased
    _same_answer(plain, biased)


def test_completions_logprobs_zero_is_refused_or_honoured(graph):
    code, reply = _greedy(graph, logprobs=0)
    if code == 200:
        assert reply["choices"][0].get("logprobs"), reply
    else:
        assert 400 <= code < 500 and "logprobs" in reply["message"], reply


def test_suffix_is_dropped_by_the_frontend_and_has_no_effect(graph):
    """Upstream defect (Dynamo 1.6.1's frontend): completions' `suffix` is accepted (200) and
    dropped before the worker (the request generate() gets is identical with and without it; see
    the logit_bias test), so the worker can neither honour nor refuse it. Consequence: a client
    asking for an insertion gets a plain completion and no error. Pinned as it is: this fails if
    the frontend starts passing it on (the worker then refuses it) or refusing it itself."""
    code, plain = _greedy(graph, temperature=0)
    assert code == 200, plain
    code, reply = _greedy(graph, temperature=0, suffix=" the end")
    assert code == 200, reply
    _same_answer(plain, reply)


def test_chat_top_logprobs_without_logprobs_is_dropped_by_the_frontend_and_has_no_effect(graph):
    """Upstream defect (Dynamo 1.6.1's frontend): chat `top_logprobs` without `logprobs: true` is
    accepted (200, logprobs null) and the worker cannot refuse it: the frontend sets
    output_options.logprobs only with logprobs=true (to top_logprobs, 1 when absent) and otherwise
    sends None, the same as a request without top_logprobs. (logprobs=true is refused, with any
    top_logprobs, 0 too: test_refusals_name_what_is_wrong.) Consequence: a client asking for 3
    alternatives per token gets none and no error. Pinned as it is: this fails if the frontend
    starts passing it on or refusing it."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    code, plain = post(graph, chat, "/v1/chat/completions")
    assert code == 200, plain
    code, reply = post(graph, {**chat, "top_logprobs": 3}, "/v1/chat/completions")
    assert code == 200, reply
    assert reply["choices"][0]["logprobs"] is None, reply
    _same_answer(plain, reply)


def test_streamed_n_2_gets_a_4xx(graph):
    code, reply = post(graph, {"prompt": [5], "max_tokens": 2, "n": 2, "stream": True})
    assert 400 <= code < 500 and "n=2" in reply["message"], (code, reply)


# --- clients hanging up -----------------------------------------------------------------------------


def test_clients_hanging_up_at_every_moment_free_everything(graph):
    """40 clients at once: before the first token of a ~1,000-token prefill, after the first chunk,
    after five decoded chunks, non-streaming ones after 1 s of a 700-token answer, chat streams
    after their first chunk. Every request ends (aborted or finished), both workers come back to
    no device block in use and no offload task in flight, and normal requests are still served."""
    before = all_workers(graph)
    jobs = []
    for i in range(10):
        jobs.append(
            ({"prompt": ids(WINDOW - 30, 100 + i), "max_tokens": 20, "stream": True}, 0, 0.05, "/v1/completions")
        )
        jobs.append(({"prompt": ids(900, 200 + i), "max_tokens": 100, "stream": True}, 1, 0, "/v1/completions"))
        jobs.append(({"prompt": ids(300, 300 + i), "max_tokens": 400, "stream": True}, 5, 0, "/v1/completions"))
    for i in range(5):
        jobs.append(({"prompt": ids(200, 400 + i), "max_tokens": 700}, 0, 1.0, "/v1/completions"))
        jobs.append(
            (
                {
                    "messages": [{"role": "user", "content": f"chat {i} " + "x y " * 100}],
                    "max_tokens": 300,
                    "stream": True,
                },
                1,
                0,
                "/v1/chat/completions",
            )
        )
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: hang_up(graph, j[0], j[1], j[2], j[3]), jobs))
    # The 10 clients gone 50 ms after sending may leave before the frontend dispatched them (it
    # then cancels them itself, and no worker ever sees them): only the other 30 must reach a worker.
    seconds, aborted, done = wait_idle(graph, before, len(jobs) - 10)
    assert aborted >= len(jobs) - 10 - 8, (aborted, done)  # a few may end by themselves (end-of-text)
    # A request that reached a worker late ends by itself (20 tokens); a leaked block or task never
    # comes back, so this waits for the condition and fails only on a leak.
    wait_until(
        "no device block in use and no offload task in flight on either worker",
        lambda: all(m["used"] == 0 and m["tasks"] == 0 for m in all_workers(graph)),
        timeout=60,
    )
    code, reply = post(graph, {"prompt": ids(100, 1), "max_tokens": 4})
    assert code == 200 and reply["usage"]["completion_tokens"] >= 1


def test_a_disconnected_prompt_keeps_its_full_blocks_cached(graph):
    """A client that hangs up mid-decode leaves its full prompt blocks cached: the same prompt sent
    again is (at least partly) a cache hit."""
    prompt = ids(5 * 16 + 3, 777)
    hang_up(graph, {"prompt": prompt, "max_tokens": 300, "stream": True}, 3)
    wait_idle(graph, all_workers(graph), 0)
    code, reply = post(graph, {"prompt": prompt, "max_tokens": 1})
    assert code == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * 16, reply["usage"]


def test_burst_with_hangups_drops_no_router_event(graph):
    """120 requests over 8 shared prefixes (device, host and disk evictions) interleaved with
    clients hanging up: no log says the router failed to apply an event."""
    import random

    rnd = random.Random(5)
    prefixes = [[rnd.randrange(1, VOCAB - 1) for _ in range(rnd.choice([100, 300, 600]))] for _ in range(8)]

    def one(i):
        prompt = (prefixes[i % 8] + [rnd.randrange(1, VOCAB - 1) for _ in range(rnd.randrange(1, 200))])[: WINDOW - 20]
        if i % 5 == 4:
            hang_up(graph, {"prompt": prompt, "max_tokens": 16, "stream": True}, 0, 0.02 * (i % 7))
            return 200
        return post(graph, {"prompt": prompt, "max_tokens": rnd.choice([1, 4, 16]), "stream": i % 2 == 0})[0]

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, range(120)))
    assert codes == [200] * 120, codes
    wait_idle(graph, all_workers(graph), 0)
    applied = events_applied(graph.metrics["Frontend"], [graph.metrics[w] for w in WORKERS])  # every one arrived
    assert {status for _, status in applied} == {"ok"}, f"events the router could not apply: {applied}"
    bad = [ln for ln in logs(graph).splitlines() if EVENT_DROPS.search(ln)]
    assert not bad, bad[:5]


# --- a worker killed during long prefills ------------------------------------------------------------


def tracked_stream(serve, prompt, max_tokens, progress: Streamed) -> Streamed:
    return stream(serve.base_url, MODEL, prompt, max_tokens, out=progress, ignore_eos=True)


@pytest.mark.slow
def test_worker_killed_mid_decode_of_long_prompts_loses_nothing_and_is_routed_to_again(graph):
    """8 streams of 900-token prompts, every one decoding: SIGKILL a worker. Every stream
    completes (migration-limit 3), the worker is restarted, both are registered with the router and
    the restarted one serves again; a client hanging up during the restart leaves nothing behind."""
    victim = WORKERS[0]
    prompts = [ids(900, 900 + i) for i in range(8)]
    tracks = [Streamed() for _ in prompts]
    ready_before = sum(f"{victim} is ready again" in x for x in graph.lines)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(tracked_stream, graph, p, 100, t) for p, t in zip(prompts, tracks)]
        wait_until(
            "every stream decoding",
            lambda: all(t.chunks >= 3 for t in tracks) or any(f.done() for f in futures),
            timeout=TIMEOUT,
            every=0.01,
        )
        os.kill(graph.worker_pid(victim), signal.SIGKILL)
        # a client that hangs up while the worker is dead / restarting
        hang_up(graph, {"prompt": ids(600, 5), "max_tokens": 50, "stream": True}, 1)
        results = [f.result(timeout=TIMEOUT) for f in futures]
    assert all(r.status == 200 and r.done and r.error is None for r in results), [vars(r) for r in results]
    assert all(r.usage["completion_tokens"] == 100 for r in results), [r.usage for r in results]
    wait_until(
        "the restarted worker ready",
        lambda: sum(f"{victim} is ready again" in x for x in graph.lines) > ready_before,
        timeout=90,
    )
    wait_until("both workers routed", lambda: routed_workers(graph.base_url) == 2, timeout=30)
    port = graph.worker_port(victim)
    served = counts(port)["done"]
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: post(graph, {"prompt": ids(150, 5000 + i), "max_tokens": 2})[0], range(16)))
    assert codes == [200] * 16
    assert counts(port)["done"] > served  # the router sends new prompts to the restarted worker
    wait_idle(graph, all_workers(graph), 0)


@pytest.mark.slow
def test_migrated_requests_report_their_prompt_plus_the_tokens_generated_before_the_death(graph):
    """8 streams of 300-token prompts decoding 700 tokens each; once every stream has at least 10
    chunks, SIGKILL the worker holding the most device blocks: its streams are migrated.

    Upstream defect (Dynamo 1.6.1): a request migrated mid-decode reports usage.prompt_tokens = its
    prompt plus the k tokens generated before the death. Probed: Dynamo resends it to the new
    worker as a fresh request (token_ids = prompt + the k generated tokens, stop_conditions.
    max_tokens reduced by k, annotations [] and no other field changed), so no worker can tell the
    original prompt length. The frontend takes prompt_tokens from the worker's completion_usage (its
    own count only when completion_usage is absent, which would lose usage.prompt_tokens_details.
    cached_tokens for every request; completion_usage without prompt_tokens is refused by the
    frontend as 'Invalid request'). Consequence: a client billing by prompt_tokens overcounts a
    migrated request by the tokens it had already received; completion_tokens is right (the
    frontend's count). Pinned as it is: every stream completes its 700 tokens, the streams that
    stayed report their own prompt, and at least one (the victim's) reports its prompt plus k, k at
    least the chunks its client had seen at the kill; this fails once Dynamo reports the migrated
    streams' own prompt length (then assert that every stream does)."""
    prompts = [ids(300, 6000 + i) for i in range(8)]
    tracks = [Streamed() for _ in prompts]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(tracked_stream, graph, p, 700, t) for p, t in zip(prompts, tracks)]
        wait_until(
            "every stream decoding",
            lambda: all(t.chunks >= 10 for t in tracks) or any(f.done() for f in futures),
            timeout=TIMEOUT,
            every=0.01,
        )
        used = {w: counts(graph.worker_port(w))["used"] for w in WORKERS}
        victim = max(used, key=used.get)
        ready_before = sum(f"{victim} is ready again" in x for x in graph.lines)
        seen = [t.chunks for t in tracks]  # each chunk is at least one token generated before the kill
        if used[victim]:
            os.kill(graph.worker_pid(victim), signal.SIGKILL)
        results = [f.result(timeout=TIMEOUT) for f in futures]
    if not used[victim]:
        pytest.skip(
            f"no stream was decoding when the kill was due ({used}): no worker held "
            "a stream's blocks at that moment, so nothing would migrate; rerun it"
        )
    wait_until(
        "the restarted worker ready",
        lambda: sum(f"{victim} is ready again" in x for x in graph.lines) > ready_before,
        timeout=90,
    )
    wait_until("both workers routed", lambda: routed_workers(graph.base_url) == 2, timeout=30)
    wait_idle(graph, all_workers(graph), 0)
    report = [(len(p), k, r.usage, r.error) for p, k, r in zip(prompts, seen, results)]
    assert all(r.usage and r.usage["completion_tokens"] == 700 for r in results), report
    extra = [r.usage["prompt_tokens"] - len(p) for p, r in zip(prompts, results)]
    assert all(x == 0 or k <= x < 700 for x, k in zip(extra, seen)), report  # own prompt, or prompt + k
    assert any(extra), report  # the victim's streams: prompt + the k tokens generated before the death


# --- shutdown ------------------------------------------------------------------------------------------

DRAIN_PROMPTS = [ids(8 * 16 + 3, 60 + p) for p in range(4)]


def drain_tokens(graph) -> int:
    """Tokens for each drained stream: enough that it decodes well past both signals (the drain has
    work to do) and ends well inside serve's 30 s stop deadline, past which what is left gets
    SIGKILL. Scaled to this machine's decode rate now, measured on one stream: a fixed 120 ended
    every stream before the second signal on a quiet fast 2-core machine. About 3 s of decoding
    alone, 120 to 360 tokens (two streams per worker fit its 64 blocks of 16)."""
    t0 = time.monotonic()
    done = tracked_stream(graph, ids(8 * 16 + 3, 99), 120, Streamed())
    assert done.status == 200 and done.done, done
    rate = 120 / (time.monotonic() - t0)
    return int(min(360, max(120, 3.0 * rate)))


def sigterm_then_second_signal(graph) -> None:
    """SIGTERM with requests in flight, then an impatient second signal (SIGINT) once serve is
    stopping. In-flight requests complete, serve exits 0, no traceback in its output or any log,
    no process of the graph and no port is left."""
    pids = [graph.proc.pid] + [graph.worker_pid(w) for w in WORKERS]
    ports = [graph.worker_port(w) for w in WORKERS] + [int(graph.base_url.rsplit(":", 1)[1])]
    tracks = [Streamed() for _ in DRAIN_PROMPTS]
    tokens = drain_tokens(graph)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(tracked_stream, graph, p, tokens, t) for p, t in zip(DRAIN_PROMPTS, tracks)]
        # In flight: each stream delivered a token (the client's own count, which only grows; a
        # gauge polled on /metrics can miss requests that start and end between two scrapes).
        wait_until(
            "requests in flight",
            lambda: all(t.chunks >= 1 for t in tracks) or any(f.done() for f in futures),
            timeout=TIMEOUT,
            every=0.01,
        )
        graph.proc.send_signal(signal.SIGTERM)
        graph.wait_for(r"^stopping\.\.\.$", TIMEOUT)  # serve took the SIGTERM and is stopping the graph
        streaming = sum(not t.done for t in tracks)
        graph.proc.send_signal(signal.SIGINT)
        results = [f.result(timeout=TIMEOUT) for f in futures]
    summary = [(r.status, r.chunks, r.done, r.error, r.usage) for r in results]
    assert streaming, (
        f"every stream of {tokens} tokens had ended before the second signal: nothing was drained ({summary})"
    )
    cut = [
        (i, r.status, r.chunks, r.done, r.error, (r.usage or {}).get("completion_tokens"), round(r.seconds, 1))
        for i, r in enumerate(results)
        if not (r.status == 200 and r.done and r.error is None and r.usage and r.usage["completion_tokens"] == tokens)
    ]
    # Only the streams that were cut, so the reason is not lost to pytest's truncation.
    assert not cut, f"{len(cut)} of {len(results)} streams cut (index, status, chunks, done, error, tokens, s): {cut}"
    assert graph.proc.wait(timeout=90) == 0, "\n".join(graph.lines[-40:])
    out = "\n".join(graph.lines)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert_all_gone(pids, ports)


def test_sigterm_then_second_signal_drains_in_flight_and_exits_0(own_graph):
    sigterm_then_second_signal(own_graph)


@pytest.mark.slow
def test_a_new_graph_on_the_same_ssd_serves_the_drained_prefixes_from_disk(own_graph):
    """The SSD writes pending at the SIGTERM were flushed: a new graph on the same run directory
    re-adopts them and serves each drained prompt's full blocks as cache hits."""
    sigterm_then_second_signal(own_graph)
    again = _serve(own_graph.tmp)
    try:
        # The re-announced disk blocks reach the router: each worker that re-adopted blocks says it
        # announced them, and the frontend's router applied every event published.
        adopted = sum(disk_ready(again.worker_port(w)) > 0 for w in WORKERS)
        assert adopted, "no worker re-adopted a disk block"
        wait_until(
            "each re-adopting worker's announcement",
            lambda: sum(bool(re.search(r"announced \d+ re-adopted disk blocks", ln)) for ln in again.lines) >= adopted,
        )
        applied = events_applied(again.metrics["Frontend"], [again.metrics[w] for w in WORKERS])
        assert {status for _, status in applied} == {"ok"}, applied
        for p in DRAIN_PROMPTS:
            code, reply = post(again, {"prompt": p, "max_tokens": 1})
            assert code == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 16, reply
        assert sum(counts(again.worker_port(w))["disk_hits"] for w in WORKERS) >= 4 * 8 * 16
        again.proc.send_signal(signal.SIGINT)
        assert again.proc.wait(timeout=90) == 0
    finally:
        again.close()
