"""Where every prompt token of a replay went: loaded from which tier, or computed and why.

Per request, its prompt tokens split into causes (CAUSES) that add up to the prompt exactly:

* loaded: ``device`` (the engine's own prefix cache), ``host``, ``host_pulled`` (host blocks this
  request's router hint pulled from another worker just before: the request_log's ``hint``, the
  part of the load that fell in the pulled range), ``disk``, ``remote``;
* computed, per whole block the engine could have been served (``lookup_tokens``: whole blocks,
  leaving the one token it must compute), in this order of questions:
  - ``new``: no earlier request's prompt had it (the longest block-aligned prefix shared with any
    earlier-sent prompt; block size from the config);
  - with the serving worker's lookup recorded (the vLLM connector's ``request_log``,
    integrations/request_log.py): ``lost_before_load`` when the lookup found it (on vLLM's device
    or in a tier, answered to load it) but it was gone when loaded (evicted meanwhile, or the load
    failed); ``declined`` when a tier held it and the load policy chose to recompute it (its
    estimate is kept with the request); ``hint_missed`` when the router's hint named it (another
    worker held it) and the pull failed or the load policy skipped it;
  - from the workers' KV events (replay/events.py, what each worker held at the request's lookup,
    or its sending where no lookup was recorded): ``held_not_hit`` the serving worker held it by
    its events yet it was not hit (evicted between routing and admission, or its events lagged);
    ``other_worker`` another worker held it (the router sent the request elsewhere);
    ``evicted_<tier>`` its last copy had left that tier; ``store_pending`` no copy anywhere, and
    the store that brought it back to a lower tier was published only after this request looked;
    ``in_flight`` never stored yet and an earlier request carrying it was still being served;
  - ``peer_missed``: a peer row (LMCache), which publishes no events for its tiers: not loaded,
    why not unknown; ``untraced``: seen before, yet no event ever named it (no events from these
    workers, or they were lost);
* ``tail``: the prompt's last partial block and the token the engine always computes.

The sums are checked (``check``): per request and per row, the causes equal the prompt tokens;
a mismatch raises AccountingError naming the request, because a table that does not add up
explains nothing."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.integrations.request_log import lookup_tokens, prompt_key
from dynamo_flexkv.replay.events import DEVICE, DISK, HOST, REMOTE, KvEvent

PULLED = "host_pulled"  # host loads of blocks the request's router hint had just pulled
LOADED = (DEVICE, HOST, PULLED, DISK, REMOTE)
TIER_ORDER = (DEVICE, HOST, DISK, REMOTE)  # fastest first
COMPUTED = (
    "new",
    "in_flight",
    "store_pending",
    "evicted_device",
    "evicted_host",
    "evicted_disk",
    "evicted_remote",
    "other_worker",
    "hint_missed",
    "declined",
    "lost_before_load",
    "held_not_hit",
    "peer_missed",
    "untraced",
    "tail",
)
CAUSES = LOADED + COMPUTED
LABELS = {
    DEVICE: "loaded: device (the engine's prefix cache)",
    HOST: "loaded: host",
    PULLED: "loaded: host, pulled from another worker on a hint",
    DISK: "loaded: disk",
    REMOTE: "loaded: remote",
    "new": "computed: never in an earlier prompt",
    "in_flight": "computed: an earlier request carrying it still being served",
    "store_pending": "computed: its store not landed yet",
    "evicted_device": "computed: evicted, last from a device",
    "evicted_host": "computed: evicted, last from host",
    "evicted_disk": "computed: evicted, last from disk",
    "evicted_remote": "computed: evicted, last from remote",
    "other_worker": "computed: another worker held it (routed elsewhere)",
    "hint_missed": "computed: another worker held it, its hint's pull failed or was skipped",
    "declined": "computed: the load policy declined the load",
    "lost_before_load": "computed: found by the lookup, gone when loaded",
    "held_not_hit": "computed: on this worker by its events, not hit",
    "peer_missed": "computed: not loaded by the peer (no events say why)",
    "untraced": "computed: seen before, no event named it",
    "tail": "computed: last partial block / last token",
}


class AccountingError(AssertionError, FlexKVError):
    """The causes of a request or a row do not add up to its prompt tokens."""


@dataclass(frozen=True)
class Request:
    """What the accounting needs of one successful request; times in unix seconds."""

    index: int
    tokens: Sequence[int]
    sent: float
    done: float
    worker: str | None
    cached: int  # cached prompt tokens, all tiers (the response's usage)
    by_tier: Mapping[str, int] | None = None  # per tier, when the response says (reference engine)
    ttft_ms: float | None = None


@dataclass
class RequestAccount:
    index: int
    worker: str | None
    prompt_tokens: int
    causes: dict[str, int]
    decision: dict[str, Any] | None = None  # the lookup's, when the policy declined part of it
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"causes": {k: v for k, v in self.causes.items() if v}}
        if self.decision is not None:
            out["decision"] = self.decision
        if self.notes:
            out["notes"] = self.notes
        return out


@dataclass
class RowAccount:
    """One run's accounting: per request, the totals, and what the checks found."""

    requests: list[RequestAccount]
    totals: dict[str, int]
    prompt_tokens: int
    events: int  # KV events seen
    lost_frames: int
    lookups: int  # connector records matched to requests
    problems: list[str]  # cross-checks that differ (not the sums: those raise)

    @property
    def check(self) -> str:
        return "exact" if not self.problems else "; ".join(self.problems)

    def declined_summary(self) -> str | None:
        """The declines with the policy's estimates against the requests' measured TTFT."""
        rows = [r for r in self.requests if r.causes.get("declined") and r.decision]
        if not rows:
            return None

        def med(values: list[Any]) -> str:
            xs = [float(x) for x in values if x is not None and not math.isnan(x)]
            return f"{float(np.median(xs)):.0f}" if xs else "-"

        d = [r.decision or {} for r in rows]
        return (
            f"{len(rows)} requests, {sum(r.causes['declined'] for r in rows):,} tokens declined "
            f"({', '.join(sorted({str(x.get('reason')) for x in d}))}); the policy's median estimate: "
            f"load all {med([x.get('load_all_ms') for x in d])} ms vs the chosen "
            f"{med([x.get('predicted_ms') for x in d])} ms; measured TTFT median "
            f"{med([x.get('ttft_ms') for x in d])} ms"
        )


