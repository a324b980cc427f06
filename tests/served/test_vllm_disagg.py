"""Disaggregated prefill/decode on vLLM (graphs/disagg_vllm.py): the real Dynamo frontend, a
``dynamo.vllm --disaggregation-mode prefill`` worker and a ``decode`` worker, each with vLLM's
NixlConnector (the handover) beside FlexKVConnector (its own host/disk tiers) under MultiConnector.
* 50 greedy prompts of mixed lengths (10 documents of 100-2,000 tokens, each asked 5 times with a
  suffix of its own) give the same token ids and logprobs (tests/helpers/exactness.py: seeded weights in
  float32) as the aggregated vLLM graph without offload (graphs/agg_vllm.py, offload: false);
  the prefill worker computed the prompts, the decode worker received their KV over NIXL (its
  NIXL transfer counters) and computed almost none of them.
* Decode SIGKILLed while it holds a request, then prefill SIGKILLed while it computes one: the
  request ends with the aggregated generation or a clean 5xx, never a hang; serve restarts the worker,
  a new request is answered with the same tokens within the README's bound once it is ready, and
  the prefill worker's blocks (NixlConnector's lease) are free again.
All -m slow: each graph takes 1-3 minutes to start on 2 CPU cores; the aggregated graph stops
before the disaggregated one starts."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
import urllib.error
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
from repo_paths import HELPERS  # noqa: E402
from served import wait_until  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

BS = 64
MAX_TOKENS = 8
DOC_LENS = (100, 300, 500, 700, 900, 1100, 1300, 1500, 1700, 2000)
DOCS = [vg.tokens(3000 + d, n) for d, n in enumerate(DOC_LENS)]
PROMPTS = [DOCS[d] + vg.tokens(4000 + 10 * r + d, 5 + (3 * r + 7 * d) % 20) for r in range(5) for d in range(len(DOCS))]


def common(tmp: Path, name: str, workers: list[str], offload: bool = True) -> list[str]:
    out = ["Frontend.http-port=0"]
    for w in workers:
        out += [
            *exactness.serve_sets(w),
            *(exactness.offload_sets(w) if offload else [f"{w}.offload=false"]),
            f"{w}.cache.ssd_cache_dir={tmp}/{name}/{w}{{replica}}",
            f"{w}.max-model-len=2560",
            f"{w}.num-device-blocks=64",
            f"{w}.cache.cpu_cache_gb=0.0625",
            f"{w}.cache.ssd_cache_gb=0.1",
            f"{w}.restart-backoff-s=5",
        ]
    return out


def run(serve: VllmServe) -> dict[int, Generation]:
    out = {}
    for i, p in enumerate(PROMPTS):
        r = vg.complete(serve.base_url, p, MAX_TOKENS, timeout=300)
        assert len(r["ids"]) == MAX_TOKENS, r
        out[i] = r["gen"]
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-disagg")


@pytest.fixture(scope="module")
def aggregated(tmp) -> dict[int, Generation]:
    """Token ids and logprobs of every prompt from one aggregated vLLM worker without offload."""
    serve = VllmServe(tmp, "agg", graph="agg_vllm", base=common(tmp, "agg", ["VllmWorker"], offload=False))
    try:
        t0 = time.monotonic()
        out = run(serve)
        print(f"\nagg_vllm: {len(PROMPTS)} prompts in {time.monotonic() - t0:.0f} s")
    finally:
        serve.close()
    assert vg.ours_left(serve.run) == []
    return out


# CI's served vLLM P/D path (ci_slow): disagg_vllm, one prefill worker; the router variant stays in test-slow.
@pytest.mark.parametrize("graph", [pytest.param("disagg_vllm", marks=pytest.mark.ci_slow), "disagg_router_vllm"])
def test_disaggregated_vllm_gives_the_aggregated_tokens_and_decode_pulls_the_kv_over_nixl(tmp, aggregated, graph):
    """disagg_router_vllm: two prefill workers behind the frontend's KV-aware prefill router (each
    prompt's prefill leg goes to the worker holding the most of its prefix in any tier)."""
    serve = VllmServe(tmp, graph, graph=graph, base=common(tmp, graph, ["PrefillWorker", "DecodeWorker"]))
    try:
        t0 = time.monotonic()
        got = run(serve)
        elapsed = time.monotonic() - t0
        prefills = [vg.scrape(url) for name, url in serve.metrics.items() if name.startswith("PrefillWorker")]
        decode = vg.scrape(serve.metrics["DecodeWorker"])
    finally:
        serve.close()
    assert vg.ours_left(serve.run) == []
    exactness.assert_exact(got, aggregated, f"{graph}: {len(PROMPTS)} prompts against agg_vllm without offload")
    total = sum(len(p) for p in PROMPTS)
    each_p = [vg.metric(m, "vllm:prompt_tokens_total") for m in prefills]
    # FlexKVConnector carries the handover (handover: auto): decode READ each prompt's full blocks
    # from a prefill worker's vLLM KV over NIXL and verified them against the prefill's digests;
    # NixlConnector only frees its own hold. Whatever decode's own prefix cache held is not read.
    handed = vg.metric(decode, "vllm:flexkv_handover_tokens_total")
    pulled = vg.metric(decode, "vllm:flexkv_handover_bytes_total")
    failed = vg.metric(decode, "vllm:flexkv_handovers_total", result="failed")
    nixl_reads = vg.metric(decode, "vllm:nixl_xfer_time_seconds_count")
    full = sum((len(p) - 1) // BS * BS for p in PROMPTS)
    print(
        f"\n{graph}: {len(PROMPTS)} prompts in {elapsed:.0f} s; prefill prompt tokens {each_p} (sum "
        f"{sum(each_p):.0f}) of {total}; decode: {handed:.0f} handed-over tokens of {full} in full blocks, "
        f"{pulled / 2**20:.1f} MiB, {failed:.0f} failed; NixlConnector reads {nixl_reads:.0f}"
    )
    assert sum(each_p) >= total  # every prompt went through a prefill worker
    assert len(prefills) == (2 if graph == "disagg_router_vllm" else 1) and all(each_p)  # each one served some
    assert failed == 0 and nixl_reads == 0, (failed, nixl_reads)
    assert 0 < handed <= full and pulled > 0


RECOVERY_S = 30  # README: a new request after a worker's restart is answered within this


def pid_of(serve: VllmServe, name: str) -> int:
    """``name``'s dynamo.vllm process now (serve's children change when it restarts one)."""
    serve.children = [
        int(x)
        for x in subprocess.run(["pgrep", "-P", str(serve.proc.pid)], capture_output=True, text=True).stdout.split()
    ]
    return serve.worker_pid(name)


def running(serve: VllmServe, name: str) -> float:
    try:
        return vg.metric(vg.scrape(serve.metrics[name]), "vllm:num_requests_running")
    except OSError:
        return 0.0


def test_a_killed_decode_or_prefill_worker_fails_cleanly_and_the_graph_recovers(tmp, aggregated):
    serve = VllmServe(
        tmp,
        "faults",
        "PrefillWorker.restart-backoff-s=1",
        "DecodeWorker.restart-backoff-s=1",
        graph="disagg_vllm",
        base=common(tmp, "faults", ["PrefillWorker", "DecodeWorker"]),
    )
    try:
        for victim, k in (("DecodeWorker", 19), ("PrefillWorker", 29)):  # 2,000-token prompts
            pid, seen = pid_of(serve, victim), len(serve.lines)
            out, thread = vg.stream_in_thread(serve.base_url, PROMPTS[k], MAX_TOKENS)
            wait_until(
                f"{victim} to hold the request",
                lambda: out.finished or running(serve, victim) > 0,
                timeout=120,
                every=0.01,
            )
            os.kill(pid, signal.SIGKILL)
            thread.join(180)
            assert out.finished, f"the request hung after {victim} died"
            if out.status == 200 and out.done and out.error is None and out.exception is None:
                exactness.assert_exact({k: out.gen}, aggregated, f"after {victim} died")
                outcome = "the aggregated tokens"
            else:  # a clean 5xx: an HTTP status or an SSE error event, never a broken stream
                code = out.status if out.status >= 500 else int((out.error or {}).get("code") or 0)
                assert 500 <= code < 600 and out.exception is None, out
                outcome = f"a clean {code}"
            ready = serve.wait_for(rf"{victim} is ready again after \S+ s", 600)
            assert any(f"{victim} exited with signal SIGKILL" in x for x in serve.lines[seen:])
            # Ready is the worker's /health; the frontend answers 404/503 until it re-discovered the
            # model (decode is the model's only backend): the bound counts from ready to an answer.
            t0, failures = time.monotonic(), []
            while True:
                try:
                    r = vg.complete(serve.base_url, PROMPTS[k + 10], MAX_TOKENS, timeout=RECOVERY_S)
                    break
                except urllib.error.HTTPError as e:
                    failures.append(e.code)
                    assert e.code in (404, 503) and time.monotonic() - t0 < RECOVERY_S, (failures, e.read()[:300])
                    time.sleep(0.2)
            answered = time.monotonic() - t0
            assert answered < RECOVERY_S, (answered, r)
            exactness.assert_exact({k + 10: r["gen"]}, aggregated, f"after {victim} came back")
            # Nothing of the dead side holds the prefill's blocks past NixlConnector's lease (30 s).
            wait_until(
                "the prefill worker's KV blocks free",
                lambda: vg.metric(vg.scrape(serve.metrics["PrefillWorker"]), "vllm:kv_cache_usage_perc") == 0,
                timeout=60,
                every=0.5,
            )
            print(
                f"\n{victim} killed while it held a request: {outcome} after {out.seconds:.1f} s; "
                f"{ready.group(0)}; the next request answered {answered:.1f} s later "
                f"({len(failures)} refused meanwhile: {sorted(set(failures))})"
            )
    finally:
        serve.close()
    assert vg.ours_left(serve.run) == []


@pytest.mark.integration
def test_decode_holds_the_bytes_prefill_computed_and_stores_them_in_its_own_tiers(tmp_path):
    """Prefill and decode engines of the graph's connector layout, in one test process: after
    FlexKVConnector's handover, every full block of the prompt in decode's KV cache equals prefill's bit for bit,
    decode's FlexKVConnector stored those blocks in its own host tier, and decode's tokens equal
    the aggregated engine's."""
    import json
    import sys

    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    model = write_model_dir(EngineModelConfig.preset("small"), tmp_path / "model", context_length=8192, weights=True)
    out = tmp_path / "result.json"
    env = dict(
        os.environ,
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        HOME=str(tmp_path),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm"),
    )
    env.pop("FLEXKV_CONFIG_PATH", None)
    script = HELPERS / "vllm_disagg_kv_check.py"
    p = subprocess.run(
        [sys.executable, str(script), str(model), str(out), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(script.parent),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    for r in json.loads(out.read_text()):
        print(
            f"\n{r['prompt_tokens']} tokens: {r['remote_blocks']} blocks held by prefill, decode's handovers "
            f"(blocks, bytes, verified) {r['handovers']}, full ones equal: {r['bytes_equal']}; decode stored "
            f"{r['decode_stored_blocks']}"
        )
        assert r["remote_blocks"] == r["full_blocks"] and r["nonzero"] and r["layers"] > 0
        # One verified read of every full block but the one holding the last token, every layer.
        read = (r["prompt_tokens"] - 1) // 64
        assert r["handovers"] == [[read, read * r["block_bytes"], True]], r
        assert r["bytes_equal"], r  # bit for bit, every layer of every full block
        assert r["decode_stored_blocks"] >= r["full_blocks"], r  # what decode received, in its own tiers
        exactness.assert_exact(
            {0: Generation.from_json(r["decode"])},
            {0: Generation.from_json(r["agg"])},
            f"decode after the handover, {r['prompt_tokens']} tokens",
        )
