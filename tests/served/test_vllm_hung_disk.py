"""A served vLLM worker whose disk hangs (docs/HINTS.md: the demo's stalls), -m slow.

What froze the demo's workers: the kernel held the O_DIRECT completions of their disk writes for up
to 2 minutes; the host tier filled with blocks those writes lock; stores waited for host room;
vLLM kept the finished requests' device blocks until their stores finished, and with the device
full nothing was scheduled. Here the same graph as the demo's vLLM rows (agg_router_vllm, one
worker: 40 device blocks of 64 tokens, a 128-block host tier, an SSD tier) runs with the
slow_kv seam's hung disk (tests/helpers/slow_kv.py: every H2DISK write blocks while a file
exists), hung from the first request. Distinct prompts of 1,000-2,000 tokens, four at a time,
fill the host tier about three times over, and an early one comes back while the disk hangs:

* every request is answered within the bound a hung disk may cost (BOUND_S, from MAX_PUT_DEFER_S
  and the connector's load timeout), with the tokens and logprobs of the same graph without
  offload; the worker counts refused puts (vllm:flexkv_put_refused_blocks_total) with its host
  tier full and nothing landed on disk;
* the disk answers again (the file removed): the blocked writes land (every block stored on host
  is counted stored on disk), and the early prompt, asked again, loads and is exact.

Before the fixes (a put waiting for host room ends after MAX_PUT_DEFER_S; disk writes on threads
of their own) the requests stalled past the bound."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by scripts/install.sh"),
]
pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

import exactness  # noqa: E402
import vllm_graph as vg  # noqa: E402
from exactness import Generation  # noqa: E402
from served import total, wait_until  # noqa: E402
from slow_kv import HUNG_DISK_FILE, HUNG_DISK_HOOK  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

from dynamo_flexkv.bench.vllm_ttft import block_bytes  # noqa: E402
from dynamo_flexkv.core.manager import MAX_PUT_DEFER_S  # noqa: E402
from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings  # noqa: E402
from dynamo_flexkv.replay.configs import device_block_list  # noqa: E402
from dynamo_flexkv.replay.main import DEFAULT, HOST_GB  # noqa: E402

GRAPH = "agg_router_vllm"  # the demo's vLLM graph
BS = 64
MAX_TOKENS = 8
DEVICE_BLOCKS = device_block_list(DEFAULT.device_blocks)[0]  # the demo's 40
HOST_BLOCKS = round(HOST_GB["vllm"] * 2**30 / block_bytes(BS))  # the demo's host tier: 128 bf16 blocks
HOST_GB_F32 = HOST_BLOCKS * 2 * block_bytes(BS) / 2**30  # the same 128 blocks in float32 (the exact dtype)
CONCURRENCY = 4
# What a hung disk may cost one request: it waits for device blocks that at most the other
# requests in flight hold, each until its put ends (MAX_PUT_DEFER_S after it began to wait for host
# room), then for its own load (load_timeout_s, then recomputed); the last MAX_PUT_DEFER_S is for
# computing the requests themselves on a busy machine. Without the fixes a request waits for the disk.
LOAD_TIMEOUT_S = ConnectorSettings.load_timeout_s
BOUND_S = CONCURRENCY * MAX_PUT_DEFER_S + LOAD_TIMEOUT_S

LENGTHS = [1000 + (i * 389) % 1001 for i in range(20)]  # 1,000-2,000 tokens, 450 full blocks in all
PROMPTS = [vg.tokens(7000 + i, n) for i, n in enumerate(LENGTHS)]
EARLY = PROMPTS[0]  # stored on host before the host tier fills; asked again while the disk hangs
REPEAT_AT = 10  # and then pushed out of vLLM's device cache by the prompts after it
SENT = PROMPTS[:REPEAT_AT] + [EARLY] + PROMPTS[REPEAT_AT:]
PROBE = vg.tokens(7999, 8)  # no full block: nothing to store; its steps refresh the worker's metrics
MAX_LEN = -(-(max(LENGTHS) + MAX_TOKENS) // BS) * BS


def sets(tmp: Path, name: str) -> list[str]:
    return [
        "Frontend.http-port=0",
        *exactness.serve_sets(),
        "VllmWorker.replicas=1",
        f"VllmWorker.num-device-blocks={DEVICE_BLOCKS}",
        f"VllmWorker.max-model-len={MAX_LEN}",
        f"VllmWorker.cache.cpu_cache_gb={HOST_GB_F32}",
        f"VllmWorker.cache.ssd_cache_dir={tmp}/{name}/ssd{{replica}}",
    ]


@dataclass
class Answer:
    prompt: list[int]
    result: dict | None = None  # vg.complete's
    error: str = ""  # or why there is none (past BOUND_S: a timeout)
    seconds: float = 0.0


def send_all(base_url: str, prompts: list[list[int]]) -> list[Answer]:
    """Sends ``prompts`` CONCURRENCY at a time, each given BOUND_S; after the first that fails, the
    ones not sent yet are not sent (their error says so): a stalled worker fails the test in one
    bound, not in one per request."""
    failed = threading.Event()

    def one(prompt: list[int]) -> Answer:
        out = Answer(prompt)
        if failed.is_set():
            out.error = "not sent: an earlier request failed"
            return out
        t0 = time.monotonic()
        try:
            out.result = vg.complete(base_url, prompt, MAX_TOKENS, timeout=BOUND_S)
        except (urllib.error.HTTPError, OSError) as e:  # a socket timeout: no answer within BOUND_S
            out.error = f"{type(e).__name__}: {e}"
            failed.set()
        out.seconds = time.monotonic() - t0
        return out

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-hung-disk")


@pytest.fixture(scope="module")
def baseline(tmp) -> dict[tuple, Generation]:
    serve = VllmServe(tmp, "baseline", "VllmWorker.offload=false", graph=GRAPH, base=sets(tmp, "baseline"))
    try:
        return {tuple(p): vg.complete(serve.base_url, p, MAX_TOKENS)["gen"] for p in PROMPTS}
    finally:
        serve.close()


class Worker:
    """The offload graph's one worker, its disk hung while ``hung`` exists."""

    def __init__(self, tmp: Path) -> None:
        self.hung = tmp / "disk-hung"
        self.hung.touch()  # hung from the first write
        self.serve = VllmServe(
            tmp,
            "offload",
            f"VllmWorker.connector.mover_hook={HUNG_DISK_HOOK}",
            graph=GRAPH,
            base=sets(tmp, "offload"),
            env=dict(os.environ, **{HUNG_DISK_FILE: str(self.hung)}),
        )
        self.name = next(n for n in self.serve.metrics if n.startswith("VllmWorker"))

    def metrics(self) -> str:
        """The worker's /metrics after a step of a probe request: the connector's counters and
        gauges reach them from its steps (at most once a second), and an idle worker takes none."""
        vg.complete(self.serve.base_url, PROBE, 1, timeout=BOUND_S)
        return vg.scrape(self.serve.metrics[self.name])

    def close(self) -> None:
        self.hung.unlink(missing_ok=True)
        self.serve.close()


