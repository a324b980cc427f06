"""``python -m dynamo_flexkv.dynamo.worker``: the reference engine with KVManager offload as a Dynamo
backend (``dynamo.common.backend.LLMEngine``), run by Dynamo's Worker.

The engine runs on one thread of its own (it is not thread-safe); ``generate`` hands requests to
it and streams tokens back through the event loop. Device, host and disk KV events leave through
one KvEventRelay socket that the Worker subscribes to (``kv_event_sources``)."""

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
from dynamo.common.backend.publisher import ZmqSource
from dynamo.common.backend.run import run

from dynamo_flexkv.config import CacheConfig
from dynamo_flexkv.dynamo.model_dir import write_model_dir
from dynamo_flexkv.engine import EngineModelConfig, LLMEngine, SamplingParams
from dynamo_flexkv.events import KvEventRelay, OffloadEvents
from dynamo_flexkv.manager import KVManager

log = logging.getLogger(__name__)


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
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ids = itertools.count()

    @classmethod
    async def from_args(cls, argv: Optional[List[str]] = None):
        p = argparse.ArgumentParser(prog="python -m dynamo_flexkv.dynamo.worker", description=__doc__)
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
        args = p.parse_args(argv)
        engine = cls(args)
        wc = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                          model_name=str(engine.model_dir), served_model_name=args.served_model_name,
                          discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                          event_plane=args.event_plane)
        return engine, wc

    async def start(self, worker_id: int) -> EngineConfig:
        if not self.args.no_offload:
            # Tier sizes, directories and policies come from FLEXKV_* / YAML (FLEXKV_CONFIG_PATH).
            self.kv = KVManager(self.cfg.kv_spec(), CacheConfig.load(), listener=OffloadEvents(self.relay))
        self.engine = LLMEngine(
            self.cfg, num_device_blocks=self.args.num_device_blocks, kv_manager=self.kv,
            layerwise=not self.args.bulk_load, device_prefix_cache=not self.args.no_device_prefix_cache,
            on_device_stored=lambda h, p, t: self.relay.stored(None, h, p, t),
            on_device_removed=lambda h: self.relay.removed(None, h))
        self._thread = threading.Thread(target=self._loop, name="flexkv-engine", daemon=True)
        self._thread.start()
        return EngineConfig(model=str(self.model_dir), served_model_name=self.args.served_model_name,
                            llm=LlmRegistration(kv_cache_block_size=self.cfg.block_size,
                                                total_kv_blocks=self.args.num_device_blocks,
                                                context_length=self.args.num_device_blocks * self.cfg.block_size))

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
                loop.call_soon_threadsafe(out.put_nowait, (o.new_token, o.finished, reason, cached))
                if o.finished:
                    del self._streams[o.request_id]
            engine._finished.clear()


def main() -> None:
    for var in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        os.environ.setdefault(var, "127.0.0.1")
    run(FlexKVWorkerEngine)


if __name__ == "__main__":
    main()
