"""``python -m dynamo_flexkv.integrations.dynamo_worker``: the reference engine with KVManager offload as a Dynamo
backend (``dynamo.common.backend.LLMEngine``), run by Dynamo's Worker.

The engine runs on one thread of its own (it is not thread-safe); ``generate`` checks a request
against the limits (request_limits.py), hands it to that thread and streams tokens back through
the event loop. A client that disconnects or cancels (Dynamo calls ``abort``, or the stream is
closed) has its request aborted at the next engine step. Shutdown follows Dynamo's Worker:
SIGINT/SIGTERM -> unregister -> grace period -> ``cleanup``, which lets in-flight requests finish
(``--drain-timeout``), aborts the rest, then drains pending offload writes (SSD and journal)
before it releases anything. Device, host and disk KV events leave through one KvEventRelay
socket that the Worker subscribes to (``kv_event_sources``). Offload metrics are bridged into
Dynamo's ``/metrics``; the device-cache load goes to the router through the SnapshotPublisher."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from dynamo.common.backend import EngineConfig, LlmRegistration, WorkerConfig
from dynamo.common.backend import LLMEngine as DynamoLLMEngine
from dynamo.common.backend.engine import GenerateChunk
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
from dynamo.common.backend.run import run
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.inventory import (
    CONTROL,
    CacheReport,
    CacheRequest,
    Cleared,
    Contents,
    KeptReason,
    PrefixBlocks,
    TierCleared,
    TierContents,
    parse_request,
    to_builtins,
    tokenize,
)
from dynamo_flexkv.core.offload import EngineOffload, open_offload
from dynamo_flexkv.integrations.disagg.dynamo_handlers import Role
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV
from dynamo_flexkv.integrations.dynamo_worker.args import (
    build_parser,
    check_event_plane_binds_loopback,
    mark_serving,
    on_sigint,
)
from dynamo_flexkv.integrations.dynamo_worker.metrics import PREFIX, OffloadCollector, RequestTally, offload_registry
from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
from dynamo_flexkv.integrations.dynamo_worker.request_limits import RequestLimits, RequestRefused
from dynamo_flexkv.integrations.events import KvEventRelay, OffloadEvents
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine

log = logging.getLogger(__name__)

# Where a response's per-tier cached prompt tokens travel: the final chunk's engine_data, which
# Dynamo's frontend returns as nvext.engine_data when the request asks for it
# (nvext.extra_fields: ["engine_data"]).
ENGINE_DATA_KEY = "flexkv"

SUBSCRIBER_WAIT_S = 10.0  # on_endpoint_ready: the Worker's publisher subscribed already, unless KV routing is off
LATE_SUBSCRIBER_WAIT_S = 120.0
REPEAT_AFTER_S = (0.5, 1.5, 4.0, 10.0)  # _repeat_announcement: waits between the repeats

engine_failed = False  # the engine thread died and the worker stopped itself: exit non-zero


@dataclass
class _Stream:
    """One request's way back to its generate() coroutine."""

    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    prompt_len: int
    prompt: list[int] = field(default_factory=list)
    handover: Any = None  # decode: the prefill worker's HandoverParams

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