def chain_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """A name per whole block of ``tokens`` that says the whole prefix up to it (as the engines'
    chained block hashes do, but computable here from tokens alone)."""
    out: list[bytes] = []
    parent = b""
    arr = np.asarray(tokens, dtype="<u4")
    for i in range(len(tokens) // block_size):
        parent = _chain(parent, arr[i * block_size : (i + 1) * block_size].tobytes())
        out.append(parent)
    return out


def _chain(parent: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(parent + block, digest_size=16).digest()


@dataclass
class _Holdings:
    """The workers' blocks by tier, replayed from the events in time order."""

    block_size: int
    names: dict[Any, bytes] = field(default_factory=dict)  # an event's block hash -> chain key
    held: dict[str, dict[str, set]] = field(default_factory=dict)  # worker -> tier -> chain keys
    stored_ever: dict[bytes, float] = field(default_factory=dict)  # key -> first store
    last_removed: dict[bytes, tuple[float, str]] = field(default_factory=dict)  # key -> (t, tier)

    def apply(self, e: KvEvent) -> None:
        tiers = self.held.setdefault(e.worker, {})
        if e.kind == "cleared":
            for tier, keys in tiers.items():
                for k in keys:
                    self.last_removed[k] = (e.t, tier)
            tiers.clear()
            return
        if e.kind == "stored":
            parent = b"" if e.parent is None else self.names.get(e.parent)
            if parent is None:
                return  # a chain whose start we never heard of
            bs = self.block_size
            arr = np.asarray(e.token_ids, dtype="<u4")
            if len(arr) != len(e.hashes) * bs:
                return
            keys = tiers.setdefault(e.tier, set())
            for j, h in enumerate(e.hashes):
                parent = _chain(parent, arr[j * bs : (j + 1) * bs].tobytes())
                self.names[h] = parent
                keys.add(parent)
                self.stored_ever.setdefault(parent, e.t)
            return
        keys = tiers.setdefault(e.tier, set())
        for h in e.hashes:
            k = self.names.get(h)
            if k is not None and k in keys:
                keys.discard(k)
                self.last_removed[k] = (e.t, e.tier)

    def tier_on(self, worker: str | None, key: bytes) -> str | None:
        tiers = self.held.get(worker or "", {})
        return next((t for t in TIER_ORDER if key in tiers.get(t, ())), None)

    def other_holder(self, worker: str | None, key: bytes) -> tuple[str, str] | None:
        for w, tiers in self.held.items():
            if w != worker:
                t = next((t for t in TIER_ORDER if key in tiers.get(t, ())), None)
                if t is not None:
                    return w, t
        return None

    def held_anywhere(self, key: bytes) -> bool:
        return any(key in keys for tiers in self.held.values() for keys in tiers.values())


@dataclass(frozen=True)
class ConnectorLog:
    """A worker's request_log lines, split by kind and named by key."""

    lookups: dict[str, list[dict[str, Any]]]
    loads: dict[str, list[dict[str, Any]]]

    @classmethod
    def parse(cls, lines: Iterable[dict[str, Any]]) -> ConnectorLog:
        """Records in time order by key; ``take`` claims them, so parse anew for each use."""
        lookups: dict[str, list[dict[str, Any]]] = {}
        loads: dict[str, list[dict[str, Any]]] = {}
        for rec in lines:
            into = lookups if rec.get("kind") == "lookup" else loads if rec.get("kind") == "load" else None
            if into is not None:
                into.setdefault(str(rec["key"]), []).append(rec)
        for recs in (*lookups.values(), *loads.values()):
            recs.sort(key=lambda rec: float(rec["t"]))
        return cls(lookups, loads)

    def take(self, which: str, key: str, start: float, end: float) -> dict[str, Any] | None:
        """The first unclaimed record of ``key`` within [start, end] (and claims it): a request's
        own, when two requests had the same prompt."""
        recs = (self.lookups if which == "lookup" else self.loads).get(key, [])
        for i, rec in enumerate(recs):
            if start <= float(rec["t"]) <= end:
                return recs.pop(i)
        return None


# A request's lookup and load happen after the client sent it and before its first token left the
# worker (the load's record is written at the end of the step that computes it), so a record
# belongs to the request whose [sent, first token] holds it; this much more on either side
# absorbs the clock reads of two processes (one clock: the machine's).
SLACK_S = 0.05


def account(
    requests: Sequence[Request],
    block_size: int,
    events: Sequence[KvEvent] | None = None,
    logs: Mapping[str, Sequence[dict[str, Any]]] | None = None,
    peer: bool = False,
    lost_frames: int = 0,
) -> RowAccount:
    """Every request's prompt tokens by cause (module doc). ``events``: the workers' KV events
    (None: none were collected); ``logs``: worker name -> its connector's request_log lines (None:
    no connector, e.g. no-offload or a peer row); ``peer``: the peer row (its loads are one number)."""
    bs = block_size
    parsed = {w: ConnectorLog.parse(lines) for w, lines in (logs or {}).items()}
    reqs = sorted(requests, key=lambda r: (r.sent, r.index))
    keys = {r.index: chain_keys(r.tokens, bs) for r in reqs}
    decide_at: dict[int, float] = {}
    lookups: dict[int, dict[str, Any]] = {}
    loads: dict[int, dict[str, Any]] = {}
    for r in reqs:
        log = parsed.get(r.worker or "")
        decide_at[r.index] = r.sent
        if log is None:
            continue
        key = prompt_key(r.tokens[: lookup_tokens(len(r.tokens), bs)])
        first = r.sent + r.ttft_ms / 1000 if r.ttft_ms is not None else r.done
        lk = log.take("lookup", key, r.sent - SLACK_S, first + SLACK_S)
        if lk is not None:
            lookups[r.index] = lk
            decide_at[r.index] = float(lk["t"])
        ld = log.take("load", key, decide_at[r.index] - SLACK_S, first + SLACK_S)
        if ld is not None:
            loads[r.index] = ld
    # Stores into a lower tier per key, in time order (the store_pending question looks ahead).
    ordered = sorted(events or (), key=lambda e: e.t)
    later_stores = _lower_tier_stores(ordered, bs)
    # What was sent before each request: its "seen" prefix, and the earlier requests carrying each block.
    seen: set = set()
    carriers: dict[bytes, list[Request]] = {}
    before: dict[int, tuple[set, dict[bytes, list[Request]]]] = {}
    for r in reqs:
        before[r.index] = (set(seen), {k: list(v) for k, v in carriers.items() if k in keys[r.index]})
        for k in keys[r.index]:
            seen.add(k)
            carriers.setdefault(k, []).append(r)
    # The events replayed in time order up to each request's lookup (or its sending).
    state = _Holdings(bs)
    applied = 0
    out: list[RequestAccount] = []
    for r in sorted(reqs, key=lambda r: (decide_at[r.index], r.index)):
        t = decide_at[r.index]
        while applied < len(ordered) and ordered[applied].t <= t:
            state.apply(ordered[applied])
            applied += 1
        ctx = _Context(
            r,
            bs,
            t,
            *before[r.index],
            state if events is not None else None,
            later_stores,
            lookups.get(r.index),
            (r.worker or "") in parsed,
            peer,
        )
        out.append(ctx.account(keys[r.index], loads.get(r.index)))
    out.sort(key=lambda a: a.index)
    totals = {c: sum(a.causes.get(c, 0) for a in out) for c in CAUSES}
    prompt = sum(a.prompt_tokens for a in out)
    check_sums(out, totals, prompt)
    problems = [n for a in out for n in a.notes]
    if lost_frames:
        problems.append(f"{lost_frames} KV event frames lost: the causes read from events may be off")
    if events is not None and not ordered and out:
        problems.append("no KV events arrived: the causes read from events are missing")
    return RowAccount(out, totals, prompt, len(ordered), lost_frames, len(lookups), _dedupe(problems))


def _dedupe(notes: list[str], keep: int = 5) -> list[str]:
    if len(notes) <= keep:
        return notes
    return notes[:keep] + [f"... and {len(notes) - keep} more"]


def _lower_tier_stores(events: Sequence[KvEvent], bs: int) -> dict[bytes, list[float]]:
    """Chain key -> times it was stored into host, disk or remote on any worker."""
    names: dict[Any, bytes] = {}
    out: dict[bytes, list[float]] = {}
    for e in events:
        if e.kind != "stored":
            continue
        parent = b"" if e.parent is None else names.get(e.parent)
        if parent is None or len(e.token_ids) != len(e.hashes) * bs:
            continue
        arr = np.asarray(e.token_ids, dtype="<u4")
        for j, h in enumerate(e.hashes):
            parent = _chain(parent, arr[j * bs : (j + 1) * bs].tobytes())
            names[h] = parent
            if e.tier != DEVICE:
                out.setdefault(parent, []).append(e.t)
    return out


@dataclass
class _Context:
    """One request's questions (module doc), at time ``t``: its lookup, or its sending."""

    r: Request
    bs: int
    t: float
    seen: set  # chain keys of the prompts sent before it
    carriers: dict[bytes, list[Request]]  # its blocks -> the earlier requests whose prompt had them
    state: _Holdings | None  # None: no events were collected
    later_stores: dict[bytes, list[float]]
    lookup: dict[str, Any] | None
    has_connector: bool
    peer: bool

    def account(self, keys: list[bytes], load: dict[str, Any] | None) -> RequestAccount:
        r, bs = self.r, self.bs
        P = len(r.tokens)
        causes = {c: 0 for c in CAUSES}
        notes: list[str] = []
        # ---- what was loaded, from which tier ----------------------------------------------------
        if r.by_tier is not None:  # the response says (reference engine)
            for tier in LOADED:
                causes[tier] = int(r.by_tier.get(tier, 0))
        elif load is not None:  # the connector's record of its load; vLLM's own hit is what it skipped
            causes[DEVICE] = int(load["device"])
            for tier, n in (load.get("loaded") or {}).items():
                causes[tier if tier in LOADED else REMOTE] += int(n)
        elif self.peer and self.state is not None:  # vLLM's hit from its device events, the rest the peer's
            held = 0
            for k in keys:
                if self.state.tier_on(r.worker, k) != DEVICE:
                    break
                held += bs
            causes[DEVICE] = min(r.cached, held)
            causes[HOST] = r.cached - causes[DEVICE]
        else:  # no connector, or it loaded nothing: every cached token is vLLM's own
            causes[DEVICE] = r.cached
        pulled = self.pulled_loaded(load, causes[HOST])
        causes[HOST] -= pulled
        causes[PULLED] = pulled
        hit = sum(causes[t] for t in LOADED)
        if hit != r.cached:
            notes.append(
                f"request {r.index}: the response says {r.cached} cached tokens, the "
                f"{'response per tier' if r.by_tier is not None else 'connector'} {hit}"
                + ("" if load is None or load.get("ok") else " (its load failed)")
            )
        if hit > P:
            raise AccountingError(f"request {r.index}: {hit} tokens loaded of a {P}-token prompt")
        # ---- why the rest was computed -----------------------------------------------------------
        decision = (self.lookup or {}).get("decision")
        declined: dict[str, Any] | None = None
        for i in range(-(-hit // bs), lookup_tokens(P, bs) // bs):
            cause = self.why(i, keys[i])
            causes[cause] += bs
            if cause == "declined" and decision is not None:
                declined = {**decision, "ttft_ms": r.ttft_ms}
        causes["tail"] = P - sum(causes.values())
        return RequestAccount(r.index, r.worker, P, causes, declined, notes)

    def pulled_loaded(self, load: dict[str, Any] | None, host: int) -> int:
        """Of the ``host`` tokens loaded, those the request's hint had pulled: the load's range
        [device, device + planned) within the pulled one [start, start + pulled)."""
        hint = (self.lookup or {}).get("hint") or {}
        if load is None or not load.get("ok") or not hint.get("pulled"):
            return 0
        lo = max(int(hint["start"]), int(load["device"]))
        hi = min(int(hint["start"]) + int(hint["pulled"]), int(load["device"]) + int(load["planned"]))
        return min(max(0, hi - lo), host)

    def why(self, i: int, key: bytes) -> str:
        """Why block ``i`` (chain key ``key``) was computed."""
        if key not in self.seen:
            return "new"
        state, bs = self.state, self.bs
        if self.lookup is not None:  # the serving worker's own answer: what its device and tiers held
            device = int(self.lookup.get("device", 0)) // bs
            answer = int(self.lookup.get("answer", 0)) // bs
            d = self.lookup.get("decision") or {}
            found = (int(d.get("start", device * bs)) + sum(int(n) for n in (d.get("found") or {}).values())) // bs
            if i < max(device, answer):
                return "lost_before_load"
            if i < found:
                return "declined"
            if i < int((self.lookup.get("hint") or {}).get("hinted", 0)) // bs:
                return "hint_missed"  # the router named a holder; the pull brought nothing of it
        elif state is not None and state.tier_on(self.r.worker, key) is not None:
            return "held_not_hit"
        in_flight = any(q.done > self.t for q in self.carriers.get(key, ()))
        if state is None:
            return "in_flight" if in_flight else "peer_missed" if self.peer else "untraced"
        if state.other_holder(self.r.worker, key) is not None:
            return "other_worker"
        stores = self.later_stores.get(key, [])
        stored_after = bisect.bisect_right(stores, self.t) < len(stores)
        if key in state.stored_ever:
            mine = state.tier_on(self.r.worker, key)
            if mine is not None:  # its events still showed it here, the lookup did not find it: gone
                return f"evicted_{mine}"
            if stored_after and any(q.done <= self.t for q in self.carriers.get(key, ())):
                return "store_pending"  # its turn had finished, the copy in a lower tier came after
            if self.peer:
                return "peer_missed"  # gone from every device; the peer's tiers are not told
            return f"evicted_{state.last_removed.get(key, (0.0, DEVICE))[1]}"
        if in_flight:
            return "in_flight"
        if stored_after:
            return "store_pending"
        return "peer_missed" if self.peer else "untraced"


def check_sums(accounts: Sequence[RequestAccount], totals: Mapping[str, int], prompt_tokens: int) -> None:
    """Raises AccountingError unless every request's causes, and the row's, add up to the prompt."""
    for a in accounts:
        if sum(a.causes.values()) != a.prompt_tokens or any(v < 0 for v in a.causes.values()):
            raise AccountingError(
                f"request {a.index}: causes {dict((k, v) for k, v in a.causes.items() if v)} add up to "
                f"{sum(a.causes.values())}, not its {a.prompt_tokens} prompt tokens"
            )
    if sum(totals.values()) != prompt_tokens:
        raise AccountingError(f"the row's causes add up to {sum(totals.values())}, not {prompt_tokens} prompt tokens")
