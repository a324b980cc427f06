"""``python -m dynamo_flexkv.worker``: the reference engine with KVManager offload as a Dynamo
backend (``dynamo.common.backend.LLMEngine``), run by Dynamo's Worker.

The engine runs on one thread of its own (it is not thread-safe); ``generate`` hands requests to
it and streams tokens back through the event loop. Device, host and disk KV events leave through
one KvEventRelay socket that the Worker subscribes to (``kv_event_sources``). Offload metrics are
bridged into Dynamo's ``/metrics`` (``register_prometheus``); the device-cache load goes to the
router through the framework's SnapshotPublisher."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import queue
import tempfile
import threading
from typing import Any, AsyncGenerator, Dict, List, Optional

from dynamo.common.backend import EngineConfig, LLMEngine as DynamoLLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
from dynamo.common.backend.run import run

from dynamo_flexkv.config import CacheConfig
from dynamo_flexkv.dynamo import LOOPBACK_ENV
from dynamo_flexkv.dynamo.metrics import PREFIX, OffloadCollector, RequestTally, offload_registry
from dynamo_flexkv.dynamo.model_dir import write_model_dir
from dynamo_flexkv.engine import EngineModelConfig, LLMEngine, SamplingParams
from dynamo_flexkv.events import KvEventRelay, OffloadEvents
from dynamo_flexkv.manager import KVManager

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynamo_flexkv.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset (configs/models) or a local HF directory")
    p.add_argument("--served-model-name", default="flexkv-small")
    p.add_argument("--model-dir", help="where to write the model directory (default: a temp dir)")
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="flexkv")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--discovery-backend", default="file", choices=["file", "etcd", "mem", "kubernetes"])
    p.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
    p.add_argument("--event-plane", default="zmq", choices=["zmq", "nats"])
    p.add_argument("--num-device-blocks", type=int, default=256, help="the engine's own KV blocks")
    p.add_argument("--no-offload", action="store_true", help="serve without host/disk tiers")
    p.add_argument("--bulk-load", action="store_true", help="load cached prefixes before compute")
    p.add_argument("--no-device-prefix-cache", action="store_true",
                   help="free device blocks when a request ends: reuse then comes only from offload tiers")
    return p


class FlexKVWorkerEngine(DynamoLLMEngine):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = EngineModelConfig.load(args.model)
        self.model_dir = write_model_dir(self.cfg, args.model_dir or tempfile.mkdtemp(prefix="flexkv-model-"))
        self.relay = KvEventRelay(self.cfg.block_size)
        self.kv: Optional[KVManager] = None
        self.engine: Optional[LLMEngine] = None
        self._inbox: "queue.Queue[tuple]" = queue.Queue()
        self._streams: Dict[str, tuple] = {}
        self._prompt_len: Dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ids = itertools.count()
        self.tally = RequestTally()
        self._snapshots: Any = None  # the framework's SnapshotPublisher (router load signal)
        self._last_load: Optional[int] = None

    @classmethod
    async def from_args(cls, argv: Optional[List[str]] = None):
        args = build_parser().parse_args(argv)
        engine = cls(args)
        wc = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                          model_name=str(engine.model_dir), served_model_name=args.served_model_name,
                          discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                          event_plane=args.event_plane)
        return engine, wc

    async def start(self, worker_id: int) -> EngineConfig:
        if not self.args.no_offload:
            # Tier sizes, directories and policies come from FLEXKV_* / YAML (FLEXKV_CONFIG_PATH).
            # The engine's block is the unit of offload: tokens_per_block follows the model.
            cache = CacheConfig.load().replace(tokens_per_block=self.cfg.block_size)
            self.kv = KVManager(self.cfg.kv_spec(), cache, listener=OffloadEvents(self.relay))
        self.engine = LLMEngine(
            self.cfg, num_device_blocks=self.args.num_device_blocks, kv_manager=self.kv,
            layerwise=not self.args.bulk_load, device_prefix_cache=not self.args.no_device_prefix_cache,
            on_device_stored=lambda h, p, t: self.relay.stored(None, h, p, t),
            on_device_removed=lambda h: self.relay.removed(None, h))
        self._thread = threading.Thread(target=self._loop, name="flexkv-engine", daemon=True)
        self._thread.start()
        if self.kv is not None:
            threading.Thread(target=self._announce_disk, name="flexkv-announce", daemon=True).start()
        return EngineConfig(model=str(self.model_dir), served_model_name=self.args.served_model_name,
                            llm=LlmRegistration(kv_cache_block_size=self.cfg.block_size,
                                                total_kv_blocks=self.args.num_device_blocks,
                                                context_length=self.args.num_device_blocks * self.cfg.block_size))

    async def register_prometheus(self, metrics) -> None:
        collector = OffloadCollector(self.tally, self._device_blocks,
                                     lambda: self.kv.stats() if self.kv is not None else None)
        register_engine_registry(metrics, offload_registry(collector), prefix_filters=[PREFIX])

    def component_metrics_dp_ranks(self) -> List[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

    def _device_blocks(self) -> tuple:
        pool = self.engine.pool
        return pool.num_blocks - pool.num_available, pool.num_blocks

    def _publish_load(self) -> None:
        """Device blocks in use (what the router weighs a worker's load by), on change only."""
        used, total = self._device_blocks()
        if self._snapshots is None or used == self._last_load:
            return
        self._last_load = used
        self._snapshots.publish(0, ComponentSnapshot(kv_used_blocks=used, kv_total_blocks=total,
                                                     gpu_cache_usage=used / total, dp_rank=0,
                                                     kv_cache_hit_rate=self.tally.hit_rate))

    async def kv_event_sources(self):
        return [ZmqSource(endpoint=self.relay.endpoint)]

    async def generate(self, request, context) -> AsyncGenerator[Dict[str, Any], None]:
        tokens = list(request["token_ids"])
        so, sc = request.get("sampling_options") or {}, request.get("stop_conditions") or {}
        params = SamplingParams(max_tokens=int(sc.get("max_tokens") or 16),
                                temperature=float(so.get("temperature") or 0.0), seed=so.get("seed"),
                                stop_token_ids=tuple(sc.get("stop_token_ids_hidden") or ()))
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        rid = f"dyn-{next(self._ids)}"
        self._inbox.put((rid, tokens, params, loop, out))
        n = 0
        while True:
            item = await out.get()
            if isinstance(item, BaseException):
                raise item
            token, finished, reason, cached = item
            n += 1
            chunk: Dict[str, Any] = {"token_ids": [token], "index": 0}
            if finished:
                chunk["finish_reason"] = reason
                chunk["completion_usage"] = {"prompt_tokens": len(tokens), "completion_tokens": n,
                                             "total_tokens": len(tokens) + n,
                                             "prompt_tokens_details": {"cached_tokens": cached}}
                yield chunk
                return
            yield chunk

    async def cleanup(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.kv is not None:
            self.kv.shutdown()
        self.relay.close()

    def _announce_disk(self) -> None:
        """A restarted worker's re-adopted disk blocks are news to the router: announce them once
        the Worker's relay subscribed to our events."""
        if self.relay.wait_for_subscriber(timeout=120):
            n = self.kv.announce_adopted()
            if n:
                log.info("announced %d re-adopted disk blocks to the router", n)
        else:
            log.warning("no KV event subscriber after 120 s: re-adopted disk blocks stay unannounced")

    # ---- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                block = not engine.has_unfinished()
                while True:
                    rid, tokens, params, loop, out = self._inbox.get(block=block, timeout=0.1 if block else None)
                    block = False
                    try:
                        engine.add_request(tokens, params, request_id=rid)
                        self._streams[rid] = (loop, out)
                        self._prompt_len[rid] = len(tokens)
                    except ValueError as e:  # bad request: tell its caller, keep serving others
                        loop.call_soon_threadsafe(out.put_nowait, e)
            except queue.Empty:
                pass
            if not engine.has_unfinished():
                continue
            for o in engine.step():
                loop, out = self._streams[o.request_id]
                reason = {"length": "length", "stop": "stop"}.get(o.finish_reason or "", None)
                cached = sum(o.cached_tokens.values())  # device prefix cache + offload tiers
                if o.finished:  # counted before the caller hears of it: a scrape after the reply sees it
                    del self._streams[o.request_id]
                    self.tally.add(self._prompt_len.pop(o.request_id), o.cached_tokens)
                loop.call_soon_threadsafe(out.put_nowait, (o.new_token, o.finished, reason, cached))
            engine._finished.clear()
            self._publish_load()


def main() -> None:
    for var, value in LOOPBACK_ENV.items():
        os.environ.setdefault(var, value)
    run(FlexKVWorkerEngine)


if __name__ == "__main__":
    main()
