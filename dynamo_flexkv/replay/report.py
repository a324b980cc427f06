"""Per-configuration statistics of a replay, the markdown report, and its JSON lines."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dynamo_flexkv.replay.client import TIERS, RequestRecord
from dynamo_flexkv.replay.configs import ENGINES, ConfigRun, attribute_workers, peer_mapping


CLIENTS = {
    "ours": "our replay client (TTFT: the first chunk carrying a token, by nvext.completion_token_ids)",
    "aiperf": "aiperf (TTFT and inter-chunk gaps: chunks carrying text, as a plain streaming client sees them)",
}


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Summary:
    config: str
    description: str
    device_blocks: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_mean_ms: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    computed_tokens: int
    cached: Dict[str, int]  # prompt tokens served per tier
    tier_source: str  # "responses" (per request) or "worker metrics" (per worker totals)
    hit_rate: Dict[str, float]  # cached / prompt tokens, per tier and "all"
    requests_per_worker: Dict[str, int]
    accounting: str  # per-request cached tokens vs the workers' counters
    ttft_p50_later_ms: float = math.nan  # turns after a conversation's first: where routing decides the hits
    kept_on_worker: float = math.nan  # later turns served by the worker that served the turn before
    engine: str = "reference"  # whose workers served it (ENGINES)
    client: str = "ours"  # who sent and timed the requests: ours or aiperf

    def to_json(self) -> dict:
        return {"bench": "replay", **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in vars(self).items()}}


def summarize(run: ConfigRun) -> Summary:
    ok = [r for r in run.records if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    prompt = sum(r.prompt_tokens for r in ok)
    per_request = all(r.cached_by_tier is not None for r in ok) and bool(ok)
    if per_request:
        cached = {t: sum(r.cached_by_tier.get(t, 0) for r in ok) for t in TIERS}  # a tier a record lacks: 0
    else:  # the responses carry only a total: per tier from the workers' counters
        cached = {t: sum(w.cached[t] for w in run.workers.values()) for t in TIERS}
    # aiperf's records carry no usage details or worker: the totals come from the workers' counters
    total_cached = sum(cached.values()) if run.client == "aiperf" else sum(r.cached_tokens for r in ok)
    wall = max(run.wall_s, 1e-9)
    if run.client == "aiperf":
        per_worker = {name: w.requests for name, w in sorted(run.workers.items())}
    else:
        per_worker = {name: len(rs) for name, rs in sorted(attribute_workers(run).items())}
    return Summary(
        config=run.config.name,
        description=run.config.description,
        device_blocks=run.device_blocks,
        requests=len(ok),
        errors=len(run.records) - len(ok),
        wall_s=run.wall_s,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50),
        itl_mean_ms=sum(itl) / len(itl) if itl else math.nan,
        requests_per_s=len(ok) / wall,
        prompt_tokens_per_s=prompt / wall,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / wall,
        prompt_tokens=prompt,
        computed_tokens=prompt - total_cached,
        cached=cached,
        tier_source="responses" if per_request else "worker metrics",
        hit_rate={
            **{t: cached[t] / prompt if prompt else 0.0 for t in TIERS},
            "all": total_cached / prompt if prompt else 0.0,
        },
        requests_per_worker=per_worker,
        accounting=check_accounting(run),
        ttft_p50_later_ms=percentile([r.ttft_ms for r in ok if r.turn > 0 and r.ttft_ms is not None], 50),
        kept_on_worker=kept_on_worker(ok),
        engine=run.engine,
        client=run.client,
    )


def kept_on_worker(records: Sequence[RequestRecord]) -> float:
    """Share of later turns that went to the worker that served their conversation's previous turn
    (NaN when there are none): how often the router followed a conversation's cached prefix."""
    served = {(r.conversation, r.turn): r.worker_id for r in records if r.worker_id is not None}
    later = [r for r in records if r.worker_id is not None and (r.conversation, r.turn - 1) in served]
    if not later:
        return math.nan
    return sum(served[(r.conversation, r.turn - 1)] == r.worker_id for r in later) / len(later)


