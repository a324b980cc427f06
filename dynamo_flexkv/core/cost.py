"""Cost-aware loading: per request, how much of a cached prefix to load, from which tier, and what
to recompute instead. Control plane only: it reads measurements and returns a block count.

Measured online, never configured:

* each tier's read link as ``seconds = latency + bytes / bandwidth``, fitted by exponentially
  weighted least squares over the gets themselves: ``host`` = the host->device copies of gets
  that read host only; ``disk`` = a get's or prefetch's disk reads and their verification;
  ``remote`` = a get's remote reads and their verification (wall time from the first op's start to
  the last op's end, so queueing and chained per-layer reads count as what they cost);
  ``peer`` = a pull of another worker's host blocks into this one's host tier on a router hint
  (core/peer/receiver.py: the request, the pin, the NIXL read and the verification, end to end);
* the engine's prefill as ``seconds = overhead + tokens * per_token``, one fit per prompt-length
  bucket (powers of two: a longer context costs more per token), fed by the engine with the time
  of each step that only prefilled (time blocked on loads taken out).

The rule (docs/POLICIES.md, "Cost-aware loading"). The cached prefix beyond the blocks the engine
already holds, ``[start, end)``, is a sequence of tier segments, fastest first (host, then disk,
then remote, then a peer's blocks past what this worker holds: a prefix must load in order).
Loading blocks ``[start, k)`` and recomputing the rest of the prompt (``S`` tokens, ``B`` per
block) is predicted to take

    load(k)    = sum over the segments' parts below k of (latency_T + bytes / bandwidth_T)
                 + host->device of all k - start blocks (every load ends with that copy)
    compute(k) = prefill(S - k*B tokens | prompt length S)
    ttft(k)    = max(load, compute) + min(load, compute) / layers    layerwise (they overlap)
                 load + compute                                       bulk

and the get loads ``[start, k*)`` with ``k*`` the segment boundary of least ``ttft(k)`` (``start``
included; ties load more), if it beats loading everything by at least max(2 ms, 5%) of
``ttft(end)``; else everything. So a tier is loaded only where that beats recomputing it, and
never when loading is measurably slower than recompute. Whole segments only: a cut inside one
(where load and compute cross) would rest on the overlap prediction alone, the least sure part.
Cold start: until the prefill and every tier the prefix touches have a measurement, everything is
loaded (as before this module). A tier left unloaded for ``reprobe_s`` since its
newest measurement is loaded once again (reason ``probe``), so a tier that became fast is noticed.

``load_policy``: ``cost_aware`` (this rule, the default), ``always`` (load everything) or
``never`` (load nothing). Every decision counts its tokens by (decision, tier, reason):
loaded/<tier>/{faster, cold_start, probe, always}, recomputed/<tier>/{slower, never} and
recomputed/none/not_cached for the full blocks no tier holds.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_flexkv.core.enums import LoadPolicy

TIERS = ("host", "disk", "remote", "peer")  # the order a prefix is served in (peer: KVManager.pull_decision)
REPROBE_S = 120.0  # a tier unloaded this long since its newest measurement is loaded once again
# Recompute replaces a load only for a predicted gain of at least this much (of ttft with the full
# load): below, the difference is within what the measurements vary by on a busy machine.
MIN_GAIN_S, MIN_GAIN_FRACTION = 0.002, 0.05
ALPHA = 0.25  # weight of the newest observation in every fit


@dataclass
class LinearFit:
    """``y = intercept + slope * x`` by exponentially weighted least squares: each observation
    moves the weighted moments by ``alpha`` (the first one sets them). Where the fit cannot tell a
    fixed part from a rate (equal ``x`` everywhere, or noise giving a negative slope or intercept):
    the line through the origin, whose slope is an upper bound of the rate (so a load is never
    rejected for a rate the measurements did not show)."""

    alpha: float = ALPHA
    count: int = 0
    updated: float = 0.0  # clock of the newest observation
    mx: float = 0.0
    my: float = 0.0
    mxx: float = 0.0
    mxy: float = 0.0

    def observe(self, x: float, y: float, now: float = 0.0) -> bool:
        if not (x > 0 and y >= 0 and math.isfinite(x) and math.isfinite(y)):
            return False
        a = 1.0 if self.count == 0 else self.alpha
        self.mx += a * (x - self.mx)
        self.my += a * (y - self.my)
        self.mxx += a * (x * x - self.mxx)
        self.mxy += a * (x * y - self.mxy)
        self.count += 1
        self.updated = now
        return True

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0."""
        if not self.count:
            return 0.0, 0.0
        var = self.mxx - self.mx * self.mx
        if var > 1e-6 * self.mx * self.mx:
            slope = (self.mxy - self.mx * self.my) / var
            intercept = self.my - slope * self.mx
            if slope >= 0 and intercept >= 0:
                return intercept, slope
        return 0.0, (self.mxy / self.mxx if self.mxx > 0 else 0.0)  # through the origin

    def predict(self, x: float) -> float:
        c, m = self.coefficients()
        return c + m * max(0.0, x)


