"""Hostile input at the edge of a served graph (agg_router: Dynamo's real frontend with the KV
router and two of our workers, started by the launcher), driven over HTTP as an outside user
would: prompts longer than every offload tier, prompts beyond the context window, empty prompts,
bad max_tokens, malformed or truncated bodies, wrong types, unknown models and fields, token ids
out of range, and a hundred streaming clients that hang up after their first chunk. Each case gets
a 4xx whose message names what is wrong, or a correct answer (the same tokens as the same greedy
request sent again); nothing answers 5xx or hangs; afterwards both workers are alive, never
restarted, and back to idle (no device block in use, no offload task in flight, every host/disk
block that is used is also ready, i.e. no lock left).

What Dynamo 1.6.1's frontend does before our worker sees a request (docs/LIMITATIONS.md) is pinned
as it is today: each such test asserts the exact reply, names the upstream defect and its
consequence, and fails if the behaviour changes in either direction (fixed upstream, or worse).
The tests share one graph, in any order: after each one, a check that both workers are alive,
never restarted and idle."""

import asyncio
import json
import re
import socket
import time

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
aiohttp = pytest.importorskip("aiohttp")

from served import MODEL, TIMEOUT, flexkv_metrics, make_plan, post, send  # noqa: E402
from sse import DONE, sse_data  # noqa: E402

from dynamo_flexkv.core.http_client import http_json  # noqa: E402
from dynamo_flexkv.serve.launcher import Launcher  # noqa: E402

BLOCK = 16  # tokens per block of the tiny preset
DEVICE_BLOCKS = 64  # context window 64 x 16 = 1,024 tokens
WINDOW = DEVICE_BLOCKS * BLOCK
VOCAB = 512
# 8 KiB per tiny block: the host tier holds 32 blocks, the disk tier 52; a 62-block prompt fits
# in the context window but in neither offload tier.
HOST_GB, DISK_GB = 0.00025, 0.0004
LONG_BLOCKS = 62


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    plan = make_plan(
        tmp,
        "agg_router",
        f"FlexKVWorker.num-device-blocks={DEVICE_BLOCKS}",
        f"FlexKVWorker.cache.cpu_cache_gb={HOST_GB}",
        f"FlexKVWorker.cache.ssd_cache_gb={DISK_GB}",
    )
    launcher = Launcher(plan)
    try:
        launcher.start()
        launcher.wait_ready(180)
        yield plan, launcher
    finally:
        launcher.shutdown()


def stream(plan, body: dict, path: str = "/v1/completions") -> tuple[int, list]:
    """(status, the parsed `data:` events before [DONE]) of a streaming request."""
    code, text = send(plan, path, json.dumps({"model": MODEL, **body, "stream": True}).encode())
    if code != 200:
        return code, [json.loads(text)]
    events = list(sse_data(text.splitlines()))
    assert events and events[-1] is DONE, text
    return code, events[:-1]


