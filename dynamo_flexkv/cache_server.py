"""``dynamo-flexkv cache-server``: the node's KV cache service (docs/NODE_CACHE.md).

One per node: every engine and rank on the node attaches to it over its Unix socket (cache config
``mode: node``). Its tiers come from the cache config as for an engine (FLEXKV_CONFIG_PATH, the
environment, ``-f`` and ``--set``); ``--metrics-port`` serves its Prometheus metrics on 127.0.0.1.
Ctrl-C or SIGTERM detaches the engines (their loads fail over to recompute) and stops it with exit
0; its disk tier stays for the next one to re-adopt."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.errors import FlexKVError

log = logging.getLogger(__name__)
READY = "cache server ready on"  # serve waits for this line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        help="the Unix socket engines attach to (default: node_socket from the config, else "
        "$XDG_RUNTIME_DIR/flexkv-node.sock); the socket is 0600, its directory is made 0700 if missing "
        "and refused if another user owns it or others may write to it",
    )
    p.add_argument(
        "-f",
        "--config",
        help="cache config YAML (the keys of docs/CONFIGURATION.md: cpu_cache_gb, "
        "ssd_cache_gb, ssd_cache_dir, ...); default FLEXKV_CONFIG_PATH",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one cache config value, e.g. --set cpu_cache_gb=8 (repeatable; wins over the file and the environment)",
    )
    p.add_argument(
        "--max-clients", type=int, default=64, help="engines attached at once (each rank counts; default 64)"
    )
    p.add_argument(
        "--max-models",
        type=int,
        default=1,
        help="models (namespaces: model + layout + tenant) served at once; without quotas each gets tiers of "
        "the configured sizes (default 1)",
    )
    p.add_argument(
        "--tenant-quota",
        action="append",
        default=[],
        metavar="TENANT=HOST_GB[:DISK_GB[:REMOTE_GB]]",
        help="quotas per tenant (repeatable): what this tenant's engines (their namespace) may hold on this "
        "node's host and disk tiers and, shared with its engines elsewhere, in the remote tier (0 or left "
        "out: no disk tier / no remote quota). With any quota, cpu_cache_gb and ssd_cache_gb are the node's "
        "budget: each quota is reserved for its tenant (the named ones must fit it together), a tenant at "
        "its quota evicts its own blocks, never another's, and a tenant without a quota is refused",
    )
    p.add_argument(
        "--default-quota",
        metavar="HOST_GB[:DISK_GB[:REMOTE_GB]]",
        help="the quota of every tenant --tenant-quota does not name (engines without a tenant included); "
        "one that no longer fits the budget beside the reserved quotas is refused at attach",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve HTTP on METRICS_HOST:PORT: Prometheus metrics on /metrics, and what is cached on "
        "/engine/control/flexkv_cache (dynamo-flexkv cache --url); default 0: none (serve's NodeCache section "
        "always passes one, a free port unless its metrics-port names one)",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="the address the metrics listen on (default 127.0.0.1)")


def load_config(path: str | None, sets: list[str]) -> CacheConfig:
    """File (-f, else FLEXKV_CONFIG_PATH) < environment < --set, as an engine loads its cache config;
    an error names where the bad value came from."""
    return CacheConfig.load(path, sets=sets, path_flag="-f")


def check_host_memory(config: CacheConfig, args: argparse.Namespace, quotas: bool) -> None:
    """The host tiers the service may hold at once (cpu_cache_gb; without quotas once per model,
    --max-models) must fit this machine's memory: past it the shared memory they fill would be
    swapped or the service (and the engines mapping it) killed by the OOM killer once full, long
    after a start that looked fine. ConfigError naming the key, where it was set, the memory and
    the fix."""
    from dynamo_flexkv.core.sysutil import host_memory_shortfall

    models = 1 if quotas else max(1, args.max_models)
    short = host_memory_shortfall(config.cpu_cache_gb, models)
    if short is None:
        return
    times = f" x --max-models {models} (each model gets its own host tier without quotas)" if models > 1 else ""
    raise ConfigError(
        f"cpu_cache_gb={config.cpu_cache_gb:g} ({_origin('cpu_cache_gb', args)}){times}: the host tier "
        f"{short[0]}: set cpu_cache_gb to what the node can spare (e.g. --set cpu_cache_gb={short[1]:.0f})"
        + (" or lower --max-models, or give tenant quotas" if models > 1 else "")
    )


def _origin(key: str, args: argparse.Namespace) -> str:
    """Where CacheConfig.load took ``key`` from for this command: a --set, else the environment, else
    the file, else the default (the reverse of the order it applies them in)."""
    import os

    from dynamo_flexkv.core.config import CONFIG_PATH_ENV, env_origin, env_settings, parse_sets, read_yaml_mapping

    sets = parse_sets(args.set)
    if key in sets:
        return f"--set {sets[key][0]}"
    for var, named in env_settings(os.environ).items():
        if named == key:
            return env_origin(var)
    path = args.config or os.environ.get(CONFIG_PATH_ENV)
    if path and key in read_yaml_mapping(path):
        return f"config file {path} ({'-f' if args.config else CONFIG_PATH_ENV})"
    return "the default"


def run(args: argparse.Namespace) -> int:
    from dynamo_flexkv.core.node.quota import TenantQuotas
    from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions, default_socket_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.set)
        path = args.socket or config.node_socket or default_socket_path()
        quotas = TenantQuotas.parse(args.default_quota, args.tenant_quota)
        config.require_host_tier(_origin("cpu_cache_gb", args))
        check_host_memory(config, args, quotas is not None)
        options = ServerOptions(path, max_clients=args.max_clients, max_models=args.max_models, quotas=quotas)
        try:
            server = NodeCacheServer(config, options)
        except OSError as e:
            if isinstance(e, FlexKVError):  # its message already names the path and the fix
                raise
            flag = "--socket" if args.socket else _origin("node_socket", args) if config.node_socket else "the default"
            raise ConfigError(
                f"node_socket {path} ({flag}): cannot listen there ({e.strerror or e}): choose a path in a "
                "directory of yours that you can write to (e.g. --socket /tmp/flexkv/node.sock)"
            ) from None
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    metrics = None
    try:
        if args.metrics_port:
            try:
                metrics = serve_metrics(server, args.metrics_host, args.metrics_port)
            except (OSError, OverflowError) as e:  # in use, out of range, not this machine's address
                print(
                    f"error: --metrics-host/--metrics-port {args.metrics_host}:{args.metrics_port}: cannot listen "
                    f"there ({e}): choose a free port in 1-65535 on an address of this machine, or 0 for none",
                    file=sys.stderr,
                )
                return 2
        server.start()
        print(
            f"{READY} {path} (pid {server.stats()['pid']}; host {config.cpu_cache_gb} GB, disk "
            f"{config.ssd_cache_gb} GB{' in ' + ';'.join(config.ssd_cache_dir) if config.ssd_cache_dir else ''}"
            f"{'; quotas per tenant: ' + ' '.join(quotas.argv()) if quotas else ''})",
            flush=True,
        )
        stop.wait()
    finally:
        if metrics is not None:
            metrics.shutdown()
        server.close()
    return 0


def serve_metrics(server: Any, host: str, port: int) -> Any:
    """One HTTP server on ``host:port`` for operators: Prometheus text on ``/metrics`` (the service's
    counters and each model's tiers) and what is cached on ``/engine/control/flexkv_cache`` (the
    route and JSON body every worker answers too: core/inventory.py). ``shutdown()`` stops it."""
    from http.server import ThreadingHTTPServer

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(_Collector(server))
    httpd = ThreadingHTTPServer((host, port), _handler(server, registry))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="flexkv-node-http", daemon=True)
    thread.start()
    return _HttpServer(httpd, thread)


class _HttpServer:
    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self.httpd, self.thread = httpd, thread
        self.port: int = httpd.server_address[1]

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def _handler(server: Any, registry: Any) -> Any:
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import parse_qs, urlsplit

    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    from dynamo_flexkv.core.inventory import HTTP_ROUTE, BadCacheRequest, parse_request, to_builtins

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path in ("/metrics", "/"):
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif url.path == HTTP_ROUTE:  # a look: the query names the selection (?tenant=acme&model=...)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                self._cache(dict(query, op="contents"))
            else:
                self._json(404, {"status": "error", "message": f"no {url.path} here: GET /metrics or {HTTP_ROUTE}"})

        def do_POST(self) -> None:
            if urlsplit(self.path).path != HTTP_ROUTE:
                self._json(404, {"status": "error", "message": f"POST {HTTP_ROUTE} only"})
                return
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError as e:
                self._json(400, {"status": "error", "message": f"the body is not JSON: {e}"})
                return
            self._cache(body)

        def _cache(self, body: Any) -> None:
            try:
                report = server.admin(parse_request(body))
            except (BadCacheRequest, ValueError, RuntimeError) as e:
                self._json(400, {"status": "error", "message": str(e)})
                return
            self._json(200, {"status": "ok", "report": to_builtins(report)})

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, json.dumps(body).encode(), "application/json")

        def _send(self, code: int, data: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

    return Handler


class _Collector:
    """The service's families in the one metric schema (core/metric_schema.py): the quantities an
    engine exports too under the engine's names (flexkv_pool_blocks, flexkv_hit_blocks_total,
    flexkv_removed_blocks_total, flexkv_tasks_in_flight), the service's own as flexkv_node_*; every
    sample labelled source="node". The old names (metric_schema.ALIASES) follow for one release."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from dynamo_flexkv.core.metric_schema import Source, with_source

        st = self.server.stats()
        yield from with_source(self._families(st), Source.NODE)
        yield from self._aliases(st)

    def _families(self, st: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engines = GaugeMetricFamily("flexkv_node_engines", "Engines (ranks) attached now")
        engines.add_metric([], len(st["engines"]))
        yield engines
        copies = GaugeMetricFamily("flexkv_node_copies_in_flight", "Device copies sent to engines and not answered")
        copies.add_metric([], sum(e["copies_in_flight"] for e in st["engines"]))
        yield copies
        tasks = GaugeMetricFamily(
            "flexkv_tasks_in_flight", "Loads, stores and prefetches of attached engines not finished"
        )
        tasks.add_metric([], sum(e["tasks"] for e in st["engines"]))
        yield tasks
        fenced = GaugeMetricFamily(
            "flexkv_node_fenced_copies", "Host writes of departed engines whose slots wait for their process to exit"
        )
        fenced.add_metric([], st["fenced_waiting"])
        yield fenced
        for key, doc in (
            ("attached", "Engines that attached"),
            ("detached", "Engines that detached or died"),
            ("refused", "Attaches refused (full, another model past max_models)"),
            ("protocol_errors", "Connections closed for frames outside the protocol"),
            ("requests", "Requests answered"),
            ("request_errors", "Requests refused or failed"),
        ):
            c = CounterMetricFamily(f"flexkv_node_{key}", doc)
            c.add_metric([], st[key])
            yield c
        pool = GaugeMetricFamily("flexkv_pool_blocks", "Offload tier slots", labels=["model", "tier", "state"])
        hits = CounterMetricFamily("flexkv_hit_blocks", "Blocks loads found per tier", labels=["model", "tier"])
        removed = CounterMetricFamily(
            "flexkv_removed_blocks",
            "Blocks that left a tier, by why (evicted, demoted, invalidated, cleared, failed)",
            labels=["model", "tier", "reason"],
        )
        for model, tier, t in _tiers(st):
            for state in ("capacity", "used"):
                pool.add_metric([model, tier, state], t[f"{state}_blocks"])
            hits.add_metric([model, tier], t["hit_blocks"])
            for reason, n in sorted(t.get("removed_blocks", {}).items()):
                removed.add_metric([model, tier, reason], n)
        yield pool
        yield hits
        yield removed
        t_used = GaugeMetricFamily(
            "flexkv_node_tenant_used_bytes",
            "Bytes a tenant's blocks take per tier (remote: as Redis accounts it, with a remote quota)",
            labels=["tenant", "tier"],
        )
        t_quota = GaugeMetricFamily(
            "flexkv_node_tenant_quota_bytes", "A tenant's quota per tier (with quotas on)", labels=["tenant", "tier"]
        )
        for tenant, t in st["tenants"].items():
            for tier, n in t["used"].items():
                t_used.add_metric([tenant, tier], n)
            for tier, n in t["quota"].items():
                t_quota.add_metric([tenant, tier], n)
        yield t_used
        yield t_quota

    @staticmethod
    def _aliases(st: dict[str, Any]) -> Iterator[Any]:
        """The names before the one schema, unchanged in shape (deprecated: removed in the next release)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        tasks = GaugeMetricFamily("flexkv_node_engine_tasks", "Deprecated: flexkv_tasks_in_flight{source=node}")
        tasks.add_metric([], sum(e["tasks"] for e in st["engines"]))
        yield tasks
        labels = ["model", "tier"]
        used = GaugeMetricFamily(
            "flexkv_node_tier_used_blocks", "Deprecated: flexkv_pool_blocks{state=used}", labels=labels
        )
        cap = GaugeMetricFamily(
            "flexkv_node_tier_capacity_blocks", "Deprecated: flexkv_pool_blocks{state=capacity}", labels=labels
        )
        hits = CounterMetricFamily("flexkv_node_tier_hit_blocks", "Deprecated: flexkv_hit_blocks_total", labels=labels)
        removed = CounterMetricFamily(
            "flexkv_node_removed_blocks", "Deprecated: flexkv_removed_blocks_total", labels=[*labels, "reason"]
        )
        for model, tier, t in _tiers(st):
            used.add_metric([model, tier], t["used_blocks"])
            cap.add_metric([model, tier], t["capacity_blocks"])
            hits.add_metric([model, tier], t["hit_blocks"])
            for reason, n in sorted(t.get("removed_blocks", {}).items()):
                removed.add_metric([model, tier, reason], n)
        yield from (used, cap, hits, removed)


def _tiers(st: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(model, tier, that tier's stats) of every namespace's host and disk tiers."""
    for ns in st["namespaces"]:
        for tier in ("host", "disk"):
            t = ns["tiers"].get(tier)
            if t:
                yield ns["model_id"], tier, t