@dataclass(frozen=True)
class LinkCost:
    """A tier's measured read cost (``seconds = latency_s + bytes / bandwidth``)."""

    latency_s: float
    bandwidth_bytes_per_s: float  # inf: no measurable size dependence
    observations: int


@dataclass(frozen=True)
class Segment:
    """Blocks [start, end) of a prompt that ``tier`` holds (the fastest tier holding them)."""

    tier: str
    start: int
    end: int


@dataclass(frozen=True)
class LoadDecision:
    start: int  # blocks the engine holds already
    end: int  # load blocks [start, end); recompute the rest
    segments: tuple[Segment, ...]
    reason: str  # faster/slower (the cost model), cold_start, probe, always, never
    full_blocks: int  # full blocks of the prompt (what is not in a segment is not cached)
    predicted_s: float | None = None  # ttft(end), the cost model's prediction (None: not predicted)
    recompute_s: float | None = None  # ttft(start): recomputing everything from start
    load_all_s: float | None = None  # ttft of loading every cached block (what a decline gave up)

    @property
    def loads(self) -> bool:
        return self.end > self.start

    def explain(self, tokens_per_block: int) -> dict[str, Any]:
        """The decision as JSON-ready values, in tokens from the prompt's start and milliseconds
        (the vLLM connector's request_log: the replay's accounting reads why a prefix was not loaded)."""

        def ms(s: float | None) -> float | None:
            return None if s is None else round(s * 1e3, 3)

        found: dict[str, int] = {}
        for s in self.segments:
            found[s.tier] = found.get(s.tier, 0) + (s.end - s.start) * tokens_per_block
        return {
            "reason": self.reason,
            "start": self.start * tokens_per_block,
            "end": self.end * tokens_per_block,
            "found": found,
            "predicted_ms": ms(self.predicted_s),
            "recompute_ms": ms(self.recompute_s),
            "load_all_ms": ms(self.load_all_s),
        }

    def token_counts(self, tokens_per_block: int) -> dict[tuple[str, str, str], int]:
        """Tokens by (decision, tier, reason) (full blocks from ``start`` on)."""
        out: dict[tuple[str, str, str], int] = {}
        by_cost = self.reason in ("faster", "slower")  # the cost model chose: loaded parts were faster
        loaded_why, skipped_why = ("faster", "slower") if by_cost else (self.reason, self.reason)
        if self.reason == "probe":  # what a probe leaves out is left out for its cost
            skipped_why = "slower"
        for s in self.segments:
            loaded = max(0, min(s.end, self.end) - s.start)
            if loaded:
                key = ("loaded", s.tier, loaded_why)
                out[key] = out.get(key, 0) + loaded * tokens_per_block
            if s.end - s.start - loaded:
                key = ("recomputed", s.tier, skipped_why)
                out[key] = out.get(key, 0) + (s.end - s.start - loaded) * tokens_per_block
        cached_end = max((s.end for s in self.segments), default=self.start)
        if self.full_blocks > cached_end:
            out[("recomputed", "none", "not_cached")] = (self.full_blocks - cached_end) * tokens_per_block
        return out