def answer(plan, prompt, max_tokens: int, chat: bool = False, streaming: bool = False) -> tuple[str, str]:
    """(text, finish_reason) of a greedy request that must succeed."""
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0)
    if not streaming:
        code, r = post(plan, body, path)
        assert code == 200, r
        choice = r["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    code, events = stream(plan, body, path)
    assert code == 200 and all("error" not in e for e in events), events
    text, finish = "", None
    for e in events:
        for c in e.get("choices", []):
            text += (c["delta"].get("content") or "") if chat else c.get("text", "")
            finish = c.get("finish_reason") or finish
    return text, finish


def long_prompt(seed: int, blocks: int = LONG_BLOCKS) -> list:
    return [(seed * 131 + i * 7) % (VOCAB - 1) + 1 for i in range(blocks * BLOCK)]


# --- prompts longer than every offload tier, and beyond the context window -------------------------


def test_prompt_beyond_every_tier_is_answered_correctly_and_tiers_evict(graph):
    plan, _ = graph
    before = [flexkv_metrics(w.port) for w in plan.workers]
    first = answer(plan, long_prompt(0), 8)
    # Three more such prompts: some worker gets two of them, so its host and disk tiers evict.
    for seed in (1, 2, 3):
        answer(plan, long_prompt(seed), 4, streaming=seed == 2)
    assert answer(plan, long_prompt(0), 8) == first  # greedy: the same tokens, whatever tier served it
    assert answer(plan, long_prompt(0), 8, streaming=True) == first
    after = [flexkv_metrics(w.port) for w in plan.workers]
    for t in ("host", "disk"):
        evicted = sum(
            a[f'flexkv_evicted_blocks_total{{tier="{t}"}}'] - b[f'flexkv_evicted_blocks_total{{tier="{t}"}}']
            for a, b in zip(after, before)
        )
        assert evicted > 0, (t, after)
        for a in after:
            assert (
                a[f'flexkv_pool_blocks{{state="used",tier="{t}"}}']
                <= a[f'flexkv_pool_blocks{{state="capacity",tier="{t}"}}']
            )


def test_long_chat_is_answered_correctly(graph):
    plan, _ = graph
    content = " ".join(f"w{i % 97}" for i in range(120))  # ~450 tokens, within the window
    first = answer(plan, content, 6, chat=True)
    assert answer(plan, content, 6, chat=True, streaming=True) == first


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [i % (VOCAB - 1) + 1 for i in range(WINDOW + 6)], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "ab " * 1100, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 1100}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "x" * 200_000, "max_tokens": 2}),
    ],
    ids=["token-ids", "text", "chat", "text-200k"],
)
def test_prompt_beyond_the_window_is_refused_naming_the_limit(graph, path, body):
    plan, _ = graph
    code, reply = post(plan, body, path)
    assert code == 400, reply
    assert re.search(rf"prompt has [0-9,]+ tokens; this model's context window is {WINDOW:,}", reply["message"]), reply


def test_streamed_prompt_beyond_the_window_gets_a_400_naming_the_limit(graph):
    """serve has the frontend wait for a stream's first event before it commits a status
    (DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS), so the worker's refusal is a 400, not 200 + an SSE error."""
    plan, _ = graph
    code, events = stream(plan, {"prompt": [i % (VOCAB - 1) + 1 for i in range(WINDOW + 6)], "max_tokens": 2})
    assert code == 400, events
    assert f"context window is {WINDOW:,}" in events[0]["message"], events


# --- bad fields ----------------------------------------------------------------------------------------

