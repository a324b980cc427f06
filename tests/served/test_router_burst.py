"""Bursts of long prompts on the served agg_router graph (Dynamo's frontend with its KV router, two
workers, events through the launcher's ZMQ broker): no process may log that an event batch was
dropped or that an event named a block (or parent) the router never learned about."""

import concurrent.futures
import itertools
import random
import time

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from served import (
    CONTRADICTIONS,
    assert_gone,
    complete,
    make_plan,
)
from vllm_graph import RouterProbe

from dynamo_flexkv.serve.launcher import Launcher

BS = 16  # the tiny preset's block


def assert_no_contradiction(launcher: Launcher) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in launcher.log_dir.iterdir() if p.is_file()}
    assert "Frontend.log" in logs and "FlexKVWorker-0.log" in logs, sorted(logs)
    for name, text in logs.items():
        for phrase in CONTRADICTIONS:
            assert phrase not in text, (name, [line for line in text.splitlines() if phrase in line][:3])


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        rng.choice(("cache", "block", "prefix", "router", "tier", "disk", "host", "event")) + str(rng.randrange(100))
        for _ in range(n)
    )


def seen(probe: RouterProbe, ids, timeout: float) -> float | None:
    """Seconds until the probe router counted every full block of ``ids`` on one worker, in any
    tier (their KV events reached it); None if it did not within ``timeout`` seconds."""
    t0 = time.monotonic()
    while True:
        if max((disk for _, _, disk in probe.scores(ids).values()), default=0) >= len(ids) // BS:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.02)


def test_bursts_of_long_prompts_leave_no_contradiction_in_any_log(tmp_path):
    plan = make_plan(tmp_path, "agg_router", "FlexKVWorker.num-device-blocks=192")
    rng = random.Random(0)
    system = words(rng, 80)  # ~600 tokens (about 7.7 tokens a word)
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        # The frontend's router learns where a reply's blocks are from KV events, which travel apart
        # from the reply (the worker's relay, its Dynamo publisher, the ZMQ broker): a repeat sent the
        # moment the replies are back can be routed before they arrived. A second KV router on the
        # graph's event plane (it routes nothing) says when they did.
        from tokenizers import Tokenizer

        encode = Tokenizer.from_file(str(plan.run_dir / "model" / "tokenizer.json")).encode
        probe = RouterProbe(
            launcher.running["Frontend"].pid,
            tmp_path / "router-probe.log",
            endpoint="dynamo.flexkv.generate",
            block_size=BS,
        )
        try:
            # It learns only from events published once its subscription reached the broker: a
            # short prompt it sees says it did (another one if its events went before that).
            for i in itertools.count():
                warm = f"warm-up {i} " + words(random.Random(i), 8)
                complete(plan, warm, 1)
                if seen(probe, encode(warm).ids, 2) is not None:
                    break
                assert i < 30, "the probe router sees no KV event of the graph"
            sent, tokens = [], 0
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                for _burst in range(2):  # each burst overfills both workers' 192-block device caches
                    prompts = [system + " " + words(rng, 180) for _ in range(4)] + [words(rng, 260) for _ in range(2)]
                    replies = list(pool.map(lambda p: complete(plan, p, 2), prompts))
                    assert min(r["usage"]["prompt_tokens"] for r in replies) > 1500  # thousands of tokens each
                    tokens += sum(r["usage"]["prompt_tokens"] for r in replies)
                    sent += prompts
            assert tokens > 2 * 2 * 192 * 16  # twice what both device caches hold: they evicted
            # The router's view stayed true: a repeat of the newest prompt, once its KV events
            # arrived, goes where its KV is.
            ids = encode(sent[-1]).ids
            waited = seen(probe, ids, 30)
            assert waited is not None, f"no router learned of the newest prompt's blocks: {probe.scores(ids)}"
            again = complete(plan, sent[-1], 2)
            assert again["usage"]["prompt_tokens"] == len(ids)  # the frontend tokenized it as we did
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 64, (
                again["usage"],
                f"the probe router saw its blocks {waited:.2f} s after the replies",
                probe.scores(ids),
            )
        finally:
            probe.close()
    assert_no_contradiction(launcher)
    assert_gone(launcher)


@pytest.mark.slow
def test_replay_of_hundreds_of_requests_leaves_no_contradiction_in_any_log(tmp_path):
    """Issue: a concurrency-1 replay of 120 requests left over 10,000 'Failed to find block to
    remove' warnings. Now: a few hundred multi-turn requests of the conversation trace through the
    agg_router graph with small device caches (constant eviction), and not one such line."""
    from dynamo_flexkv.replay.client import Replayer
    from dynamo_flexkv.workload import Scale, trace_turns

    turns = trace_turns(
        Scale(conversations=100, max_turns=4, tokens_per_hash_block=16, max_prompt_tokens=900, max_output_tokens=2)
    )
    assert len(turns) >= 250
    plan = make_plan(tmp_path, "agg_router")  # 64 device blocks (1,024 tokens) per worker
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        records = Replayer(plan.base_url, plan.served_model_name, concurrency=2).run(turns, time_scale=1e6)
    assert [r.error for r in records if r.error] == []
    assert sum(r.cached_tokens for r in records) > 0  # later turns reused earlier ones' KV
    assert_no_contradiction(launcher)
    assert_gone(launcher)
