"""LLMEngine: continuous batching over a paged KV cache, with an optional offload connector."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from dynamo_flexkv.core.contract import EngineOffload
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.tasks import TaskFailed, TaskStatus
from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig
from dynamo_flexkv.integrations.reference_engine.kv_cache import DeviceBlockPool, NoFreeBlocks, PagedKVCache
from dynamo_flexkv.integrations.reference_engine.model import LlamaModel, SeqChunk
from dynamo_flexkv.integrations.reference_engine.request import (
    Request,
    RequestOutput,
    RequestState,
    SamplingParams,
    sample,
)


class LLMEngine:
    def __init__(
        self,
        cfg: EngineModelConfig,
        *,
        num_device_blocks: int,
        model: LlamaModel | None = None,
        device: str = "cpu",
        offload: EngineOffload | None = None,
        offload_puts: bool = True,
        device_prefix_cache: bool = True,
        max_batch_tokens: int = 16384,
        max_running: int = 16,
        max_overtakes: int = 16,
        seed: int = 0,
        on_device_stored: Callable[[list[int], int | None, list[int]], None] | None = None,
        on_device_removed: Callable[[list[int]], None] | None = None,
        remote_fill: Callable[[Request, int, int], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model or LlamaModel(cfg, device, seed)
        self.kv_cache = PagedKVCache(cfg, num_device_blocks, device)
        self.pool = DeviceBlockPool(num_device_blocks, on_device_stored, on_device_removed)
        # The offload tiers, only through the engine contract (open_offload: embedded or the node's
        # cache service); its ``layerwise`` says whether a step waits per layer or for the whole load.
        self.connector: EngineOffload | None = offload
        if self.connector is not None:
            if self.connector.bs != cfg.block_size:
                raise ValueError(
                    f"the offload's tokens_per_block={self.connector.bs} differs from the "
                    f"engine's block_size={cfg.block_size}: set tokens_per_block={cfg.block_size}"
                )
            self.connector.register(self.kv_cache.layers)
        self.layerwise = offload.layerwise if offload is not None else True
        self.offload_puts = offload_puts  # False: load from offload tiers but never store (benchmarks)
        self.device_prefix_cache = device_prefix_cache  # False: blocks are freed when a request ends
        # Disaggregated decode (dynamo_flexkv.integrations.disagg): fills prompt blocks [first, cap) that the local
        # tiers lack from the prefill worker, before any compute; returns how many it filled.
        self.remote_fill = remote_fill
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes={max_overtakes} must be >= 0 (0: first come, first served)")
        # A waiting request that does not fit the free blocks lets later ones that fit go first,
        # at most this many times; then admission waits for it (bounded starvation).
        self.max_overtakes = max_overtakes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._finished: list[Request] = []  # since the last generate() collected them
        self._abort_lock = threading.Lock()
        self._abort_pending: set[str] = set()  # abort() from any thread; applied at a step boundary
        self.aborted = 0
        self.recomputed_loads = 0
        self.load_stall_seconds = 0.0  # time steps spent blocked on offload loads
        self.steps = 0  # steps that computed something
        self.step_requests = 0  # sum over those steps of the requests each batched
        self.step_seconds = 0.0

    # ---- API -------------------------------------------------------------------------------------
    def add_request(
        self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: send at least one token")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        params = params or SamplingParams()
        need = -(-(len(prompt) + params.max_tokens) // self.cfg.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} blocks; the device cache has {self.pool.num_blocks}")
        req = Request(request_id or f"req-{next(self._ids)}", prompt, params, block_hashes(prompt, self.cfg.block_size))
        self.waiting.append(req)
        return req.id

    def abort(self, request_id: str) -> None:
        """Stops a request at the next step boundary (safe from any thread): no more outputs, its
        offload load is cancelled, its device blocks are released — full computed prompt blocks
        stay in the device prefix cache (evictable), the rest are freed. A put of its prompt
        continues (it holds its own references). Unknown or finished ids are ignored."""
        with self._abort_lock:
            self._abort_pending.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def busy(self) -> bool:
        """Requests to run, aborts to apply, or offload tasks whose device blocks are still held:
        step() has work to do (it releases the blocks of finished offload copies)."""
        pending = self.connector is not None and self.connector.tasks_pending > 0
        return self.has_unfinished() or pending or bool(self._abort_pending)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[Request]:
        reqs = {self.add_request(p, params): i for i, p in enumerate(prompts)}
        done: dict[str, Request] = {}
        while self.has_unfinished():
            self.step()
            for r in list(self._finished):
                done[r.id] = r
            self._finished.clear()
        return [done[rid] for rid in sorted(reqs, key=lambda rid: reqs[rid])]

    def take_finished(self) -> list[Request]:
        """Requests that finished or were aborted since the last call."""
        out, self._finished = self._finished, []
        return out

    def flush(self) -> None:
        """Waits for outstanding offload copies and releases the device blocks they read."""
        if self.connector is not None:
            for hold in self.connector.drain_holds():
                self.pool.release(hold.blocks)

    # ---- one scheduler step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._apply_aborts()
        if self.connector is not None:
            for hold in self.connector.finished_holds():
                self.pool.release(hold.blocks)
        self._admit()
        chunks, reqs = self._build_batch()
        if not chunks:
            return []
        t0 = time.perf_counter()
        stall0 = self.load_stall_seconds
        self.steps += 1
        self.step_requests += len(reqs)
        try:
            return self._run_batch(chunks, reqs)
        finally:
            dt = time.perf_counter() - t0
            self.step_seconds += dt
            if self.connector is not None:
                self._observe_prefill(chunks, reqs, dt - (self.load_stall_seconds - stall0))

    def _observe_prefill(self, chunks: list[SeqChunk], reqs: list[Request], seconds: float) -> None:
        """Cost-aware loading's measure of recompute: a step that only prefilled (no decode token
        in it), its compute time without the time it waited for loads."""
        if not all(ch.start < len(r.prompt) for ch, r in zip(chunks, reqs)):
            return
        self._offload().observe_prefill(sum(len(ch.tokens) for ch in chunks), max(len(r.prompt) for r in reqs), seconds)

    def _run_batch(self, chunks: list[SeqChunk], reqs: list[Request]) -> list[RequestOutput]:
        loading = [r for r in reqs if r.load_task is not None]
        if loading and not self.layerwise:
            for r in loading:  # bulk: the whole prefix lands before any compute
                self._settle_load(r)
            chunks, reqs = self._build_batch()
            loading = []
        hook = self._layer_waiter(loading) if loading else None
        logits = self.model.forward(chunks, self.kv_cache, hook)
        redo = {r.id for r in loading if not self._settle_load(r)}
        outputs, li = [], 0
        for ch, r in zip(chunks, reqs):
            row = None
            if ch.want_logits:
                row, li = logits[li], li + 1
            if r.id in redo:
                continue  # its prefix did not load: the next step recomputes it
            r.num_computed = ch.start + len(ch.tokens)
            self._cache_full_blocks(r)
            if row is not None:
                outputs.append(self._emit(r, row))
        return outputs

    # ---- internals ------------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        if not self._abort_pending:
            return
        with self._abort_lock:
            ids, self._abort_pending = self._abort_pending, set()
        for req in [r for r in itertools.chain(self.waiting, self.running) if r.id in ids]:
            if req.state is RequestState.WAITING:
                self.waiting.remove(req)
                if req.prefetch_task is not None and self.connector is not None:
                    self.connector.cancel_prefetch(req.prefetch_task)  # collected with the other prefetches
            else:
                self.running.remove(req)
                if req.load_task is not None:
                    # Its copies may still be writing the blocks: they come back once drained.
                    self._offload().cancel_load(req.load_task, req.block_table)
                    req.load_task = None
                else:
                    self.pool.release(req.block_table)
            req.state, req.finish_reason = RequestState.FINISHED, "abort"
            self.aborted += 1
            self._finished.append(req)

    def _admit(self) -> None:
        """In arrival order; a request that does not fit is skipped (no head-of-line blocking)
        until ``max_overtakes`` later requests went past it, then nothing is admitted past it
        until running requests free enough blocks for it."""
        skipped: list[Request] = []
        for req in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            if any(s.overtaken >= self.max_overtakes for s in skipped):
                break
            if not self._allocate(req):
                skipped.append(req)
                continue
            for s in skipped:
                s.overtaken += 1
            self.waiting.remove(req)
            req.state = RequestState.RUNNING
            self.running.append(req)
        if self.connector is not None:
            # Queue-time prefetch: requests next in line bring their disk prefix into host memory
            # while they wait for a slot or for device blocks.
            for req in itertools.islice(self.waiting, self.max_running):
                if req.prefetch_task is None and not req.prefetch_tried:
                    req.prefetch_tried = True  # once: a tier that is down is not asked every step
                    req.prefetch_task = self.connector.prefetch(req.prompt)

    def _allocate(self, req: Request) -> bool:
        bs = self.cfg.block_size
        cap = (len(req.prompt) - 1) // bs  # keep one token to compute: it yields the first logits
        hashes = req.hashes.sequence[:cap]
        total = -(-(len(req.prompt) + req.params.max_tokens) // bs)
        dev = self.pool.match(hashes)
        try:
            new = self.pool.allocate(total - len(dev))
        except NoFreeBlocks:
            self.pool.release(dev)
            return False
        req.block_table = dev + new
        req.num_computed = req.device_hit_tokens = len(dev) * bs
        if self.connector is not None and cap > len(dev):
            tid = self.connector.load(
                req.prompt[: cap * bs], req.block_table[:cap], len(dev), prompt_tokens=len(req.prompt)
            )
            if tid is not None:
                req.load_task = tid
                by_tier = self.connector.planned_tokens_by_tier(tid)
                req.offload_hit_tokens = sum(by_tier.values())  # host + disk + remote
                req.disk_hit_tokens = by_tier["disk"]
                req.remote_hit_tokens = by_tier.get("remote", 0)
                req.num_computed += req.offload_hit_tokens
        if self.remote_fill is not None:
            req.num_computed += self.remote_fill(req, req.num_computed // bs, cap) * bs
        return True

    def _build_batch(self):
        chunks, reqs, budget = [], [], self.max_batch_tokens
        for r in self.running:
            if r.in_prefill:
                n = min(len(r.prompt) - r.num_computed, budget)
                if n <= 0:
                    continue
                toks = r.prompt[r.num_computed : r.num_computed + n]
                chunks.append(SeqChunk(toks, r.num_computed, r.block_table, r.num_computed + n == len(r.prompt)))
                budget -= n
            else:
                pos = len(r.prompt) + len(r.output) - 1
                chunks.append(SeqChunk([r.output[-1]], pos, r.block_table, True))
                budget -= 1
            reqs.append(r)
        return chunks, reqs

    def _layer_waiter(self, loading: list[Request]):
        failed = set()

        def wait(layer: int) -> None:
            for r in loading:
                if r.id in failed or r.load_task is None:
                    continue
                t0 = time.perf_counter()
                try:
                    self._offload().wait_layer(r.load_task, layer)
                except TaskFailed:
                    failed.add(r.id)  # computed on garbage; _settle_load sends it back
                finally:
                    self.load_stall_seconds += time.perf_counter() - t0

        return wait

    def _offload(self) -> EngineOffload:
        """The tiers, where a caller runs only with offload configured (a request has a load task)."""
        if self.connector is None:
            raise RuntimeError("LLMEngine: an offload call without offload configured")
        return self.connector

    def _settle_load(self, r: Request) -> bool:
        """Finishes a request's load; on failure its loaded range is recomputed instead."""
        if r.load_task is None:
            raise RuntimeError(f"request {r.id}: settling a load it does not have")
        t0 = time.perf_counter()
        result = self._offload().finish(r.load_task)
        self.load_stall_seconds += time.perf_counter() - t0
        r.load_task = None
        if result.status is TaskStatus.SUCCESS:
            return True
        self.recomputed_loads += 1
        r.num_computed = r.device_hit_tokens
        r.offload_hit_tokens = r.disk_hit_tokens = r.remote_hit_tokens = 0
        return False

    def _cache_full_blocks(self, r: Request) -> None:
        bs = self.cfg.block_size
        seq = r.hashes.sequence
        full = min(r.num_computed, len(r.prompt)) // bs
        if self.device_prefix_cache:
            for i in range(max(r.cached_blocks, r.device_hit_tokens // bs), full):
                parent = int(seq[i - 1]) if i else None
                self.pool.cache(r.block_table[i], int(seq[i]), parent, r.prompt[i * bs : (i + 1) * bs])
            r.cached_blocks = max(r.cached_blocks, full)
        if self.connector is not None and self.offload_puts and r.num_computed == len(r.prompt) and not r.output:
            # Prefill finished: offload the prompt's full blocks; the put holds them meanwhile.
            n = len(r.prompt) // bs
            if n:
                self.pool.ref(r.block_table[:n])
                if self.connector.store(r.prompt, r.block_table) is None:  # a tier fault: nothing is held
                    self.pool.release(r.block_table[:n])

    def _emit(self, r: Request, logits: torch.Tensor) -> RequestOutput:
        tok = sample(logits, r)
        if r.params.record_logits:
            r.logits.append(logits.detach().cpu().clone())
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        r.output.append(tok)
        if tok in r.params.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output) >= r.params.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            r.state = RequestState.FINISHED
            self.running.remove(r)
            self.pool.release(r.block_table)
            self._finished.append(r)
        return RequestOutput(
            r.id, tok, list(r.output), r.finish_reason is not None, r.finish_reason, r.ttft, r.cached_tokens
        )