class FlexKVWorkerEngine(DynamoLLMEngine):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = EngineModelConfig.load(args.model)
        self.limits = RequestLimits(
            context_window=args.num_device_blocks * self.cfg.block_size, vocab_size=self.cfg.vocab_size
        )
        self.model_dir = write_model_dir(
            self.cfg,
            args.model_dir or tempfile.mkdtemp(prefix="flexkv-model-"),
            context_length=self.limits.context_window,
        )
        self.relay = KvEventRelay(self.cfg.block_size)
        self.offload: EngineOffload | None = None  # the tiers, embedded or the node's cache service
        self.engine: LLMEngine | None = None
        # ("add", rid, tokens, params, stream) or ("abort", rid), in arrival order: an abort never
        # overtakes its request.
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._live: dict[str, str] = {}  # Dynamo context id -> our request id, requests not yet ended
        self._closing = False  # cleanup() started: refuse new requests
        self._failed: str | None = None  # the engine thread died: why
        # What a dead engine thread does to its worker: SIGTERM, Dynamo's graceful stop (tests that
        # drive the class in their own process replace it).
        self.stop_worker: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.tally = RequestTally()
        self._snapshots: Any = None  # the framework's SnapshotPublisher (router load signal)
        self._last_load: int | None = None
        self._cleaned = False
        self.role = Role(
            args
        )  # disaggregation: agg, prefill or decode (dynamo_flexkv.integrations.disagg.dynamo_handlers)

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        args = build_parser().parse_args(argv)
        engine = cls(args)
        wc = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_name=str(engine.model_dir),
            served_model_name=args.served_model_name,
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            disaggregation_mode=engine.role.dynamo_mode,
        )
        return engine, wc

    async def start(self, worker_id: int) -> EngineConfig:
        mark_serving()  # Dynamo's Worker owns SIGINT from here: a stop drains (worker_args.on_sigint)
        if not self.args.no_offload:
            # Tier sizes, directories and policies come from FLEXKV_* / YAML (FLEXKV_CONFIG_PATH).
            # The engine's block is the unit of offload: tokens_per_block follows the model.
            cache = CacheConfig.load().replace(tokens_per_block=self.cfg.block_size)
            self.offload = open_offload(
                self.cfg.kv_spec(),
                cache,
                layerwise=not self.args.bulk_load,
                listener=OffloadEvents(self.relay),
                engine=f"{self.args.served_model_name}-{worker_id}",
                model_id=f"{self.args.model}|{self.args.served_model_name}",
            )  # remote fingerprint
        self.engine = LLMEngine(
            self.cfg,
            num_device_blocks=self.args.num_device_blocks,
            offload=self.offload,
            device_prefix_cache=not self.args.no_device_prefix_cache,
            on_device_stored=lambda h, p, t: self.relay.stored(None, h, p, t),
            on_device_removed=lambda h: self.relay.removed(None, h),
        )
        self.role.start(self.engine)
        self._thread = threading.Thread(target=self._loop, name="flexkv-engine", daemon=True)
        self._thread.start()
        log.info(
            "flexkv worker serving %s: context window %d tokens, vocabulary %d, offload %s",
            self.args.served_model_name,
            self.limits.context_window,
            self.cfg.vocab_size,
            "off" if self.offload is None else self.offload.describe(),
        )
        return EngineConfig(
            model=str(self.model_dir),
            served_model_name=self.args.served_model_name,
            llm=LlmRegistration(
                kv_cache_block_size=self.cfg.block_size,
                total_kv_blocks=self.args.num_device_blocks,
                context_length=self.limits.context_window,
            ),
        )

    async def register_prometheus(self, metrics) -> None:
        register_engine_registry(metrics, offload_registry(self.collector()), prefix_filters=[PREFIX])

    def collector(self) -> OffloadCollector:
        """The flexkv_* families of this worker's /metrics."""
        return OffloadCollector(
            self.tally,
            self._device_blocks,
            lambda: self.offload.stats() if self.offload is not None else None,
            self._engine_stats,
            lambda: None if self.role.decode is None else self.role.decode.stats,
            lambda: None if self.role.prefill is None else self.role.prefill.leases,
        )

    # ---- what is cached (dynamo-flexkv cache; core/inventory.py) --------------------------------------
    def supported_controls(self) -> set:
        return {CONTROL}  # POST /engine/control/flexkv_cache on the system port

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        if control != CONTROL:
            return {"status": "error", "message": f"unsupported engine control: {control}"}
        try:
            report = await asyncio.to_thread(self.cache_admin, parse_request(body))
        except (ValueError, RuntimeError, FlexKVError) as e:
            return {"status": "error", "message": str(e)}
        return {"status": "ok", "report": to_builtins(report)}

    def cache_admin(self, req: CacheRequest) -> CacheReport:
        """What this worker's tiers hold (its device prefix cache, then the offload tiers: its own, or
        its namespace of the node cache), a prompt's blocks on them, or a clear of what no request
        and no copy uses. The device part runs on the engine thread, which owns the device pool."""
        described = self.offload.describe() if self.offload is not None else {}
        if "unavailable" in described and any(req.wants(t) for t in ("host", "disk", "remote")):
            raise RuntimeError(
                f"this worker's node cache is not attached now ({described['unavailable']}): ask the cache "
                "server itself (dynamo-flexkv cache --socket), or this worker's device tier alone (--tier device)"
            )
        have = ["device"] + [t for t, n in (described.get("tiers") or {}).items() if n]
        have += ["remote"] if described.get("remote") else []
        req.check(have)
        if req.op == "prefix" and req.tokens is None:
            req = msgspec.structs.replace(req, tokens=tokenize(str(self.model_dir), req.text or ""))
        mode = described.get("mode", "no offload")
        report = CacheReport(f"worker {self.args.served_model_name} ({mode})", req.op)
        offload_tiers = [t for t in have if t != "device" and req.wants(t)]
        if self.offload is not None and offload_tiers:
            report = msgspec.structs.replace(self.offload.cache_admin(req), target=report.target)
        if req.wants("device"):
            self._device_admin(req, report)
        if req.op == "clear":
            self.relay.flush(force=True)  # the router hears the removals now, not at the next step
        return report

    def _started(self) -> LLMEngine:
        """The engine start() made (every caller runs after it)."""
        if self.engine is None:
            raise RuntimeError("FlexKVWorkerEngine: the engine is used before start() made it")
        return self.engine

    def _tiers(self) -> EngineOffload:
        """The tiers start() opened (callers run only where offload is configured)."""
        if self.offload is None:
            raise RuntimeError("FlexKVWorkerEngine: the tiers are used, but none were opened")
        return self.offload

    def _device_admin(self, req: CacheRequest, report: CacheReport) -> None:
        """Adds the device tier (this engine's prefix cache) to ``report``'s namespace."""
        pool = self._started().pool
        replace = msgspec.structs.replace
        model, tenant = f"{self.args.model}|{self.args.served_model_name}", ""
        if req.op == "contents":
            cached, in_use = self._on_engine_thread(lambda: (pool.num_cached, pool.num_cached_in_use))
            block_bytes = self.cfg.kv_spec().token_bytes() * self.cfg.block_size
            device = TierContents("device", cached, cached, 0, in_use, block_bytes, pool.num_blocks)
            c = report.contents[0] if report.contents else Contents(model, tenant, [])
            report.contents[:1] = [replace(c, tiers=[device, *c.tiers])]
        elif req.op == "prefix":
            hashes = block_hashes(req.tokens or [], self.cfg.block_size).sequence
            held = self._on_engine_thread(lambda: pool.peek(hashes))
            p = report.prefixes[0] if report.prefixes else None
            if p is None:
                p = PrefixBlocks(
                    model, tenant, len(req.tokens or []), self.cfg.block_size, [int(h) for h in hashes], {}
                )
            report.prefixes[:1] = [replace(p, held={"device": held, **p.held})]
        else:
            cleared, kept = self._on_engine_thread(lambda: (pool.clear(), pool.num_cached))
            device_cleared = TierCleared("device", cleared, {KeptReason.IN_USE.value: kept} if kept else {})
            done = report.cleared[0] if report.cleared else Cleared(model, tenant, [])
            report.cleared[:1] = [replace(done, tiers=[device_cleared, *done.tiers])]
            log.info("cache clear: %d device blocks cleared, %d kept (in use)", cleared, kept)

    def _on_engine_thread(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """``fn()`` run on the engine thread between its steps (it owns the device pool)."""
        if self._failed or self._thread is None:
            raise RuntimeError(self._failed or "the engine has not started")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put(("call", fn, done))
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the engine thread did not get to it within {timeout:.0f} s") from None

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

    def _device_blocks(self) -> tuple:
        pool = self._started().pool
        return pool.num_blocks - pool.num_available, pool.num_blocks

    @property
    def live_requests(self) -> int:
        """Requests accepted and not ended yet (what cleanup() drains before it stops)."""
        return len(self._live)

    def _engine_stats(self) -> dict[str, float]:
        e = self._started()  # plain counters written by the engine thread: a scrape reads them as they are
        return {
            "steps": e.steps,
            "step_requests": e.step_requests,
            "step_seconds": e.step_seconds,
            "load_stall_seconds": e.load_stall_seconds,
            "tier_faults": self.offload.tier_faults if self.offload is not None else 0,
            "kv_events_published": self.relay.events_published,
            "kv_events_skipped": self.relay.skipped,
        }

    def _publish_load(self) -> None:
        """Device blocks in use (what the router weighs a worker's load by), on change only."""
        used, total = self._device_blocks()
        if self._snapshots is None or used == self._last_load:
            return
        self._last_load = used
        self._snapshots.publish(
            0,
            ComponentSnapshot(
                kv_used_blocks=used,
                kv_total_blocks=total,
                gpu_cache_usage=used / total,
                dp_rank=0,
                kv_cache_hit_rate=self.tally.hit_rate,
            ),
        )

    async def kv_event_sources(self):
        return [ZmqSource(endpoint=self.relay.endpoint)]

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, request, context) -> AsyncGenerator[GenerateChunk, None]:
        if self._closing or self._failed:
            raise EngineShutdown(self._failed or "this worker is shutting down; retry on another worker")
        handover = self.role.prepare(request)
        try:
            tokens, params = self.limits.check(request)
        except RequestRefused as e:
            log.info("refused request %s: %s", _context_id(context), e)
            self._release(handover)
            raise InvalidArgument(str(e)) from None
        except BaseException:
            self._release(handover)
            raise
        loop, out = asyncio.get_running_loop(), asyncio.Queue[Any]()
        rid, cid = f"dyn-{next(self._ids)}", _context_id(context)
        self._live[cid] = rid
        self._inbox.put(("add", rid, tokens, params, _Stream(loop, out, len(tokens), list(tokens), handover)))
        ended, n = False, 0
        extra: dict[str, Any] = {}  # disaggregation: what the final chunk carries (see Role.finished)
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if isinstance(item, dict):  # disaggregation: sent just before the final token
                    extra.update(item)
                    continue
                token, reason, cached = item
                if reason == "cancelled":  # aborted: the engine dropped it
                    ended = True
                    yield {
                        "token_ids": [],
                        "index": 0,
                        "finish_reason": "cancelled",
                        "completion_usage": _usage(len(tokens), n, cached),
                    }
                    return
                n += 1
                chunk: GenerateChunk = {"token_ids": [token], "index": 0}
                if reason is not None:
                    ended = True
                    chunk["finish_reason"] = reason
                    chunk["completion_usage"] = _usage(len(tokens), n, cached)
                    chunk["engine_data"] = {ENGINE_DATA_KEY: {"cached_tokens": cached}}
                    if "disaggregated_params" in extra:
                        chunk["disaggregated_params"] = extra["disaggregated_params"]
                    if "handover_tokens" in extra:
                        chunk["engine_data"][ENGINE_DATA_KEY]["handover_tokens"] = extra["handover_tokens"]
                    yield chunk
                    return
                yield chunk
        finally:
            self._live.pop(cid, None)
            if not ended:  # the stream was closed or cancelled before the request finished
                self._inbox.put(("abort", rid))

    def _release(self, handover: Any) -> None:
        """Decode: a request refused before the engine saw it will not pull; the engine thread
        sends the prefill worker its lease release (the NIXL agent is driven from that thread)."""
        if handover is not None:
            self._inbox.put(("release", handover))

    async def abort(self, context) -> None:
        """Dynamo calls this when the client disconnects or the request is cancelled."""
        rid = self._live.get(_context_id(context))
        if rid is not None:
            log.debug("abort request %s (%s)", _context_id(context), rid)
            self._inbox.put(("abort", rid))

    # ---- shutdown ------------------------------------------------------------------------------------
    async def cleanup(self) -> None:
        """After Dynamo unregistered this worker and waited its grace period: refuse new requests,
        give in-flight ones ``--drain-timeout`` seconds, abort the rest, then flush offload writes
        (SSD blocks and their journal records) before anything is released."""
        if self._cleaned:
            return
        self._cleaned = True
        self._closing = True
        if self._thread is not None:
            deadline = time.monotonic() + self.args.drain_timeout
            while self._live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._live:
                log.warning(
                    "shutdown: aborting %d requests still running after %.0f s",
                    len(self._live),
                    self.args.drain_timeout,
                )
                for rid in list(self._live.values()):
                    self._inbox.put(("abort", rid))
            self._stop.set()
            await asyncio.to_thread(self._thread.join, 30)
        self.role.close()
        if self.offload is not None:
            await asyncio.to_thread(self._flush_offload)
        self.relay.close()
        log.info("flexkv worker stopped")

    async def is_quiescent(self) -> bool | None:
        """Prefill: no handed-over blocks are still leased to a decode worker."""
        return self.role.is_quiescent()

    def _flush_offload(self) -> None:
        if self.engine is not None:
            self.engine.flush()  # collects the engine's own offload tasks
        offload = self._tiers()
        if not offload.drain(timeout=60):
            log.error("shutdown: offload writes still running after 60 s; they are cancelled")
        offload.shutdown()

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        """Dynamo's Worker calls this once its KV event publisher subscribed to our relay and before
        it attaches the model card. The router drops a live event of a worker it has not activated
        yet and asks for nothing again, but when it activates a worker it reads the worker's local
        indexer (the recovery dump): a restarted worker's re-adopted disk blocks announced here are
        in that indexer before any router can know of this worker, so they reach it in the dump."""
        if self.offload is not None:
            await asyncio.to_thread(self._announce_disk, SUBSCRIBER_WAIT_S)

    def _announce_disk(self, wait_s: float) -> None:
        """A restarted worker's re-adopted disk blocks (node mode: the node's blocks) are news to
        the router: announce them once the Worker's publisher subscribed to our events."""
        if not self.relay.wait_for_subscriber(timeout=wait_s):
            if wait_s < LATE_SUBSCRIBER_WAIT_S:  # KV routing off, or a slow start: keep waiting, aside
                threading.Thread(
                    target=self._announce_disk, args=(LATE_SUBSCRIBER_WAIT_S,), name="flexkv-announce", daemon=True
                ).start()
            else:
                log.warning("no KV event subscriber after %.0f s: re-adopted disk blocks stay unannounced", wait_s)
            return
        n = self._tiers().announce_adopted()
        self.relay.flush(force=True)  # out now, before the Worker attaches the model card
        if n:
            log.info("announced %d re-adopted disk blocks to the router", n)
            threading.Thread(target=self._repeat_announcement, name="flexkv-announce-again", daemon=True).start()

    def _repeat_announcement(self) -> None:
        """The announcement normally reaches the router in the recovery dump it reads from the
        worker's local indexer when it activates this worker. Under heavy load the router read
        that dump before the local indexer took the announcement (2 of 40 runs beside a full test
        suite), and dropped the live copy as an inactive publisher's; later events did not bring it
        back (the dump's event id had counted it). So the same blocks are announced again a few
        times after the model card is out: a Stored of blocks the router holds changes nothing."""
        for delay in REPEAT_AFTER_S:
            if self._stop.wait(delay):
                return
            try:
                self._tiers().announce_adopted(repeat=True)
                self.relay.flush(force=True)
            except RuntimeError:  # the relay or the tiers closed: the worker stops
                return

    # ---- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as e:  # a bug or a device fault (tier faults are misses): fail every request
            log.exception("the engine thread failed; this worker cannot serve any more: stopping it")
            self._failed = f"the engine failed ({type(e).__name__}: {e}); retry on another worker"
            global engine_failed
            engine_failed = True
            for stream in self._streams.values():
                stream.send(EngineShutdown(self._failed))
            self._streams.clear()
            # A worker that cannot serve must not stay registered and answer /health "ready": Dynamo's
            # Worker unregisters it and runs cleanup(), then main() exits non-zero, so serve (or the
            # pod's restart policy) starts a fresh one.
            self.stop_worker()
            while not self._stop.is_set():  # requests that raced with the failure, until cleanup
                try:
                    item = self._inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item[0] == "add":
                    item[4].send(EngineShutdown(self._failed))
                elif item[0] == "call":
                    item[2].set_exception(EngineShutdown(self._failed))

    def _serve(self) -> None:
        engine = self._started()
        while True:
            self._take_inbox()
            self.role.service()  # prefill: leases end on release notices or timeout
            if not engine.busy:
                if self._stop.is_set():
                    return  # cleanup() gave in-flight requests their time and aborted the rest
                continue
            for o in engine.step():
                stream = self._streams[o.request_id]
                if o.finished:  # counted before the caller hears of it: a scrape after the reply sees it
                    del self._streams[o.request_id]
                    extra = self.role.finished(o.request_id, stream.prompt)
                    self.tally.add(
                        stream.prompt_len,
                        o.cached_tokens,
                        handover_tokens=0 if extra is None else extra.get("handover_tokens", 0),
                    )
                    if extra is not None:
                        stream.send(extra)
                stream.send((o.new_token, o.finish_reason if o.finished else None, o.cached_tokens))
            for r in engine.take_finished():
                if r.finish_reason == "abort":
                    self.role.aborted(r.id)
                    self.tally.add_aborted()
                    aborted = self._streams.pop(r.id, None)
                    if aborted is not None:
                        aborted.send((None, "cancelled", r.cached_tokens))
            self.relay.flush()  # this step's KV events leave as one frame
            self._publish_load()

    def _take_inbox(self) -> None:
        """New requests and aborts. Blocks briefly when the engine has nothing to compute; while
        offload copies still hold device blocks it polls so they are released promptly."""
        engine = self._started()
        timeout: float | None = None if engine.has_unfinished() else (0.005 if engine.busy else 0.1)
        while True:
            try:
                item = self._inbox.get(block=timeout is not None, timeout=timeout)
            except queue.Empty:
                return
            timeout = None
            if item[0] == "abort":
                if item[1] in self._streams:
                    engine.abort(item[1])
                continue
            if item[0] == "release":
                self.role.refused(item[1])
                continue
            if item[0] == "call":  # an operator's look at or clear of the device cache (cache_admin)
                try:
                    item[2].set_result(item[1]())
                except Exception as e:  # noqa: BLE001 - the caller hears it; the engine goes on
                    item[2].set_exception(e)
                continue
            _, rid, tokens, params, stream = item
            try:
                engine.add_request(tokens, params, request_id=rid)
                self._streams[rid] = stream
                self.role.added(rid, stream.handover)
            except ValueError as e:  # the limits should have caught it: still tell its caller
                self.role.refused(stream.handover)
                stream.send(InvalidArgument(str(e)))


def _context_id(context) -> str:
    try:
        return str(context.id())
    except (AttributeError, TypeError):  # a context without an id (direct calls in tests)
        return f"ctx-{id(context)}"


def _usage(prompt_len: int, completion: int, cached: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def main() -> None:
    for var, value in LOOPBACK_ENV.items():
        os.environ.setdefault(var, value)
    check_event_plane_binds_loopback(build_parser().parse_args().event_plane)
    # Dynamo's Worker owns SIGINT/SIGTERM (unregister, grace period, drain, cleanup) and chains to
    # the handler installed before it: Python's default one would raise KeyboardInterrupt in the
    # middle of that drain. Set before the Worker starts, so its handler is installed on top.
    signal.signal(signal.SIGINT, on_sigint)
    from dynamo_flexkv.core.transfer.nixl_agent import exit_past_libnl  # prefill/decode roles create a UCX agent

    with exit_past_libnl():
        run(FlexKVWorkerEngine)
        if engine_failed:
            raise SystemExit(1)  # stopped itself: its engine thread failed (see _loop)


if __name__ == "__main__":
    main()
