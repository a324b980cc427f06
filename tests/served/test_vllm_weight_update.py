"""Issue 48: a weight update through Dynamo 1.6.1's RL routes (``dynamo.vllm --enable-rl``) must not
leave the connector's tiers serving KV computed with the old weights.

serve graphs/agg_vllm.py with the small preset's seeded weights A (float32, the exactness oracle's
setting), host and disk tiers, a small device cache; a 1,500-token prompt P cached and pushed off
the device; then, on the worker's system port, ``/engine/pause_generation``,
``/engine/update_weights_from_disk {"model_path": B}``, ``/engine/resume_generation``; P again
must be computed (no cached token), give the tokens of a fresh engine with weights B, and the
router's view of the worker must hold none of P's old blocks. A restart of the worker with weights
B on the same disk directory must start and adopt no old block. Also records what
``flush_cache`` and ``control/sleep`` + ``control/wake_up`` do to the tiers.

The same for a LoRA hot-swap under one name (dynamo.vllm's ``load_lora`` endpoint with
``DYN_LORA_HOTSWAP_ENABLED``): adapter "ad" served from a directory, P cached under it, the
directory's files overwritten with another adapter (requests still run with the loaded one and
are stored), "ad" hot-swapped at the same path, and again to a third directory: P as "ad" must be
computed each time and equal a fresh engine serving the adapter now loaded."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import exactness
import pytest
import torch
import vllm_graph as vg
from vllm_graph import VllmServe

GRAPH = "agg_vllm"
BS = 64
P = vg.tokens(4801, 1500)  # 23 full blocks: 1,472 tokens the tiers can hold
FILLERS = [vg.tokens(4900 + j, 1500) for j in range(3)]  # 72 blocks: P leaves the 56-block device cache
MAX_TOKENS = 8
RL = '["--enable-rl"]'
LORA_RANK = 8
LORA = f'["--enable-lora", "--max-lora-rank", "{LORA_RANK}", "--max-loras", "1"]'
LOAD_LORA = "dynamo.backend.load_lora"  # dynamo.vllm's request-plane endpoint (namespace dynamo, component backend)


def weights(path: Path, seed: int) -> Path:
    """The small preset's model directory with its seeded weights of ``seed``."""
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir, write_seeded_weights
    from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig

    cfg = EngineModelConfig.load("small")
    write_model_dir(cfg, path, context_length=4096)
    write_seeded_weights(cfg, path, seed=seed)
    return path


def adapter(path: Path, seed: int) -> Path:
    """A PEFT LoRA adapter (rank 8, q_proj and v_proj of every layer) for the small preset, seeded:
    large enough that two seeds give other tokens than each other and the base model."""
    from safetensors.torch import save_file

    from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig

    cfg = EngineModelConfig.load("small")
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out = {"q_proj": cfg.num_heads * cfg.head_dim, "v_proj": cfg.num_kv_heads * cfg.head_dim}
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, rows in out.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(LORA_RANK, cfg.hidden_size, generator=g) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows, LORA_RANK, generator=g) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 16, "target_modules": sorted(out), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def sets(tmp: Path, model: Path, ssd: Path, offload: bool = True) -> list[str]:
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


def ask(serve: VllmServe, prompt: list[int], model: str = vg.MODEL) -> dict:
    r = vg.complete(serve.base_url, prompt, MAX_TOKENS, model=model)
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
    record: dict[str, object] = {}

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


def load_lora(probe: vg.RouterProbe, serve: VllmServe, name: str, path: Path) -> dict:
    """dynamo.vllm's load_lora (a hot-swap when ``name`` is loaded), then waits until the frontend
    serves ``name`` as a model."""
    (reply,) = probe.call(LOAD_LORA, {"lora_name": name, "source": {"uri": path.as_uri()}})
    assert reply.get("status") == "success", reply
    deadline = time.monotonic() + 60
    while name not in served_models(serve):
        assert time.monotonic() < deadline, f"the frontend does not list {name!r} after load_lora: {reply}"
        time.sleep(0.2)
    return reply


