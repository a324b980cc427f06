"""The connector's scheduler half: decides what to move, never touches bytes.

* ``matched_tokens``: after vLLM's own prefix cache, how much more of the prompt the tiers hold
  (asked of rank 0's worker, see lookup.py; "not yet" while the answer is on its way). Loads are
  synchronous in vLLM's sense: they happen inside the step that computes the rest of the
  prompt, layer by layer.
* ``after_alloc`` turns a hit into a LoadSpec for the blocks vLLM allocated;
* ``request_finished`` turns a finished request's computed full blocks into a SaveSpec and keeps
  its blocks alive (True) until the worker reports the store's device copy done;
* ``build_meta`` hands the step's loads and saves to the workers, and says whether the step only
  prefills (the workers time such steps: cost-aware loading's measure of recompute);
* the tiers' KV events arrive with the workers' output and leave through vLLM's publisher;
* with ``handover`` (disaggregated workers, handover.py): on prefill, the step that completes a
  prompt has its blocks digested and ``request_finished`` holds them and names them in
  kv_transfer_params; on decode, such params are a hit of the whole prompt, read from the prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.integrations.disagg.params import HandoverRefused
from dynamo_flexkv.integrations.request_log import lookup_tokens, prompt_key
from dynamo_flexkv.integrations.vllm_connector.groups import FULL, is_hybrid
from dynamo_flexkv.integrations.vllm_connector.handover import KEY, SourceInfo, VllmHandover, read_source
from dynamo_flexkv.integrations.vllm_connector.hints import HintRefused, fetch_hint
from dynamo_flexkv.integrations.vllm_connector.lookup import LookupClient
from dynamo_flexkv.integrations.vllm_connector.protocol import FlexKVMetadata, LoadSpec, SaveSpec, lookup_endpoint
from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings, adapter_id

if TYPE_CHECKING:  # vLLM's types at the boundary (vllm_api.py checks the fields read at start-up)
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _lora(request: Request) -> str | None:
    """The request's LoRA adapter as the tiers key it (its blocks' hashes take it as the adapter's
    name): name, path and, for a local directory, its files (settings.adapter_id), taken now. An
    adapter written over the old one at the same path and hot-swapped in under the same name gets
    other keys; the worker's WeightWatch drops what was stored in between (weights.py)."""
    lr = request.lora_request
    if lr is None or not lr.lora_name:
        return None
    return adapter_id(lr.lora_name, lr.lora_path)


def _lora_name(request: Request) -> str | None:
    """The request's LoRA adapter by name only: what names a handed-over prompt's blocks between a
    prefill and a decode worker of one request, which serve the same adapter at once, perhaps from
    copies at other paths or with other modification times (the files' digest would refuse every
    such handover)."""
    lr = request.lora_request
    return (lr.lora_name or None) if lr is not None else None


def offloadable(request: Request) -> bool:
    """Whether the request's KV is named by its token ids alone, which our block hashes cover.
    Not so for prompt embeddings (vLLM's token ids are then zeros: two prompts of one length would
    share blocks) or multimodal inputs (placeholder tokens stand for the images): such requests
    are neither looked up nor stored, and vLLM's own prefix cache, which hashes their content,
    still serves them."""
    return request.prompt_embeds is None and not request.mm_features


