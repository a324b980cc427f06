"""Issue 48: a weight update through Dynamo 1.6.1's RL routes (``dynamo.vllm --enable-rl``) must not
leave the connector's tiers serving KV computed with the old weights.

serve graphs/agg_vllm.py with the small preset's seeded weights A (float32, the exactness oracle's
setting), host and disk tiers, a small device cache; a 1,500-token prompt P cached and pushed off
the device; then, on the worker's system port, ``/engine/pause_generation``,
``/engine/update_weights_from_disk {"model_path": B}``, ``/engine/resume_generation``; P again
must be computed (no cached token), give the tokens of a fresh engine with weights B, and the
router's view of the worker must hold none of P's old blocks. A restart of the worker with weights
B on the same disk directory must start and adopt no old block. Also records what
``flush_cache`` and ``control/sleep`` + ``control/wake_up`` do to the tiers."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import pytest

import exactness
import vllm_graph as vg
from vllm_graph import VllmServe

GRAPH = "agg_vllm"
BS = 64
P = vg.tokens(4801, 1500)  # 23 full blocks: 1,472 tokens the tiers can hold
FILLERS = [vg.tokens(4900 + j, 1500) for j in range(3)]  # 72 blocks: P leaves the 56-block device cache
MAX_TOKENS = 8
RL = '["--enable-rl"]'


def weights(path: Path, seed: int) -> Path:
    """The small preset's model directory with its seeded weights of ``seed``."""
    from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir, write_seeded_weights

    cfg = EngineModelConfig.load("small")
    write_model_dir(cfg, path, context_length=4096)
    write_seeded_weights(cfg, path, seed=seed)
    return path


def sets(tmp: Path, model: Path, ssd: Path, offload: bool = True) -> List[str]:
    return [
        "Frontend.http-port=0",
        f"Common.model={model}",
        *exactness.serve_sets(),
        f"VllmWorker.offload={str(offload).lower()}",
        f"VllmWorker.extra-args={RL}",
        f"VllmWorker.cache.ssd_cache_dir={ssd}",
        "VllmWorker.num-device-blocks=56",
        "VllmWorker.max-model-len=3072",
        "VllmWorker.cache.cpu_cache_gb=0.05",
        "VllmWorker.cache.ssd_cache_gb=0.2",
        "VllmWorker.on-death=stop",
    ]


def engine(serve: VllmServe, route: str, body: dict, timeout: float = 300) -> dict:
    """POST /engine/<route> on the worker's system port (the host:port of its metrics URL)."""
    base = serve.metrics[worker(serve)].rsplit("/", 1)[0]
    req = urllib.request.Request(
        f"{base}/engine/{route}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def worker(serve: VllmServe) -> str:
    """The graph's one vLLM worker's name in serve's list."""
    (name,) = [n for n in serve.metrics if n.startswith("VllmWorker")]
    return name


def ask(serve: VllmServe, prompt: List[int]) -> dict:
    r = vg.complete(serve.base_url, prompt, MAX_TOKENS)
    assert len(r["ids"]) == MAX_TOKENS, r
    return r


def push_off_device(serve: VllmServe) -> None:
    for f in FILLERS:
        ask(serve, f)


def frontend_pid(serve: VllmServe) -> int:
    for pid in serve.children:
        if b"dynamo.frontend" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
    raise AssertionError("no frontend among serve's children")


@pytest.mark.slow
@pytest.mark.served
def test_a_weight_update_through_the_rl_routes_leaves_no_old_kv_in_the_tiers(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    a, b = weights(tmp_path / "A", 0), weights(tmp_path / "B", 1)
    ssd = tmp_path / "ssd"
    record: Dict[str, object] = {}

    # The oracle: a fresh engine with weights B, no offload.
    fresh = VllmServe(tmp_path, "fresh-b", graph=GRAPH, base=sets(tmp_path, b, tmp_path / "ssd-fresh", offload=False))
    try:
        oracle = {tuple(P): ask(fresh, P)["gen"]}
    finally:
        fresh.close()

    serve = VllmServe(tmp_path, "rl", graph=GRAPH, base=sets(tmp_path, a, ssd))
    probe = None
    try:
        probe = vg.RouterProbe(frontend_pid(serve), tmp_path / "probe.log", block_size=BS)
        wid = vg.worker_id(vg.scrape(serve.metrics[worker(serve)]))
        first = ask(serve, P)
        push_off_device(serve)
        again = ask(serve, P)  # from the tiers, weights A
        record["P with weights A, again"] = again["cached"]
        assert again["cached"] >= len(P) // BS * BS - BS, again  # the tiers work before the update

        # flush_cache: Dynamo's reset_prefix_cache() without reset_connector
        record["flush_cache"] = engine(serve, "flush_cache", {})
        push_off_device(serve)
        record["P after flush_cache (weights A)"] = ask(serve, P)["cached"]
        # sleep + wake_up: the CPU worker ignores both, but vLLM's engine pauses with clear_cache, which
        # resets the connector (reset_prefix_cache(reset_connector=True)): the tiers are dropped
        record["control/sleep"] = engine(serve, "control/sleep", {"level": 1})
        record["control/wake_up"] = engine(serve, "control/wake_up", {})
        push_off_device(serve)
        record["P after sleep + wake_up (weights A)"] = ask(serve, P)["cached"]

        record["pause_generation"] = engine(serve, "pause_generation", {})
        t0 = time.monotonic()
        record["update_weights_from_disk"] = engine(
            serve, "update_weights_from_disk", {"model_path": str(b), "weight_version": "B"}
        )
        record["update seconds"] = round(time.monotonic() - t0, 2)
        record["resume_generation"] = engine(serve, "resume_generation", {})
        # Before P is computed (and stored) again with B. The tiers' BlockRemoved events (and vLLM's
        # own clear) are published at the engine's next step: a short other request makes one.
        record["router view of P (device, host, disk) right after the update"] = probe.scores(P).get(wid, (0, 0, 0))
        ask(serve, vg.tokens(4999, 40))
        deadline = time.monotonic() + 15
        while (view := probe.scores(P).get(wid, (0, 0, 0))) != (0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        record["router view of P after the next engine step"] = view
        after = ask(serve, P)
        record["P after the update: cached"] = after["cached"]
        record["P after the update: margin to fresh B"] = exactness.margin(after["gen"], oracle[tuple(P)])
        print("\n" + "\n".join(f"{k}: {v}" for k, v in record.items()))
        assert record["update_weights_from_disk"]["status"] == "ok", record  # type: ignore[index]
        assert first["ids"] != after["ids"] or first["gen"].logprobs != after["gen"].logprobs  # B is other weights
        assert after["cached"] == 0, record
        assert view == (0, 0, 0), record  # vLLM reset its prefix cache; the tiers' blocks left with BlockRemoved
        exactness.assert_exact({tuple(P): after["gen"]}, oracle, "P after the update to weights B")
    finally:
        if probe is not None:
            probe.close()
        serve.close()
    assert vg.ours_left(serve.run) == []

    # A restart with weights B on the same disk directory starts and adopts no block of weights A.
    again_b = VllmServe(tmp_path, "restart-b", graph=GRAPH, base=sets(tmp_path, b, ssd))
    try:
        r = ask(again_b, P)
        print(f"restart with weights B: P cached {r['cached']}")
        exactness.assert_exact({tuple(P): r["gen"]}, oracle, "P after a restart with weights B")
    finally:
        again_b.close()
        shutil.rmtree(ssd, ignore_errors=True)