def check_accounting(run: ConfigRun) -> str:
    """ "exact" when, per worker, the responses' cached tokens (per tier where reported, else the
    total) and request counts add up to the change of that worker's counters (the engine's metric
    mapping: flexkv_* for the reference engine, vllm:* for vLLM)."""
    if not run.workers:
        return "not checked (no worker /metrics to compare with)"
    m = ENGINES[run.engine].metrics
    problems = []
    if run.client == "aiperf":  # no worker in aiperf's records: the graph's totals
        ok = [r for r in run.records if r.error is None]
        got = (sum(w.requests for w in run.workers.values()), sum(w.prompt_tokens for w in run.workers.values()))
        want = (len(ok), sum(r.prompt_tokens for r in ok))
        if got != want:
            problems.append(
                f"{want[0]} requests of {want[1]} prompt tokens succeeded, the workers' counters "
                f"say {got[0]} of {got[1]}"
            )
        return "totals exact (aiperf: per worker not attributable)" if not problems else "; ".join(problems)
    for name, recs in attribute_workers(run).items():
        w = run.workers.get(name)
        if w is None:
            problems.append(f"{len(recs)} responses name unknown worker {name}")
            continue
        if w.requests != len(recs):
            problems.append(f"{name}: {len(recs)} responses, {m.requests} +{w.requests}")
        if w.prompt_tokens != sum(r.prompt_tokens for r in recs):
            problems.append(f"{name}: prompt tokens {sum(r.prompt_tokens for r in recs)} vs metrics {w.prompt_tokens}")
        if all(r.cached_by_tier is not None for r in recs):
            for t in TIERS:
                got, want = sum(r.cached_by_tier.get(t, 0) for r in recs), w.cached.get(t, 0)
                if got != want:
                    problems.append(f"{name}: {t} cached {got} in responses vs {want} in metrics")
        elif sum(r.cached_tokens for r in recs) != sum(w.cached.values()):
            problems.append(
                f"{name}: cached {sum(r.cached_tokens for r in recs)} in responses vs "
                f"{sum(w.cached.values())} in metrics"
            )
    return "exact" if not problems else "; ".join(problems)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:,.{digits}f}"


def metric_note(engines: Sequence[str]) -> str:
    """Which counters the per-worker accounting reads, per engine."""
    out = []
    for name in engines:
        m = ENGINES[name].metrics
        tiers = ", ".join(f"{t} {c}" for t, c in m.cached.items())
        out.append(f"{name}: requests {m.requests}, prompt tokens {m.prompt_tokens}, cached {tiers}")
    return "; ".join(out)