REFUSALS = {  # id: (path, body without model, status, what the message must contain)
    "empty-prompt": ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "Prompt string cannot be empty"),
    "empty-id-list": ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "cannot be empty"),
    "empty-messages": (
        "/v1/chat/completions",
        {"messages": [], "max_tokens": 4},
        400,
        "'messages' field cannot be empty",
    ),
    "max-tokens-0": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        400,
        "Max tokens must be greater than 0, got 0",
    ),
    "chat-max-tokens-0": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
        "Max tokens must be greater than 0",
    ),
    "max-tokens-negative": ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "`-5`"),
    "max-tokens-over-window": (
        "/v1/completions",
        {"prompt": [1, 2, 3], "max_tokens": 2 * WINDOW},
        400,
        f"exceeds this model's context window of {WINDOW:,}; use max_tokens <= {WINDOW - 3:,}",
    ),
    "chat-max-tokens-over-window": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2 * WINDOW},
        400,
        f"context window of {WINDOW:,}; use max_tokens <=",
    ),
    "max-tokens-huge": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**8}, 400, "Max tokens must not exceed"),
    "max-tokens-beyond-u32": ("/v1/completions", {"prompt": "hi", "max_tokens": 2**40}, 400, "expected u32"),
    "max-tokens-float": ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "`2.5`"),
    "max-tokens-string": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, '"ten"'),
    "prompt-number": ("/v1/completions", {"prompt": 5, "max_tokens": 2}, 400, "Prompt"),
    "prompt-negative-id": ("/v1/completions", {"prompt": [1, -2, 3], "max_tokens": 2}, 400, "Prompt"),
    "prompt-id-beyond-u32": ("/v1/completions", {"prompt": [1, 2**40, 3], "max_tokens": 2}, 400, "Prompt"),
    "messages-string": ("/v1/chat/completions", {"messages": "hi", "max_tokens": 2}, 400, "expected a sequence"),
    "message-without-role": (
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}], "max_tokens": 2},
        400,
        "missing field `role`",
    ),
    "message-unknown-role": (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2},
        400,
        "unknown variant `wizard`",
    ),
    "unknown-field": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "frobnicate": 1},
        400,
        "Unsupported parameter(s): `frobnicate`",
    ),
    "chat-unknown-field": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frob": True},
        400,
        "`frob`",
    ),
    "n": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 3}, 400, "n=3 is not supported"),
    "max-completion-tokens-over-window": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
        400,
        f"context window of {WINDOW:,}; use max_tokens <=",
    ),
    "max-completion-tokens-0": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "Max completion tokens must be greater than 0",
    ),
    "temperature-negative": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "temperature": -1},
        400,
        "Temperature must be between 0 and 2, got -1",
    ),
    "temperature-string": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": "hot"}, 400, '"hot"'),
    "stream-string": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": "yes"}, 400, "expected a boolean"),
    "empty-stop": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "stop": [""]},
        400,
        "Stop sequence at index 0 cannot be empty",
    ),
    "batch-with-empty-prompt": (
        "/v1/completions",
        {"prompt": [[1, 2], []], "max_tokens": 2},
        400,
        "Prompt integer array at index 1 cannot be empty",
    ),
    "batch-too-large": (
        "/v1/completions",
        {"prompt": [[i + 1, 2] for i in range(200)], "max_tokens": 2},
        400,
        "exceeds maximum of 128",
    ),
    "batch-member-over-window": (
        "/v1/completions",
        {"prompt": [[1, 2], [3] * 2 * WINDOW], "max_tokens": 2},
        400,
        f"context window is {WINDOW:,}",
    ),
    "min-tokens": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens=5 is not supported",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_field_is_refused_naming_it(graph, case):
    plan, _ = graph
    path, body, status, message = REFUSALS[case]
    code, reply = post(plan, body, path)
    assert code == status and message in reply["message"], reply


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ],
    ids=["completions", "chat"],
)
def test_unknown_model_is_404(graph, path, body):
    plan, _ = graph
    code, text = send(plan, path, json.dumps({"model": "no-such-model", **body}).encode())
    assert code == 404 and "Model not found" in json.loads(text)["message"], text


@pytest.mark.parametrize(
    "raw, content_type, status, message",
    [
        (b'{"model": "flexkv-tiny", "prompt": "hi",', "application/json", 400, "EOF while parsing"),
        (b"hello", "application/json", 400, "expected value at line 1 column 1"),
        (b"[1, 2]", "application/json", 400, "expected struct"),
        (b'{"prompt": "hi", "max_tokens": 2}', "application/json", 400, "missing field `model`"),
        (
            b'{"model": "flexkv-tiny", "prompt": "hi", "max_tokens": 2}',
            "text/plain",
            415,
            "Content-Type application/json",
        ),
        (b'{"model": "flexkv-tiny", "prompt": "hi", "max_tokens": 2}', None, 415, "Content-Type application/json"),
    ],
    ids=["truncated-json", "not-json", "json-array", "no-model", "text-plain", "no-content-type"],
)
def test_malformed_body_is_refused_naming_it(graph, raw, content_type, status, message):
    plan, _ = graph
    code, text = send(plan, "/v1/completions", raw, content_type)
    assert code == status and message in json.loads(text)["message"], text


def test_body_shorter_than_its_content_length_is_refused(graph):
    plan, _ = graph
    host, port = plan.base_url.split("//")[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) + 20) + body[:30]
        )
        s.shutdown(socket.SHUT_WR)  # the client gives up mid-body
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and b"Failed to read request body" in reply, reply