def _event_hashes(request: Request, n: int) -> list[Any]:
    """vLLM's external hashes of the request's first ``n`` blocks (what its device events carry)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = list(request.block_hashes[:n])
    return [maybe_convert_block_hash(h) for h in hashes] if len(hashes) == n else []


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.s = settings
        self.bs = settings.block_size
        # A hybrid model (groups.py): every group's blocks travel, and loads run ahead of the
        # request's first step (vLLM recomputes a multi-group request only as a whole: a failed
        # load must be reported per request, which only an asynchronous load can).
        self.hybrid = is_hybrid(settings.groups)
        self._loading: set[str] = set()  # loads run ahead whose end vLLM has not seen yet
        self._main = next((k for k, g in enumerate(settings.groups) if g.kind in FULL), 0)
        self.client = LookupClient(
            [lookup_endpoint(settings.engine_id, settings.run_dir, r) for r in range(settings.tp_size)],
            wait_s=settings.lookup_wait_ms / 1000.0,
            give_up_s=settings.lookup_give_up_s,
        )
        self._hits: dict[str, tuple[int, int, VllmHandover | None]] = {}  # request -> (vLLM's computed
        # tokens, tokens we load, the handover they come from or None for the tiers)
        self._prefills: dict[str, tuple[Any, list[int]]] = {}  # handover prefill side: request, its blocks so far
        self._digests: list[tuple[str, list[int], list[int]]] = []  # (request, block ids, their sequence hashes)
        self._holds: list[tuple[str, float]] = []
        self._source: SourceInfo | None = None
        self._source_read = False
        self.handovers_refused = 0
        self._loads: list[LoadSpec] = []
        self._saves: list[SaveSpec] = []
        # Plans built so far, and the step that first scheduled each running request: a save names
        # it, so the worker stores nothing computed before its weights changed (SaveSpec.first_step).
        self._step = 0
        self._first_step: dict[str, int] = {}
        self._events: list[Any] = []
        self._prompt_len: dict[str, int] = {}  # scheduled request -> its prompt's length (0: no token ids)
        # Prompt tokens of the requests scheduled for the first time since the last plan (each
        # request once: a preempted one scheduled again is in _prompt_len already), as vLLM's
        # vllm:prompt_tokens_total counts them: flexkv_prompt_tokens_total (FlexKVMetadata).
        self._new_prompt_tokens = 0
        # Waiting request -> the worker's answer (end of the prefix to load, in tokens): vLLM asks
        # again at every step a request waits, and one decision per request is what the cost
        # model counts; the answer is dropped once vLLM allocates the request (or it finishes).
        self._answers: dict[str, int] = {}
        self.lookups = self.hit_tokens = self.saved_requests = 0

    def _handover_of(self, request: Request) -> VllmHandover | None:
        if not self.s.handover:
            return None
        try:
            return VllmHandover.from_params(request.kv_transfer_params)
        except HandoverRefused as e:
            self.handovers_refused += 1
            log.warning(
                "FlexKVConnector: request %s: %s; the next connector, if any, hands it over", request.request_id, e
            )
            return None

    def _hint_of(self, request: Request) -> tuple[str, int, str] | None:
        """The request's router hint (hints.py) as the lookup carries it to the worker, which pulls
        and counts it; None without one or where hints are off."""
        if self.s.secondary_tiers is None or getattr(request, "kv_hints", None) is None:
            return None
        try:
            hint = fetch_hint(request.kv_hints, request.block_hashes)
        except HintRefused as e:
            log.info("FlexKVConnector: request %s: router hint refused (%s)", request.request_id, e)
            return ("", 0, e.reason)
        return None if hint is None else (hint.endpoint, hint.blocks, "")

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        if num_computed % self.bs or not offloadable(request):
            return 0, False
        # Whole blocks, and at least one token left for vLLM to compute (it needs the logits).
        usable = lookup_tokens(request.num_tokens, self.bs)
        h = self._handover_of(request)
        if h is not None:  # the prefill worker holds the prompt: read it from there, not the tiers
            external = min(usable, len(h.blocks) * self.bs) - num_computed
            if external <= 0:
                return 0, False
            self._hits[request.request_id] = (num_computed, external, h)
            return external, False
        if not self.s.load or usable <= num_computed:
            return 0, False
        hit = self._answers.get(request.request_id)
        if hit is None:
            # The decision is about what vLLM lacks: the blocks beyond its own prefix-cache hit.
            hit = self.client.query(
                request.request_id,
                request.all_token_ids[:usable],
                _lora(request),
                request.cache_salt,
                request.num_tokens,
                num_computed // self.bs,
                self._hint_of(request),
            )
            if hit is None:
                return None, False  # asked; vLLM asks again next step
            self._answers[request.request_id] = hit
            self.lookups += 1
        external = (min(hit, usable) - num_computed) // self.bs * self.bs
        if external <= 0:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = (num_computed, external, None)
        return external, self.hybrid

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._answers.pop(request.request_id, None)  # scheduled: a later wait (preemption) asks anew
        self._first_step.setdefault(request.request_id, self._step + 1)  # the plan built next
        params = request.kv_transfer_params
        if (
            self.s.handover
            and isinstance(params, dict)
            and params.get("do_remote_decode")
            and offloadable(request)
            and self._source_info() is not None
        ):
            self._prefills[request.request_id] = (request, [])  # block ids arrive with build_meta
            # Ours from here: a NixlConnector after us in the MultiConnector (there only because
            # Dynamo requires one) then neither tracks, holds nor names the blocks, and decode's
            # copy of it has nothing to do (no side-channel handshake, no second lease to end).
            request.kv_transfer_params = {**params, "do_remote_decode": False}
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        local, external, handover = hit
        if external != num_external_tokens:  # vLLM took less than offered: load what it allocated for
            external = num_external_tokens // self.bs * self.bs
        end = (local + external) // self.bs
        per_group = blocks.get_block_ids()
        block_ids = list(per_group[self._main][:end])
        if len(block_ids) < end:
            log.warning(
                "FlexKVConnector: request %s has %d blocks for a %d-block load; not loading",
                request.request_id,
                len(block_ids),
                end,
            )
            return
        groups = self._group_ids(per_group, end) if self.hybrid and handover is None else {}
        if groups:
            self._loading.add(request.request_id)
        log_key = None
        if self.s.request_log:  # named as its lookup was (request_log.py)
            log_key = prompt_key(request.all_token_ids[: lookup_tokens(request.num_tokens, self.bs)])
        self._loads.append(
            LoadSpec(
                request.request_id,
                list(request.all_token_ids[: end * self.bs]),
                block_ids,
                local // self.bs,
                _lora(request) if handover is None else _lora_name(request),
                request.cache_salt,
                _event_hashes(request, end),
                handover,
                groups,
                log_key,
            )
        )
        self.hit_tokens += external

    def build_meta(self, scheduler_output: SchedulerOutput | None = None) -> FlexKVMetadata:
        if self._prefills and scheduler_output is not None:
            self._plan_digests(scheduler_output)
        prefill = self._prefill_work(scheduler_output) if scheduler_output is not None else None
        self._step += 1
        meta = FlexKVMetadata(
            self._loads, self._saves, self._digests, self._holds, prefill, self._step, self._new_prompt_tokens
        )
        self._loads, self._saves, self._digests, self._holds = [], [], [], []
        self._new_prompt_tokens = 0
        return meta

    def _prefill_work(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """(tokens, longest prompt) of a step in which every request computes prompt tokens; None
        when one of them decodes (its output tokens so far > 0) or has no token ids."""
        longest, timed = 0, True
        for new in out.scheduled_new_reqs:  # every one recorded, for its later chunks
            ids = new.prompt_token_ids
            if new.req_id not in self._prompt_len:  # its first scheduling: its prompt counted once
                embeds = new.prompt_embeds  # vLLM's num_prompt_tokens: token ids, else embeddings
                self._new_prompt_tokens += len(ids) if ids is not None else len(embeds) if embeds is not None else 0
            self._prompt_len[new.req_id] = n = len(ids) if ids is not None else 0
            longest, timed = max(longest, n), timed and n > 0
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            n = self._prompt_len.get(rid, 0)
            longest, timed = max(longest, n), timed and n > 0 and cached.num_output_tokens[i] == 0
        tokens = int(out.total_num_scheduled_tokens)
        return (tokens, longest) if timed and tokens > 0 and longest > 0 else None

    def _plan_digests(self, out: SchedulerOutput) -> None:
        """Follows the handover prefills' block ids through the step's output; a step that computes
        a prompt's last token has its full blocks digested by the worker right after its forward."""
        for new in out.scheduled_new_reqs:
            got = self._prefills.get(new.req_id)
            if got is not None:
                got[1][:] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            got = self._prefills.get(rid)
            new_ids = cached.new_block_ids[i]
            if got is not None and new_ids is not None:
                if rid in cached.resumed_req_ids:
                    got[1][:] = list(new_ids[0])
                else:
                    got[1].extend(new_ids[0])
        scheduled = out.num_scheduled_tokens
        for rid, (request, ids) in self._prefills.items():
            n = scheduled.get(rid, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                n = request.num_prompt_tokens // self.bs
                # Each block's digest names the prefix it holds (handover.py _content_tags), as
                # decode hashes its own prompt.
                hashes = block_hashes(
                    request.prompt_token_ids[: n * self.bs],
                    self.bs,
                    lora_name=_lora_name(request),
                    cache_salt=request.cache_salt,
                ).sequence.tolist()
                self._digests.append((rid, ids[:n], hashes))

    def _group_ids(self, per_group: Any, n: int) -> dict[int, list[int]]:
        """Each group's first ``n`` block ids (0 where vLLM holds none), by vLLM's group index."""
        return {g.index: list(per_group[k][:n]) for k, g in enumerate(self.s.groups)}

    def request_finished_all(self, request: Request, per_group: Any) -> tuple[bool, dict[str, Any] | None]:
        """A finished request's blocks of every group (vLLM's SupportsHMA call)."""
        if not self.hybrid:
            return self.request_finished(request, list(per_group[0]))
        return self.request_finished(request, list(per_group[self._main]), per_group)

    def request_finished(
        self, request: Request, block_ids: list[int], per_group: Any = None
    ) -> tuple[bool, dict[str, Any] | None]:
        self.client.forget(request.request_id)
        self._hits.pop(request.request_id, None)
        self._prompt_len.pop(request.request_id, None)
        self._answers.pop(request.request_id, None)
        first_step = self._first_step.pop(request.request_id, -1)
        if request.request_id in self._loading:  # finished (aborted) while its load runs ahead
            return self._end_during_load(request.request_id)
        params = self._hand_over(request, block_ids) if request.request_id in self._prefills else None
        held = bool(params and params.get(KEY))
        if not self.s.store or not offloadable(request):
            return held, params
        tokens = request.all_token_ids
        n = min(request.num_computed_tokens, len(tokens), len(block_ids) * self.bs) // self.bs
        if n <= 0:
            return held, params
        groups = self._group_ids(per_group, n) if per_group is not None else {}
        self._saves.append(
            SaveSpec(
                request.request_id,
                list(tokens[: n * self.bs]),
                list(block_ids[:n]),
                _lora(request),
                request.cache_salt,
                _event_hashes(request, n),
                groups,
                first_step=first_step,
            )
        )
        self.saved_requests += 1
        return True, params  # vLLM frees the blocks once a worker lists the request as finished sending

    def _end_during_load(self, rid: str) -> tuple[bool, None]:
        """A request that ends before its load ran ahead: never sent, the load is dropped; sent,
        its blocks stay with vLLM until the load let go of them (the worker reports it then).
        Nothing is stored: its blocks may hold part of a load."""
        self._loading.discard(rid)
        pending = [x for x in self._loads if x.req_id == rid]
        if pending:
            self._loads = [x for x in self._loads if x.req_id != rid]
            return False, None
        self._saves.append(SaveSpec(rid, [], [], after_load=True))
        return True, None

    def loads_ended(self, req_ids: Iterable[str]) -> None:
        """vLLM's finished_recving: loads run ahead that ended (landed or failed)."""
        self._loading.difference_update(req_ids)

    def _source_info(self) -> SourceInfo | None:
        """This engine's worker agent (read once; a worker without one hands nothing over)."""
        if not self._source_read:
            self._source_read = True
            self._source = read_source(self.s.engine_id, self.s.run_dir)
        return self._source

    def _hand_over(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """A finished prefill: its full prompt blocks (digested in their last step) held for decode."""
        self._prefills.pop(request.request_id, None)
        n = min(request.num_prompt_tokens, request.num_computed_tokens) // self.bs
        if n <= 0 or len(block_ids) < n or request.num_computed_tokens < request.num_prompt_tokens:
            # Shorter than a block, or aborted before its prompt was computed: decode computes it
            # all (the payload says so; a null one would fail the request in Dynamo's frontend).
            return {KEY: None}
        source = self._source
        assert source is not None  # in _prefills only once _source_info() found this engine's agent
        expires = time.time() + self.s.handover_lease_s
        self._holds.append((request.request_id, expires))
        return VllmHandover(
            **asdict(source), req=request.request_id, blocks=list(block_ids[:n]), lease_expires_unix=expires
        ).to_params()

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update: every rank's
        worker drops its host and disk blocks once their writes finished. False (vLLM then reports
        the reset failed) when a rank could not, e.g. with a remote tier, shared with other
        workers, which keeps its copies (give new weights a new model_id)."""
        # Saves not handed to the workers yet hold KV computed before the reset (old weights):
        # they only release their blocks now.
        self._saves = [SaveSpec(x.req_id, [], []) for x in self._saves]
        return self.client.reset(self.s.drain_timeout_s + 10)

    def add_events(self, events: Any) -> None:
        if events is not None:
            self._events.extend(events.get_all_events())

    def take_events(self) -> Iterable[Any]:
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        self.client.close()