def markdown(summaries: Sequence[Summary], workload: str, setup: str) -> str:
    lines = [
        f"Workload: {workload}.",
        "",
        f"Setup: {setup}.",
        "",
        "| config | device blocks | TTFT p50 / p90 / p99 ms | TTFT p50 later turns ms | ITL p50 ms | req/s "
        "| prompt tok/s | out tok/s | computed tokens | hit device / host / disk (all) "
        "| later turns on the previous turn's worker | requests per worker | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        h = s.hit_rate
        lines.append(
            f"| {s.config} | {s.device_blocks} | {_fmt(s.ttft_p50_ms)} / {_fmt(s.ttft_p90_ms)} / {_fmt(s.ttft_p99_ms)} "
            f"| {_fmt(s.ttft_p50_later_ms)} | {_fmt(s.itl_p50_ms, 1)} | {s.requests_per_s:.2f} "
            f"| {_fmt(s.prompt_tokens_per_s)} "
            f"| {s.output_tokens_per_s:.1f} | {s.computed_tokens:,} of {s.prompt_tokens:,} "
            f"| {h['device']:.0%} / {h['host']:.0%} / {h['disk']:.0%} ({h['all']:.0%}) "
            f"| {_pct(s.kept_on_worker)} | {' / '.join(str(n) for n in s.requests_per_worker.values())} | {s.errors} |"
        )
    sources = sorted({s.tier_source for s in summaries})
    clients = sorted({s.client for s in summaries})
    lines += ["", "Timed by: " + ", ".join(CLIENTS[c] for c in clients) + "."]
    lines += [
        "",
        f"Per-tier hits from: {', '.join(sources)}. Per-request accounting against the workers' "
        "counters: " + "; ".join(f"{s.config} @{s.device_blocks}: {s.accounting}" for s in summaries),
        "",
        f"Worker counters read: {metric_note(sorted({s.engine for s in summaries}))}.",
    ]
    if any(s.config == "lmcache" for s in summaries):
        lines += [
            "",
            "lmcache: LMCache's CPU and disk hits together in the host column (vLLM counts what a "
            f"connector loaded as {peer_mapping(ENGINES['vllm'].metrics).cached['host']}, one number).",
        ]
    lines += ["", *findings(summaries)]
    return "\n".join(lines) + "\n"


def findings(summaries: Sequence[Summary]) -> List[str]:
    """What the run shows about the two questions the comparison asks, at every device size."""
    by = {(s.config, s.device_blocks): s for s in summaries}
    out = []
    for blocks in sorted({s.device_blocks for s in summaries}):
        tiered, device_only, none = (by.get((c, blocks)) for c in ("host+ssd", "kv-device-only", "no-offload"))
        if tiered and device_only:
            t, d = tiered.hit_rate["all"], device_only.hit_rate["all"]
            holds = t > d and tiered.ttft_p50_ms < device_only.ttft_p50_ms
            out.append(
                f"- {blocks} device blocks: tier-aware routing {'beats' if holds else 'does NOT beat'} "
                f"device-only routing: hit rate {t:.0%} vs {d:.0%}, "
                f"TTFT p50 {_fmt(tiered.ttft_p50_ms)} vs {_fmt(device_only.ttft_p50_ms)} ms "
                f"(later turns {_fmt(tiered.ttft_p50_later_ms)} vs {_fmt(device_only.ttft_p50_later_ms)} ms; "
                f"on their previous turn's worker {_pct(tiered.kept_on_worker)} vs "
                f"{_pct(device_only.kept_on_worker)})."
            )
        peer = by.get(("lmcache", blocks))
        if tiered and peer:
            holds = tiered.ttft_p50_ms < peer.ttft_p50_ms and tiered.computed_tokens <= peer.computed_tokens
            out.append(
                f"- {blocks} device blocks: ours (host+ssd) {'beats' if holds else 'does NOT beat'} LMCache in "
                f"the same graph: TTFT p50 {_fmt(tiered.ttft_p50_ms)} vs {_fmt(peer.ttft_p50_ms)} ms "
                f"({tiered.ttft_p50_ms / peer.ttft_p50_ms:.2f}x), p90 {_fmt(tiered.ttft_p90_ms)} vs "
                f"{_fmt(peer.ttft_p90_ms)} ms, hit rate {tiered.hit_rate['all']:.0%} vs "
                f"{peer.hit_rate['all']:.0%}, prompt tokens computed {tiered.computed_tokens:,} vs "
                f"{peer.computed_tokens:,}."
            )
        if tiered and none:
            holds = tiered.ttft_p50_ms < none.ttft_p50_ms and tiered.computed_tokens < none.computed_tokens
            out.append(
                f"- {blocks} device blocks: offload (host+ssd) {'beats' if holds else 'does NOT beat'} no "
                f"offload: TTFT p50 {_fmt(tiered.ttft_p50_ms)} vs {_fmt(none.ttft_p50_ms)} ms "
                f"({none.ttft_p50_ms / tiered.ttft_p50_ms:.2f}x), prompt tokens computed "
                f"{tiered.computed_tokens:,} vs {none.computed_tokens:,}."
            )
    return out


def write_jsonl(
    path: Path, summaries: Sequence[Summary], runs: Sequence[ConfigRun], workload: str, setup: str, per_request: bool
) -> None:
    with open(path, "a") as f:
        for s, run in zip(summaries, runs):
            f.write(json.dumps({**s.to_json(), "workload": workload, "setup": setup}) + "\n")
            if per_request:
                for r in run.records:
                    f.write(
                        json.dumps(
                            {
                                "bench": "replay-request",
                                "config": s.config,
                                "device_blocks": s.device_blocks,
                                "worker": run.worker_names.get(r.worker_id),
                                **r.to_json(),
                            }
                        )
                        + "\n"
                    )


def first_error(runs: Sequence[ConfigRun]) -> Optional[str]:
    for run in runs:
        for r in run.records:
            if r.error:
                return f"{run.label} request {r.index}: {r.error}"
    return None