def test_echo_is_refused_naming_echo(graph):
    plan, _ = graph
    code, reply = post(plan, {"prompt": "hi", "max_tokens": 2, "echo": True})
    assert code == 400 and "echo" in reply["message"], reply


# What Dynamo 1.6.1's frontend answers for a request it refuses itself, before any worker: a 400 whose
# message names nothing (neither the field nor the limit).
BARE_INVALID_REQUEST = {"message": "Invalid request", "type": "Bad Request", "code": 400}


def test_image_content_is_refused_by_the_frontend_with_a_bare_invalid_request(graph):
    """Upstream defect (Dynamo 1.6.1's frontend): an image part for this text-only model is refused
    before the worker with a bare 'Invalid request' that does not say the image is the problem.
    Consequence: the client learns neither what was wrong nor what to change. Our worker would
    name it, but never sees the request. Pinned as it is: this fails once the frontend names the
    image (then assert that it does) or stops refusing it (then the worker must)."""
    plan, _ = graph
    code, reply = post(
        plan,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}
            ],
            "max_tokens": 2,
        },
        "/v1/chat/completions",
    )
    assert (code, reply) == (400, BARE_INVALID_REQUEST)


# --- token-id prompts ------------------------------------------------------------------------------------


def test_token_ids_at_the_vocabulary_edges_are_served(graph):
    plan, _ = graph
    first = answer(plan, [0, VOCAB - 1, 3, 0], 4)
    assert answer(plan, [0, VOCAB - 1, 3, 0], 4, streaming=True) == first


@pytest.mark.parametrize("stream_it", [False, True], ids=["plain", "stream"])
def test_token_id_beyond_the_vocabulary_is_refused_by_the_frontend_with_a_bare_invalid_request(graph, stream_it):
    """Upstream defect (Dynamo 1.6.1's frontend): token ids >= config.json's vocab_size are refused
    by the frontend itself with a bare 'Invalid request' that names neither the id nor the
    vocabulary, streaming or not. Consequence: the client cannot tell which id is wrong; the
    worker's own check (`token id 600 at position 2 is outside this model's vocabulary (ids 0 to
    511)`, docs/SERVING.md) covers every other path but never sees these. Pinned as it is: this
    fails if the frontend starts naming the id or lets the request through."""
    plan, _ = graph
    code, text = send(
        plan,
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": [1, 2, VOCAB + 88], "max_tokens": 2, "stream": stream_it}).encode(),
    )
    assert (code, json.loads(text)) == (400, BARE_INVALID_REQUEST), text


def test_batch_of_token_id_prompts_answers_each_prompt(graph):
    """A list of prompts is a batch (OpenAI): one choice per prompt, each the prompt's own answer."""
    plan, _ = graph
    prompts = [[5, 6, 7, 8, 9], [300, 301, 302]]
    code, r = post(plan, {"prompt": prompts, "max_tokens": 4, "temperature": 0})
    assert code == 200, r
    by_index = {c["index"]: (c["text"], c["finish_reason"]) for c in r["choices"]}
    assert by_index == {i: answer(plan, p, 4) for i, p in enumerate(prompts)}


# --- a hundred clients that hang up mid-stream, among normal ones ----------------------------------------

HANGUPS = 100


def _hangup_prompt(i: int) -> list:
    if i % 20 == 0:  # a prefix the long-prompt test left in host/disk: aborted while its load is in flight
        return long_prompt(i // 20 % 4)[: 40 * BLOCK] + [i + 1]
    return [i % 400 + 1] * 24 + [7, 8, 9, i % 50 + 1]


async def _hang_up_after_first_chunk(session, url: str, i: int) -> bool:
    body = {"model": MODEL, "prompt": _hangup_prompt(i), "max_tokens": 200, "stream": True}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data:"):
                resp.close()  # drop the connection mid-stream
                return True
    return False  # the stream ended before a chunk came: fails below


async def _complete(session, url: str, prompt: list) -> tuple[str, str]:
    async with session.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}) as resp:
        assert resp.status == 200, await resp.text()
        choice = (await resp.json())["choices"][0]
        return choice["text"], choice["finish_reason"]