def value(text: str, name: str, **labels: str) -> float:
    return total(text, f"vllm:flexkv_{name}", **labels)


def test_a_hung_disk_costs_a_served_vllm_worker_no_request_and_its_writes_land_when_it_answers(tmp, baseline):
    w = Worker(tmp)
    try:
        t0 = time.monotonic()
        answers = send_all(w.serve.base_url, SENT)
        phase_s = time.monotonic() - t0
        slowest = max(answers, key=lambda a: a.seconds)
        repeat = answers[REPEAT_AT].result or {}
        print(
            f"\n{len(SENT)} requests ({CONCURRENCY} at a time) with the disk hung: {phase_s:.0f} s, the slowest "
            f"{slowest.seconds:.1f} s (bound {BOUND_S:.0f} s); seconds: {[round(a.seconds, 1) for a in answers]}; "
            f"the early prompt's repeat cached {repeat.get('cached')} tokens"
        )
        failed = [f"{len(a.prompt)} tokens: {a.error}" for a in answers if a.error]
        assert failed == [], f"{len(failed)} of {len(SENT)} requests got no answer within {BOUND_S:.0f} s: {failed}"
        assert slowest.seconds <= BOUND_S
        full = (len(EARLY) - 1) // BS * BS  # vLLM computes a prompt's last token: its block is never cached
        assert repeat["cached"] == full  # loaded from host: no load waits behind the hung writes
        exactness.assert_exact(
            {i: a.result["gen"] for i, a in enumerate(answers) if a.result},
            {i: baseline[tuple(p)] for i, p in enumerate(SENT)},
            "every request with the disk hung",
        )

        # The demo's mechanism, reproduced: the host tier full of blocks the hung writes lock, none
        # landed on disk, and puts that found no room refused after their wait. The stores filled the
        # host tier three times over once the last puts' waits are over (the answers come before them).
        def refused_counted() -> str | None:
            t = w.metrics()
            refused = value(t, "put_refused_blocks_total")
            return t if refused and refused + value(t, "stored_blocks_total", tier="host") >= 3 * HOST_BLOCKS else None

        hung = wait_until("refused puts counted while the disk hangs", refused_counted, timeout=BOUND_S, every=0.5)
        host = {s: value(hung, "pool_blocks", tier="host", state=s) for s in ("capacity", "used")}
        stored_host = value(hung, "stored_blocks_total", tier="host")
        refused = value(hung, "put_refused_blocks_total")
        print(
            f"while hung: host tier {host['used']:.0f}/{host['capacity']:.0f} blocks used, {stored_host:.0f} "
            f"stored on host, {refused:.0f} refused, "
            f"{value(hung, 'stored_blocks_total', tier='disk'):.0f} landed on disk"
        )
        assert host["capacity"] == HOST_BLOCKS and host["used"] == HOST_BLOCKS
        assert value(hung, "stored_blocks_total", tier="disk") == 0

        # The disk answers again: the blocked writes land, and the early prompt still loads exact.
        t0 = time.monotonic()
        w.hung.unlink()

        def landed() -> str | None:
            t = w.metrics()
            stored = value(t, "stored_blocks_total", tier="host")
            done = value(t, "tasks_in_flight") == 0 and value(t, "stored_blocks_total", tier="disk") == stored
            return t if done else None

        after = wait_until("the blocked disk writes landed", landed, timeout=BOUND_S, every=0.5)
        on_disk = value(after, "stored_blocks_total", tier="disk")
        print(f"the disk answered: {on_disk:.0f} blocks landed on disk within {time.monotonic() - t0:.1f} s")
        assert on_disk >= stored_host and value(after, "disk_write_failures_total") == 0
        before = vg.loaded(after)
        again = vg.complete(w.serve.base_url, EARLY, MAX_TOKENS, timeout=BOUND_S)
        loaded = sum(vg.loaded(vg.scrape(w.serve.metrics[w.name])).values()) - sum(before.values())
        print(f"the early prompt again: {again['cached']} tokens cached, {loaded:.0f} loaded by the connector")
        assert again["cached"] == full and loaded == full
        exactness.assert_exact({0: again["gen"]}, {0: baseline[tuple(EARLY)]}, "the early prompt, the disk back")
    finally:
        w.close()
    assert w.serve.proc.returncode == 0, "\n".join(w.serve.lines[-40:])
    assert vg.ours_left(w.serve.run) == []