class CostModel:
    """The tiers' and the prefill's measurements, the decision, and its token counters. Thread-safe:
    transfer threads observe links, the engine observes prefills and decides."""

    def __init__(
        self,
        policy: LoadPolicy,
        tokens_per_block: int,
        block_bytes: int,
        num_layers: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        reprobe_s: float = REPROBE_S,
    ) -> None:
        self.policy = LoadPolicy.parse(policy)
        self.tokens_per_block, self.block_bytes = tokens_per_block, block_bytes
        self.num_layers = max(1, num_layers)
        self.clock, self.reprobe_s = clock, reprobe_s
        self.links: dict[str, LinearFit] = {t: LinearFit() for t in TIERS}
        self.prefill: dict[int, LinearFit] = {}  # prompt-length bucket (ceil log2) -> seconds by tokens
        self._probed: dict[str, float] = {}  # tier -> clock of its last probe
        self._counts: dict[tuple[str, str, str], int] = {}
        self._lock = threading.Lock()

    # ---- measurements ----------------------------------------------------------------------------
    def observe_link(self, tier: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``tier`` into the device (host) or host (disk, remote)."""
        with self._lock:
            self.links[tier].observe(float(nbytes), float(seconds), self.clock())

    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` prompt tokens of prompts up to ``prompt_tokens`` long."""
        if tokens <= 0 or prompt_tokens <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return  # no bucket for a value the fit refuses: an empty one would end the cold start
        with self._lock:
            self.prefill.setdefault(_bucket(prompt_tokens), LinearFit()).observe(
                float(tokens), float(seconds), self.clock()
            )

    def link_costs(self) -> dict[str, LinkCost]:
        """The tiers measured so far."""
        with self._lock:
            out = {}
            for tier, fit in self.links.items():
                if fit.count:
                    c, m = fit.coefficients()
                    out[tier] = LinkCost(c, 1.0 / m if m > 0 else math.inf, fit.count)
            return out

    def prefill_seconds(self, tokens: int, prompt_tokens: int) -> float | None:
        """Predicted time to prefill ``tokens`` of a ``prompt_tokens`` prompt; None before any
        measurement. An unmeasured length uses the nearest measured bucket."""
        with self._lock:
            return self._prefill_locked(tokens, prompt_tokens)

    def _prefill_locked(self, tokens: int, prompt_tokens: int) -> float | None:
        if tokens <= 0:
            return 0.0
        if not self.prefill:
            return None
        b = _bucket(prompt_tokens)
        nearest = min(self.prefill, key=lambda k: (abs(k - b), -k))
        return self.prefill[nearest].predict(tokens)

    # ---- the decision ----------------------------------------------------------------------------
    def decide(
        self,
        start: int,
        segments: Sequence[Segment],
        prompt_tokens: int,
        full_blocks: int,
        layerwise: bool = True,
        policy: LoadPolicy | None = None,
    ) -> LoadDecision:
        """How far to load (see the module doc). ``segments``: the cached prefix beyond ``start``
        by tier, contiguous and fastest first; ``prompt_tokens``: the whole prompt's length."""
        segs = tuple(s for s in segments if s.end > s.start)
        end = segs[-1].end if segs else start
        policy = LoadPolicy.parse(policy) if policy is not None else self.policy
        if not segs:
            return LoadDecision(start, start, segs, "not_cached", full_blocks)
        if policy is LoadPolicy.ALWAYS:
            return LoadDecision(start, end, segs, "always", full_blocks)
        if policy is LoadPolicy.NEVER:
            return LoadDecision(start, start, segs, "never", full_blocks)
        with self._lock:
            now = self.clock()
            if not self.prefill or any(not self.links[s.tier].count for s in segs) or not self.links["host"].count:
                return LoadDecision(start, end, segs, "cold_start", full_blocks)
            B = self.tokens_per_block
            fits = {t: f.coefficients() for t, f in self.links.items()}

            def ttft(k: int) -> float:
                load = 0.0
                if k > start:
                    for s in segs:
                        n = min(k, s.end) - s.start
                        if n > 0 and s.tier != "host":
                            c, m = fits[s.tier]
                            load += c + m * n * self.block_bytes
                    c, m = fits["host"]
                    load += c + m * (k - start) * self.block_bytes
                comp = self._prefill_locked(prompt_tokens - k * B, prompt_tokens) or 0.0
                if layerwise:
                    return max(load, comp) + min(load, comp) / self.num_layers
                return load + comp

            candidates = {start, end, *(s.end for s in segs)}
            best = min(sorted(candidates, reverse=True), key=ttft)  # ties: the larger k (listed first)
            full = ttft(end)
            if full - ttft(best) < max(MIN_GAIN_S, MIN_GAIN_FRACTION * full):
                best = end
            recompute = ttft(start)
            reason = "faster" if best == end else "slower"
            decision = LoadDecision(start, best, segs, reason, full_blocks, ttft(best), recompute, full)
            # A tier left out that nobody measured for reprobe_s: load it once to measure it again.
            for s in segs:
                if best < s.end:
                    fit = self.links[s.tier]
                    if now - max(fit.updated, self._probed.get(s.tier, -math.inf)) >= self.reprobe_s:
                        self._probed[s.tier] = now
                        return LoadDecision(start, s.end, segs, "probe", full_blocks, ttft(s.end), recompute, full)
            return decision

    def record(self, decision: LoadDecision) -> None:
        with self._lock:
            for key, n in decision.token_counts(self.tokens_per_block).items():
                self._counts[key] = self._counts.get(key, 0) + n

    def token_counts(self) -> dict[tuple[str, str, str], int]:
        """Tokens by (decision, tier, reason) since the start."""
        with self._lock:
            return dict(self._counts)


def _bucket(prompt_tokens: int) -> int:
    return max(0, int(prompt_tokens) - 1).bit_length()  # ceil(log2(n)): 4096 -> 12, 4097 -> 13