async def _storm(plan, normal_prompts: list) -> tuple[list, list]:
    url = plan.base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        hangups = [_hang_up_after_first_chunk(session, url, i) for i in range(HANGUPS)]
        normal = [_complete(session, url, p) for p in normal_prompts]
        results = await asyncio.gather(*hangups, *normal)
    return list(results[:HANGUPS]), list(results[HANGUPS:])


def _finished(plan) -> tuple[float, float]:
    """(aborted, completed) requests over all workers."""
    ms = [flexkv_metrics(w.port) for w in plan.workers]
    return (sum(m["flexkv_requests_aborted_total"] for m in ms), sum(m["flexkv_requests_total"] for m in ms))


def test_hundred_clients_hanging_up_mid_stream_leave_normal_clients_served(graph):
    plan, _ = graph
    normal_prompts = [[(31 * k + i) % 500 + 1 for i in range(40 + k)] for k in range(10)]
    aborted0, done0 = _finished(plan)
    hung_up, normal = asyncio.run(asyncio.wait_for(_storm(plan, normal_prompts), 2 * TIMEOUT))
    assert all(hung_up), hung_up.count(False)
    # Every hung-up stream is aborted within seconds (the random model may end one by itself with its
    # end-of-text token before its client left: those count as completed).
    deadline = time.monotonic() + 5
    while True:
        aborted, done = _finished(plan)
        aborted, done = aborted - aborted0, done - done0 - len(normal_prompts)
        if aborted + done == HANGUPS:
            break
        assert time.monotonic() < deadline, (aborted, done)
        time.sleep(0.1)
    # How many finish their 200 tokens before the frontend's cancel reaches the worker depends on
    # the machine's load (idle: 90+ aborted; under two CPU burners 83): a broken abort path gives none.
    assert aborted >= HANGUPS // 2, (aborted, done)
    # The same requests again, on a quiet graph, give the same tokens.
    assert normal == [answer(plan, p, 24) for p in normal_prompts]


# --- after each test: every worker alive, never restarted, and idle ------------------------------------


def assert_alive_and_idle(plan, launcher) -> None:
    assert not launcher.deaths and not launcher.restarts, (launcher.deaths, launcher.restarts)
    for w in plan.workers:
        assert launcher.running[w.name].poll() is None, w.name
        assert http_json(f"http://127.0.0.1:{w.port}/health", timeout=10).get("status") == "ready", w.name
    deadline = time.monotonic() + 5
    for w in plan.workers:
        while True:
            m = flexkv_metrics(w.port)
            busy = {
                k: v
                for k, v in m.items()
                if k in ('flexkv_device_blocks{state="used"}', "flexkv_tasks_in_flight") and v != 0
            }
            for t in ("host", "disk"):
                used, ready = (
                    m[f'flexkv_pool_blocks{{state="used",tier="{t}"}}'],
                    m[f'flexkv_pool_blocks{{state="ready",tier="{t}"}}'],
                )
                if used != ready:
                    busy[f"{t} used {used} != ready {ready}"] = used
            if not busy:
                break
            assert time.monotonic() < deadline, (w.name, busy)
            time.sleep(0.1)


@pytest.fixture(autouse=True)
def _left_alive_and_idle(request):
    """After each test on the shared graph, whichever ran before it."""
    graph = request.getfixturevalue("graph") if "graph" in request.fixturenames else None
    yield
    if graph is not None:
        assert_alive_and_idle(*graph)


def test_workers_alive_and_back_to_idle(graph):
    assert_alive_and_idle(*graph)
    assert answer(graph[0], "still serving after all that", 4)[1] in ("stop", "length")
