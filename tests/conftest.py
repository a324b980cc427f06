"""Suite-wide guards: nothing in the tests may reach outside this machine."""

import os

# transformers / huggingface_hub must never try the network (the model directory is local).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Dynamo processes bind and advertise loopback only.
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV

for var, value in LOOPBACK_ENV.items():
    os.environ.setdefault(var, value)
# ... and vLLM's engines too (its multi-process executor advertises VLLM_HOST_IP to its ranks).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
# The processes tests start (serve's workers, vLLM's) import tests' seams by name (wrong_kv.py).
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)


import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """NIXL 1.5.1's UCX plugin bundles a libnl whose exit-time destructor crashes (SIGSEGV) in any
    process that created a UCX backend; the disaggregation tests create some in this process. Once
    the report is written, end with the run's own exit status instead of that crash (the same
    rule the workers follow: dynamo_flexkv.core.transfer.nixl_agent.exit_past_libnl)."""
    nixl_kv = sys.modules.get("dynamo_flexkv.core.transfer.nixl_agent")
    if nixl_kv is not None and nixl_kv.ucx_agents_created():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(config.stash.get(EXIT_STATUS, 1))


# ---- kinds: every test module has one, so a run can pick them (docs/TESTING.md) ----------------------
#   unit         in this process only (its own threads and sockets): no server, no subprocess
#   integration  starts real processes or servers: redis-server, etcd, NATS, engine and cache-server
#                processes, fresh interpreters, a built wheel; or NIXL agents talking over UCX
#   served       serves a Dynamo graph: `dynamo-flexkv serve`, the Launcher, vLLM graphs
#   bench        benchmark smokes
# A module's kind is what most of its tests need; a test that needs another kind carries that marker
# itself (@pytest.mark.integration, ...), and its own marker wins. A new test module must be added here:
# collection fails, naming it, until it is.
KINDS = ("unit", "integration", "served", "bench")
MODULE_KINDS = {
    "test_admission": "unit",
    "test_adv_peer": "integration",
    "test_aiperf": "served",
    "test_architecture_doors": "unit",
    "test_architecture_map": "unit",
    "test_argument_checks_and_waits": "unit",
    "test_bench_events": "bench",
    "test_bench_vllm": "unit",
    "test_cache_serve": "served",
    "test_cache_cli": "unit",
    "test_cache_engine": "unit",
    "test_cache_inventory": "unit",
    "test_cache_server_dirs": "integration",
    "test_cancel_fence": "unit",
    "test_checksum_once": "unit",
    "test_cli": "bench",
    "test_concurrency": "unit",
    "test_config": "unit",
    "test_cost_model": "unit",
    "test_crash": "integration",
    "test_cuda": "unit",
    "test_dashboard": "unit",
    "test_device_pool": "unit",
    "test_disagg": "integration",
    "test_disagg_checksums": "integration",
    "test_disagg_leases": "integration",
    "test_disagg_metrics": "integration",
    "test_disagg_plan": "unit",
    "test_disagg_refusals": "unit",
    "test_disagg_role": "unit",
    "test_disagg_serve": "served",
    "test_doctor_dirs": "unit",
    "test_dockerfile": "integration",
    "test_disk_io": "unit",
    "test_docs_examples": "unit",
    "test_dynamo_worker": "served",
    "test_engine": "unit",
    "test_errors": "unit",
    "test_events": "unit",
    "test_faults": "unit",
    "test_fuzz": "unit",
    "test_hashing": "unit",
    "test_hostile_input": "served",
    "test_http_client": "unit",
    "test_import_cycles": "unit",
    "test_layers": "integration",
    "test_layout": "unit",
    "test_lineage_and_quota_races": "integration",
    "test_liveness": "unit",
    "test_manager": "unit",
    "test_manager_misuse_and_restarts": "unit",
    "test_metric_schema": "integration",
    "test_model_dir": "unit",
    "test_native_copy": "unit",
    "test_nixl_progress_threads": "integration",
    "test_node_cache": "integration",
    "test_node_cache_admin": "unit",
    "test_node_late_reply": "integration",
    "test_node_quota": "integration",
    "test_node_serve": "unit",
    "test_nodes": "unit",
    "test_peer_lmcache": "unit",
    "test_peer_pull": "integration",
    "test_private_dirs": "integration",
    "test_procgroup": "integration",
    "test_remote_hostile_values": "integration",
    "test_remote_serve": "integration",
    "test_remote_quota": "integration",
    "test_remote_store": "integration",
    "test_remote_tier": "integration",
    "test_render_k8s": "unit",
    "test_render_k8s_cluster": "unit",
    "test_replay": "unit",
    "test_replay_accounting": "unit",
    "test_resp_stream": "unit",
    "test_router_hints": "unit",
    "test_router_burst": "served",
    "test_router_events": "integration",
    "test_serve": "unit",
    "test_serve_faults": "served",
    "test_serve_clean_start_stop": "served",
    "test_serve_logs": "unit",
    "test_serve_requests_and_shutdown": "served",
    "test_serve_restarts": "served",
    "test_serve_vllm": "unit",
    "test_soak": "unit",
    "test_ssd": "unit",
    "test_tier_index": "unit",
    "test_vllm_connector": "unit",
    "test_vllm_connector_faults": "integration",
    "test_vllm_connector_settings": "unit",
    "test_vllm_cpu_affinity": "unit",
    "test_vllm_disagg": "served",
    "test_vllm_graph_e2e": "served",
    "test_vllm_groups": "unit",
    "test_vllm_weight_update": "served",
    "test_vllm_weight_watch": "unit",
    "test_vllm_lora_lineage": "unit",
    "test_vllm_handover": "integration",
    "test_vllm_layouts": "served",
    "test_vllm_node_cache": "served",
    "test_vllm_hints_nodes": "served",
    "test_vllm_router_hints": "served",
    "test_weights_lineage": "unit",
    "test_wheel": "integration",
    "test_worker_engine": "unit",
    "test_worker_robustness": "served",
    "test_workload": "unit",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    stale = sorted(set(MODULE_KINDS) - {p.stem for p in here.glob("test_*.py")})
    if stale:
        raise pytest.UsageError(f"tests/conftest.py MODULE_KINDS names {stale}: no such test module, remove it")
    missing = set()
    for item in items:
        own = {m.name for m in item.iter_markers() if m.name in KINDS}
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(own)}: a test has one kind of {KINDS}")
        if own:
            continue
        kind = MODULE_KINDS.get(item.path.stem)
        if kind is None:
            missing.add(item.path.stem)
            continue
        item.add_marker(getattr(pytest.mark, kind))
    if missing:
        raise pytest.UsageError(
            f"test module(s) {sorted(missing)} have no kind: add each to MODULE_KINDS in tests/conftest.py "
            f"as one of {KINDS} (what each kind means is written above the table)"
        )