def served_models(serve: VllmServe) -> list[str]:
    with urllib.request.urlopen(f"{serve.base_url}/v1/models", timeout=10) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def router_forgets(serve: VllmServe, probe: vg.RouterProbe, wid: int, prompt: list[int], lora: str) -> tuple:
    """The router's view of ``prompt`` under adapter ``lora`` on the worker once it is empty (or
    after 15 s): removals leave with the engine's next step, which a short request makes."""
    ask(serve, vg.tokens(4999, 40))
    deadline = time.monotonic() + 15
    while (view := probe.scores(prompt, lora_name=lora).get(wid, (0, 0, 0))) != (
        0,
        0,
        0,
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    return view


def invalidated(serve: VllmServe) -> float:
    """Blocks the worker's tiers dropped because the weights changed, once some are counted (or
    after 15 s): the counts travel with the engine's steps."""
    deadline = time.monotonic() + 15
    while True:
        text = vg.scrape(serve.metrics[worker(serve)])
        n = vg.metric(text, "vllm:flexkv_removed_blocks_total", reason="invalidated")
        if n > 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.served
def test_a_lora_hot_swap_under_the_same_name_leaves_no_old_adapter_kv_in_the_tiers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    # dynamo.vllm's LoRA routes, and replacing a loaded name (serve's processes inherit the environment)
    monkeypatch.setenv("DYN_LORA_ENABLED", "true")
    monkeypatch.setenv("DYN_LORA_HOTSWAP_ENABLED", "true")
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "lora-cache"))
    model = weights(tmp_path / "A", 0)
    x, y = adapter(tmp_path / "X", 1), adapter(tmp_path / "Y", 2)
    served = tmp_path / "ad"  # the directory "ad" is loaded from: X, then Y written over it
    shutil.copytree(x, served)
    elsewhere = shutil.copytree(x, tmp_path / "ad-elsewhere")  # X again, at another path
    lora = [f"VllmWorker.extra-args={LORA}"]
    record: dict[str, object] = {}

    # The oracle: a fresh engine without offload serving "ad" as Y, then as X.
    fresh = VllmServe(
        tmp_path, "fresh-lora", *lora, graph=GRAPH, base=sets(tmp_path, model, tmp_path / "ssd-fresh", offload=False)
    )
    fresh_probe = None
    try:
        fresh_probe = vg.RouterProbe(frontend_pid(fresh), tmp_path / "fresh-probe.log", block_size=BS)
        load_lora(fresh_probe, fresh, "ad", y)
        oracle_y = ask(fresh, P, "ad")["gen"]
        load_lora(fresh_probe, fresh, "ad", x)
        oracle_x = ask(fresh, P, "ad")["gen"]
    finally:
        if fresh_probe is not None:
            fresh_probe.close()
        fresh.close()
    assert oracle_x != oracle_y, "adapters X and Y give the same generation: the test could not tell them apart"

    serve = VllmServe(tmp_path, "lora", *lora, graph=GRAPH, base=sets(tmp_path, model, tmp_path / "ssd"))
    probe = None
    try:
        probe = vg.RouterProbe(frontend_pid(serve), tmp_path / "probe.log", block_size=BS)
        wid = vg.worker_id(vg.scrape(serve.metrics[worker(serve)]))
        load_lora(probe, serve, "ad", served)
        first = ask(serve, P, "ad")
        push_off_device(serve)
        again = ask(serve, P, "ad")  # from the tiers, adapter X
        record["P as ad = X, again: cached"] = again["cached"]
        record["router view of P as ad (device, host, disk)"] = probe.scores(P, lora_name="ad").get(wid)
        exactness.assert_exact({tuple(P): again["gen"]}, {tuple(P): oracle_x}, "P as ad = X, from the tiers")
        assert again["cached"] >= len(P) // BS * BS - BS, record  # the tiers serve the adapter's KV

        # The hard case: Y written over the loaded adapter's files; requests still run with X (and are
        # stored) until "ad" is hot-swapped at the same path.
        for f in y.iterdir():
            shutil.copyfile(f, served / f.name)
        record["P as ad after the files changed, X still loaded: cached"] = ask(serve, P, "ad")["cached"]
        push_off_device(serve)
        t0 = time.monotonic()
        record["hot-swap at the same path"] = load_lora(probe, serve, "ad", served)
        record["hot-swap seconds"] = round(time.monotonic() - t0, 2)
        record["router view of P as ad after the hot-swap"] = view = router_forgets(serve, probe, wid, P, "ad")
        # The tiers dropped their blocks at the hot-swap (the worker's WeightWatch saw the adapter's
        # files change under its name), KV stored with X under Y's files included.
        record["blocks invalidated by the hot-swap"] = dropped = invalidated(serve)
        swapped = ask(serve, P, "ad")
        record["P as ad = Y: cached"] = swapped["cached"]
        record["P as ad = Y: margin to a fresh Y"] = exactness.margin(swapped["gen"], oracle_y)

        # A hot-swap to another directory (X again): P, cached as Y on host and disk, is computed.
        push_off_device(serve)
        record["hot-swap to another path"] = load_lora(probe, serve, "ad", elsewhere)
        record["router view of P as ad after the second hot-swap"] = view2 = router_forgets(serve, probe, wid, P, "ad")
        back = ask(serve, P, "ad")
        record["P as ad = X elsewhere: cached"] = back["cached"]
        record["P as ad = X elsewhere: margin to a fresh X"] = exactness.margin(back["gen"], oracle_x)
        print("\n" + "\n".join(f"{k}: {v}" for k, v in record.items()))
        exactness.assert_exact({tuple(P): first["gen"]}, {tuple(P): oracle_x}, "P as ad = X, computed")
        assert swapped["cached"] == 0, record
        assert view == (0, 0, 0), record
        assert dropped > 0, record
        exactness.assert_exact({tuple(P): swapped["gen"]}, {tuple(P): oracle_y}, "P as ad after the hot-swap to Y")
        assert back["cached"] == 0, record
        assert view2 == (0, 0, 0), record
        exactness.assert_exact({tuple(P): back["gen"]}, {tuple(P): oracle_x}, "P as ad after the hot-swap to X")
    finally:
        if probe is not None:
            probe.close()
        serve.close()
    assert vg.ours_left(serve.run) == []
