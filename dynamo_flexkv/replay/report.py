"""Per-configuration statistics of a replay, the markdown report, and its JSON lines."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dynamo_flexkv.replay.accounting import CAUSES, LABELS, PULLED, Request, RowAccount, account
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
    cached: dict[str, int]  # prompt tokens served per tier
    tier_source: str  # "responses" (per request) or "worker metrics" (per worker totals)
    hit_rate: dict[str, float]  # cached / prompt tokens, per tier and "all"
    requests_per_worker: dict[str, int]
    accounting: str  # per-request cached tokens vs the workers' counters
    ttft_p50_later_ms: float = math.nan  # turns after a conversation's first: where routing decides the hits
    kept_on_worker: float = math.nan  # later turns served by the worker that served the turn before
    engine: str = "reference"  # whose workers served it (ENGINES)
    client: str = "ours"  # who sent and timed the requests: ours or aiperf
    time_scale: float = 0.0  # trace seconds per replay second
    rate: float = 1.0  # the arrival rate as a multiple of the replay's --time-scale (--higher-rate)
    repeat: int = 1  # which run of its row (--repeat)
    # Where every prompt token went (accounting.py): tokens by cause, the checks, the declines
    account: dict[str, int] = field(default_factory=dict)
    account_check: str = "not accounted"
    account_declined: str | None = None
    # Requests per minute whose TTFT met the target (set once every run finished: the target may
    # be relative to no-offload's), and that against no-offload's at the same rate and repetition
    goodput_target_ms: float = math.nan
    goodput_rpm: float = math.nan
    goodput_ratio: float = math.nan
    # Router hints (a hints row): the workers' hint counters' change, summed (configs.HINT_COUNTERS,
    # "hints_failed/<reason>", "peer_refused/<reason>"); empty on a row without hints
    hints: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"bench": "replay", **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in vars(self).items()}}


def accounted(run: ConfigRun) -> RowAccount | None:
    """The run's accounting (accounting.py), computed once; None where the records cannot say
    (aiperf's name no worker; a run without its prompts or block size)."""
    if run.account is not None or run.client != "ours" or not run.turns or not run.block_size:
        return run.account
    base = run.started_unix
    reqs = [
        Request(
            r.index,
            run.turns[r.index].tokens,
            base + r.sent_s,
            base + r.sent_s + (r.e2e_ms or 0.0) / 1000,
            run.worker_names.get(r.worker_id) if r.worker_id is not None else None,
            r.cached_tokens,
            r.cached_by_tier,
            r.ttft_ms,
        )
        for r in run.records
        if r.error is None
    ]
    row = account(reqs, run.block_size, run.events, run.connector_logs, bool(run.config.peer), run.lost_frames)
    row.problems.extend(_against_counters(run, row))
    run.account = row
    return row


def _against_counters(run: ConfigRun, row: RowAccount) -> list[str]:
    """The accounting's loaded tokens per worker and tier against the workers' counters (a peer
    row's device part per request is read from vLLM's device events: the check says whether that
    reading adds up to vLLM's own count)."""
    out = []
    got: dict[str, dict[str, int]] = {}
    for a in row.requests:
        w = got.setdefault(a.worker or "", {t: 0 for t in TIERS})
        for t in TIERS:
            w[t] += a.causes.get(t, 0)
        w["host"] += a.causes.get(PULLED, 0)  # pulled on a hint, then loaded from host: host to its counters
    for name, tiers in got.items():
        counters = run.workers.get(name)
        if counters is not None:
            out += [
                f"{name}: {t} {tiers[t]} accounted vs {counters.cached.get(t, 0)} in its counters"
                for t in TIERS
                if tiers[t] != counters.cached.get(t, 0)
            ]
    if sum(len(run.turns[a.index].tokens) for a in row.requests) != sum(
        r.prompt_tokens for r in run.records if r.error is None
    ):
        out.append("the prompts sent and the responses' prompt tokens differ")
    return out


def summarize(run: ConfigRun, base_time_scale: float | None = None) -> Summary:
    ok = [r for r in run.records if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    prompt = sum(r.prompt_tokens for r in ok)
    by_tier = [r.cached_by_tier for r in ok if r.cached_by_tier is not None]
    per_request = len(by_tier) == len(ok) and bool(ok)
    if per_request:
        cached = {t: sum(c.get(t, 0) for c in by_tier) for t in TIERS}  # a tier a record lacks: 0
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
        time_scale=run.time_scale,
        rate=run.time_scale / base_time_scale if base_time_scale and run.time_scale else 1.0,
        repeat=run.repeat,
        hints=hint_sums(run.hints) if run.hints is not None else {},
        **_account_fields(run),
    )


def hint_sums(per_worker: dict[str, dict[str, float]]) -> dict[str, float]:
    """The workers' hint counters added up (a key missing on a worker counts 0)."""
    out: dict[str, float] = {}
    for counters in per_worker.values():
        for k, v in counters.items():
            out[k] = out.get(k, 0.0) + v
    return {k: round(v, 6) for k, v in sorted(out.items())}


def _account_fields(run: ConfigRun) -> dict[str, Any]:
    row = accounted(run)
    if row is None:
        why = "aiperf's records name no worker" if run.client == "aiperf" else "no prompts or block size"
        return {"account_check": f"not accounted ({why})"}
    return {
        "account": {c: n for c, n in row.totals.items() if n},
        "account_check": row.check,
        "account_declined": row.declined_summary(),
    }


# ---- goodput -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TtftTarget:
    """The TTFT a request must meet to count in goodput: ``ms`` fixed, or ``factor`` times the
    no-offload row's TTFT p50 at the trace's rate (its median over the runs)."""

    ms: float | None = None
    factor: float | None = None

    @classmethod
    def parse(cls, text: str) -> TtftTarget:
        t = text.strip().lower()
        try:
            if t.endswith("x"):
                value = float(t[:-1])
                if math.isfinite(value) and value > 0:
                    return cls(factor=value)
            else:
                value = float(t[:-2] if t.endswith("ms") else t)
                if math.isfinite(value) and value > 0:
                    return cls(ms=value)
        except ValueError:
            pass
        raise ValueError(
            f"--ttft-target {text!r}: expected milliseconds (e.g. 200 or 200ms) or a multiple of no-offload's "
            "TTFT p50 at the trace's rate (e.g. 2x)"
        )

    def resolve(self, summaries: Sequence[Summary]) -> tuple[float, str]:
        """(the target in ms, why that one)."""
        if self.ms is not None:
            return self.ms, f"{self.ms:g} ms, fixed (--ttft-target)"
        factor = self.factor or 2.0
        base = [s.ttft_p50_ms for s in summaries if s.config == "no-offload" and s.rate == 1.0 and s.requests]
        what = "no-offload's"
        if not base:
            first = next((s for s in summaries if s.rate == 1.0 and s.requests), None)
            base, what = ([first.ttft_p50_ms], f"{first.config}'s (no no-offload row)") if first else ([], "")
        if not base or math.isnan(float(np.median(base))):
            return math.nan, "none: no request succeeded at the trace's rate"
        ms = factor * float(np.median(base))
        return ms, (
            f"{ms:,.0f} ms = {factor:g}x {what} TTFT p50 at the trace's rate (median of {len(base)} run(s)): "
            "what a user of the same graph without offload gets in the trace's own load, with room for its spread"
        )


def apply_goodput(summaries: Sequence[Summary], runs: Sequence[ConfigRun], target: TtftTarget) -> str:
    """Sets every summary's goodput fields; returns what the target is and why."""
    ms, why = target.resolve(summaries)
    for s, run in zip(summaries, runs):
        good = sum(1 for r in run.records if r.error is None and r.ttft_ms is not None and r.ttft_ms <= ms)
        s.goodput_target_ms = ms
        s.goodput_rpm = good / (max(run.wall_s, 1e-9) / 60) if not math.isnan(ms) else math.nan
    base = {(s.device_blocks, s.rate, s.repeat): s.goodput_rpm for s in summaries if s.config == "no-offload"}
    for s in summaries:
        b = base.get((s.device_blocks, s.rate, s.repeat), math.nan)
        s.goodput_ratio = s.goodput_rpm / b if b and not math.isnan(b) else math.nan
    return why


# ---- runs of one row: median and spread ----------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """Median and range of one measure over a row's runs."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        xs = [x for x in xs if not math.isnan(x)]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(float(np.median(xs)), min(xs), max(xs), len(xs))

    def fmt(self, f: Callable[[float], str]) -> str:
        return f(self.median) + (f" ({f(self.low)}-{f(self.high)})" if self.n > 1 else "")


MEASURES: dict[str, Callable[[Summary], float]] = {
    "hit rate": lambda s: s.hit_rate["all"],
    "TTFT p50": lambda s: s.ttft_p50_ms,
    "TTFT p90": lambda s: s.ttft_p90_ms,
    "goodput": lambda s: s.goodput_rpm,
}


@dataclass
class Row:
    """One configuration at one device size and rate, over its runs."""

    config: str
    device_blocks: int
    rate: float
    runs: list[Summary]

    def stat(self, measure: str) -> Spread:
        return Spread.of([MEASURES[measure](s) for s in self.runs])


def rows(summaries: Sequence[Summary]) -> list[Row]:
    out: dict[tuple[str, int, float], Row] = {}
    for s in summaries:
        out.setdefault((s.config, s.device_blocks, s.rate), Row(s.config, s.device_blocks, s.rate, [])).runs.append(s)
    return list(out.values())


def beyond(a: Spread, b: Spread) -> str:
    """Whether the difference of two rows' medians exceeds their spread: their ranges do not
    overlap (with one run each, the spread is not known)."""
    if a.n < 2 or b.n < 2:
        return "one run: spread unknown"
    return "beyond the spread" if a.high < b.low or b.high < a.low else "within the spread"


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
        rec_tiers = [r.cached_by_tier for r in recs if r.cached_by_tier is not None]
        if len(rec_tiers) == len(recs):
            for t in TIERS:
                in_responses, in_metrics = sum(c.get(t, 0) for c in rec_tiers), w.cached.get(t, 0)
                if in_responses != in_metrics:
                    problems.append(f"{name}: {t} cached {in_responses} in responses vs {in_metrics} in metrics")
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


def _rate(x: float) -> str:
    return f"x{x:g}"


def markdown(summaries: Sequence[Summary], workload: str, setup: str, target: str | None = None) -> str:
    """The report: every run's table, the rows' medians and spread (more than one run each),
    goodput, where every prompt token went, the checks and the findings."""
    lines = [
        f"Workload: {workload}.",
        "",
        f"Setup: {setup}.",
        "",
        "| config | device blocks | rate | run | TTFT p50 / p90 / p99 ms | TTFT p50 later turns ms | ITL p50 ms "
        "| req/s | prompt tok/s | out tok/s | computed tokens | hit device / host / disk (all) "
        "| later turns on the previous turn's worker | requests per worker | goodput req/min (vs no-offload) "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        h = s.hit_rate
        lines.append(
            f"| {s.config} | {s.device_blocks} | {_rate(s.rate)} | {s.repeat} "
            f"| {_fmt(s.ttft_p50_ms)} / {_fmt(s.ttft_p90_ms)} / {_fmt(s.ttft_p99_ms)} "
            f"| {_fmt(s.ttft_p50_later_ms)} | {_fmt(s.itl_p50_ms, 1)} | {s.requests_per_s:.2f} "
            f"| {_fmt(s.prompt_tokens_per_s)} "
            f"| {s.output_tokens_per_s:.1f} | {s.computed_tokens:,} of {s.prompt_tokens:,} "
            f"| {h['device']:.0%} / {h['host']:.0%} / {h['disk']:.0%} ({h['all']:.0%}) "
            f"| {_pct(s.kept_on_worker)} | {' / '.join(str(n) for n in s.requests_per_worker.values())} "
            f"| {_fmt(s.goodput_rpm, 1)} ({_ratio(s.goodput_ratio)}) | {s.errors} |"
        )
    repeated = max((s.repeat for s in summaries), default=1) > 1
    if repeated:
        lines += ["", *spread_table(summaries)]
    if target is not None:
        lines += ["", *goodput_table(summaries, target)]
    lines += accounting_tables(summaries)
    lines += hints_table(summaries)
    sources = sorted({s.tier_source for s in summaries})
    clients = sorted({s.client for s in summaries})
    lines += ["", "Timed by: " + ", ".join(CLIENTS[c] for c in clients) + "."]
    lines += [
        "",
        f"Per-tier hits from: {', '.join(sources)}. Per-request accounting against the workers' "
        "counters: " + "; ".join(f"{_label(s, repeated)}: {s.accounting}" for s in summaries),
        "",
        f"Worker counters read: {metric_note(sorted({s.engine for s in summaries}))}.",
    ]
    if any(s.config == "lmcache" for s in summaries):
        lines += [
            "",
            "lmcache: LMCache's CPU and disk hits together in the host column (vLLM counts what a "
            f"connector loaded as {peer_mapping(ENGINES['vllm'].metrics).cached['host']}, one number; "
            "per request, its device part is what vLLM's device events showed on that worker).",
        ]
    lines += ["", *findings(summaries)]
    return "\n".join(lines) + "\n"


def _label(s: Summary, repeated: bool = False) -> str:
    return (
        f"{s.config} @{s.device_blocks}"
        + (f" {_rate(s.rate)}" if s.rate != 1.0 else "")
        + (f" #{s.repeat}" if repeated else "")
    )


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def spread_table(summaries: Sequence[Summary]) -> list[str]:
    """Each row's median over its runs, with the range (min-max) in brackets."""
    out = [
        "Median (min-max) over each row's runs:",
        "",
        "| config | device blocks | rate | runs | hit rate (all) | TTFT p50 ms | TTFT p90 ms | goodput req/min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows(summaries):
        out.append(
            f"| {r.config} | {r.device_blocks} | {_rate(r.rate)} | {len(r.runs)} "
            f"| {r.stat('hit rate').fmt(lambda x: f'{x:.0%}')} | {r.stat('TTFT p50').fmt(_fmt)} "
            f"| {r.stat('TTFT p90').fmt(_fmt)} | {r.stat('goodput').fmt(lambda x: _fmt(x, 1))} |"
        )
    return out


def goodput_table(summaries: Sequence[Summary], target: str) -> list[str]:
    """Goodput per row at each rate (medians over the runs) and against no-offload."""
    rates = sorted({s.rate for s in summaries})
    out = [
        f"Goodput: requests per minute of replay whose TTFT met the target, {target}.",
        "",
        "| config | device blocks | " + " | ".join(f"req/min at {_rate(x)} (vs no-offload)" for x in rates) + " |",
        "|---|---|" + "---|" * len(rates),
    ]
    by = {(r.config, r.device_blocks, r.rate): r for r in rows(summaries)}
    for config, blocks in dict.fromkeys((s.config, s.device_blocks) for s in summaries):
        cells = []
        for x in rates:
            r = by.get((config, blocks, x))
            if r is None:
                cells.append("-")
                continue
            ratio = Spread.of([s.goodput_ratio for s in r.runs])
            cells.append(f"{r.stat('goodput').fmt(lambda v: _fmt(v, 1))} ({_ratio(ratio.median)})")
        out.append(f"| {config} | {blocks} | " + " | ".join(cells) + " |")
    return out


def accounting_tables(summaries: Sequence[Summary]) -> list[str]:
    """Per device size, rate and run: every row's prompt tokens by where they came from or why
    they were computed (accounting.py), tokens and share of the row's prompt tokens."""
    groups: dict[tuple[int, float, int], list[Summary]] = {}
    for s in summaries:
        if s.account:
            groups.setdefault((s.device_blocks, s.rate, s.repeat), []).append(s)
    out: list[str] = []
    for (blocks, rate, rep), group in groups.items():
        causes = [c for c in CAUSES if any(s.account.get(c) for s in group)]
        out += [
            "",
            f"Where every prompt token went ({blocks} device blocks, rate {_rate(rate)}, run {rep}; "
            "tokens and share of the row's prompt tokens):",
            "",
            "| | " + " | ".join(s.config for s in group) + " |",
            "|---|" + "---|" * len(group),
        ]
        for c in causes:
            cells = [
                f"{s.account.get(c, 0):,} ({s.account.get(c, 0) / s.prompt_tokens:.0%})" if s.prompt_tokens else "-"
                for s in group
            ]
            out.append(f"| {LABELS[c]} | " + " | ".join(cells) + " |")
        out.append("| **prompt tokens** | " + " | ".join(f"{sum(s.account.values()):,}" for s in group) + " |")
        out.append(
            "| check | " + " | ".join("exact" if s.account_check == "exact" else "differs" for s in group) + " |"
        )
        differs = [f"- {s.config}: {s.account_check}" for s in group if s.account_check != "exact"]
        if differs:
            out += ["", "Checks that differ (the sums hold; what the records and counters disagree on):", *differs]
        declined = [f"- {s.config}: {s.account_declined}" for s in group if s.account_declined]
        if declined:
            out += ["", "Declined by the load policy:", *declined]
    return out


def _reasons(hints: dict[str, float], family: str) -> str:
    """ "n (reason n, ...)" of a counter family, e.g. hints_failed."""
    by = {k.split("/", 1)[1]: v for k, v in hints.items() if k.startswith(family + "/") and v}
    n = sum(by.values())
    return f"{n:,.0f}" + (" (" + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by.items())) + ")" if by else "")


def hints_table(summaries: Sequence[Summary]) -> list[str]:
    """The router hints of every row that had them on: what came, what was pulled, what failed
    and why, and what the sources pinned or refused (the workers' counters, summed)."""
    rows_ = [s for s in summaries if s.hints]
    if not rows_:
        return []
    repeated = max((s.repeat for s in summaries), default=1) > 1
    out = [
        "",
        "Router hints (the workers' vllm:flexkv_hint* / peer_* counters across the replay, both workers "
        "summed; docs/HINTS.md):",
        "",
        "| run | hints seen | used | skipped (policy) | failed (by reason) | nothing to pull | tokens pulled "
        "(loaded from the pull by its request) | MiB pulled | pull s | source: pins (lease ended) "
        "| source: refused (by reason) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows_:
        h = s.hints
        failed = sum(v for k, v in h.items() if k.startswith("hints_failed/"))
        idle = h.get("hints_seen", 0) - h.get("hints_used", 0) - h.get("hints_skipped", 0) - failed
        out.append(
            f"| {_label(s, repeated)} | {h.get('hints_seen', 0):,.0f} | {h.get('hints_used', 0):,.0f} "
            f"| {h.get('hints_skipped', 0):,.0f} | {_reasons(h, 'hints_failed')} | {max(0, idle):,.0f} "
            f"| {h.get('hint_pulled_tokens', 0):,.0f} ({s.account.get(PULLED, 0):,}) "
            f"| {h.get('hint_pulled_bytes', 0) / 2**20:,.1f} | {h.get('hint_pull_seconds', 0):.2f} "
            f"| {h.get('peer_pins', 0):,.0f} ({h.get('peer_pins_expired', 0):,.0f}) "
            f"| {_reasons(h, 'peer_refused')} |"
        )
    out += [
        "",
        "Nothing to pull: hints seen less used, skipped and failed: their blocks were held here already "
        "(or the load policy left them unpulled for a reason other than slower).",
    ]
    if any(not s.hints.get("hints_seen") for s in rows_):
        out += [
            "",
            "A row without hints seen: the router hints only when it books a request on a worker other "
            "than the one holding the longest prefix on device and host (docs/HINTS.md, When the router "
            "sends one).",
        ]
    return out


def findings(summaries: Sequence[Summary]) -> list[str]:
    """What the run shows about the questions the comparison asks, at every device size, at the
    trace's rate: medians over each row's runs, and with more than one run each, whether a
    difference exceeds the rows' spread (their ranges do not overlap)."""
    by = {(r.config, r.device_blocks): r for r in rows(summaries) if r.rate == 1.0}
    out = []

    def med(r: Row, m: str) -> float:
        return r.stat(m).median

    def mark(a: Row, b: Row, m: str) -> str:
        return "" if min(len(a.runs), len(b.runs)) < 2 else f" ({beyond(a.stat(m), b.stat(m))})"

    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.0%}"

    for blocks in sorted({s.device_blocks for s in summaries}):
        tiered, device_only, none, node, peer = (
            by.get((c, blocks)) for c in ("host+ssd", "kv-device-only", "no-offload", "node", "lmcache")
        )
        if tiered and device_only:
            t, d = tiered.runs[0], device_only.runs[0]
            holds = med(tiered, "hit rate") > med(device_only, "hit rate") and med(tiered, "TTFT p50") < med(
                device_only, "TTFT p50"
            )
            out.append(
                f"- {blocks} device blocks: tier-aware routing {'beats' if holds else 'does NOT beat'} "
                f"device-only routing: hit rate {pct(med(tiered, 'hit rate'))} vs {pct(med(device_only, 'hit rate'))}"
                f"{mark(tiered, device_only, 'hit rate')}, "
                f"TTFT p50 {_fmt(med(tiered, 'TTFT p50'))} vs {_fmt(med(device_only, 'TTFT p50'))} ms"
                f"{mark(tiered, device_only, 'TTFT p50')} "
                f"(later turns {_fmt(t.ttft_p50_later_ms)} vs {_fmt(d.ttft_p50_later_ms)} ms; "
                f"on their previous turn's worker {_pct(t.kept_on_worker)} vs "
                f"{_pct(d.kept_on_worker)})."
            )
        if tiered and peer:
            t, p = tiered.runs[0], peer.runs[0]
            holds = med(tiered, "TTFT p50") < med(peer, "TTFT p50") and t.computed_tokens <= p.computed_tokens
            out.append(
                f"- {blocks} device blocks: ours (host+ssd) {'beats' if holds else 'does NOT beat'} LMCache in "
                f"the same graph: TTFT p50 {_fmt(med(tiered, 'TTFT p50'))} vs {_fmt(med(peer, 'TTFT p50'))} ms "
                f"({med(tiered, 'TTFT p50') / med(peer, 'TTFT p50'):.2f}x){mark(tiered, peer, 'TTFT p50')}, "
                f"p90 {_fmt(med(tiered, 'TTFT p90'))} vs {_fmt(med(peer, 'TTFT p90'))} ms"
                f"{mark(tiered, peer, 'TTFT p90')}, hit rate {pct(med(tiered, 'hit rate'))} vs "
                f"{pct(med(peer, 'hit rate'))}{mark(tiered, peer, 'hit rate')}, prompt tokens computed "
                f"{t.computed_tokens:,} vs {p.computed_tokens:,}."
            )
        if node and (tiered or peer):
            others = [r for r in (tiered, peer) if r is not None]
            best = max(others, key=lambda r: med(r, "hit rate"))
            holds = med(node, "hit rate") >= med(best, "hit rate")
            if peer:
                holds = holds and med(node, "TTFT p50") <= med(peer, "TTFT p50")
                holds = holds and med(node, "TTFT p90") <= med(peer, "TTFT p90")
            parts = [
                f"hit rate {pct(med(node, 'hit rate'))} vs {best.config}'s {pct(med(best, 'hit rate'))}"
                f"{mark(node, best, 'hit rate')} (prompt tokens computed {node.runs[0].computed_tokens:,} vs "
                f"{best.runs[0].computed_tokens:,})"
            ]
            if peer:
                parts.append(
                    f"TTFT p50 / p90 {_fmt(med(node, 'TTFT p50'))} / {_fmt(med(node, 'TTFT p90'))} vs LMCache's "
                    f"{_fmt(med(peer, 'TTFT p50'))} / {_fmt(med(peer, 'TTFT p90'))} ms"
                    f"{mark(node, peer, 'TTFT p50')}"
                )
            out.append(
                f"- {blocks} device blocks: the node cache {'holds' if holds else 'does NOT hold'} what it "
                f"pools: {', '.join(parts)}."
            )
        hinted = by.get(("hints", blocks))
        if tiered and hinted:
            h = hinted.runs[0].hints
            holds = med(hinted, "hit rate") >= med(tiered, "hit rate") and med(hinted, "TTFT p50") <= med(
                tiered, "TTFT p50"
            )
            out.append(
                f"- {blocks} device blocks: router hints {'hold' if holds else 'do NOT hold'} against host+ssd "
                f"without them: hit rate {pct(med(hinted, 'hit rate'))} vs {pct(med(tiered, 'hit rate'))}"
                f"{mark(hinted, tiered, 'hit rate')}, TTFT p50 / p90 {_fmt(med(hinted, 'TTFT p50'))} / "
                f"{_fmt(med(hinted, 'TTFT p90'))} vs {_fmt(med(tiered, 'TTFT p50'))} / "
                f"{_fmt(med(tiered, 'TTFT p90'))} ms{mark(hinted, tiered, 'TTFT p50')}; hints seen "
                f"{h.get('hints_seen', 0):,.0f}, used {h.get('hints_used', 0):,.0f}, failed "
                f"{_reasons(h, 'hints_failed')} (first run)."
            )
        if tiered and none:
            t, n = tiered.runs[0], none.runs[0]
            holds = med(tiered, "TTFT p50") < med(none, "TTFT p50") and t.computed_tokens < n.computed_tokens
            out.append(
                f"- {blocks} device blocks: offload (host+ssd) {'beats' if holds else 'does NOT beat'} no "
                f"offload: TTFT p50 {_fmt(med(tiered, 'TTFT p50'))} vs {_fmt(med(none, 'TTFT p50'))} ms "
                f"({med(none, 'TTFT p50') / med(tiered, 'TTFT p50'):.2f}x){mark(tiered, none, 'TTFT p50')}, "
                f"prompt tokens computed {t.computed_tokens:,} vs {n.computed_tokens:,}."
            )
    if out and all(len(r.runs) < 2 for r in by.values()):
        out.append("- One run per row: the spread is not known (--repeat 3 measures it).")
    return out


def write_jsonl(
    path: Path, summaries: Sequence[Summary], runs: Sequence[ConfigRun], workload: str, setup: str, per_request: bool
) -> None:
    with open(path, "a") as f:
        for s, run in zip(summaries, runs):
            f.write(json.dumps({**s.to_json(), "workload": workload, "setup": setup}) + "\n")
            row = accounted(run)
            accounts = {a.index: {"account": a.to_json()} for a in row.requests} if row is not None else {}
            if per_request:
                for r in run.records:
                    f.write(
                        json.dumps(
                            {
                                "bench": "replay-request",
                                "config": s.config,
                                "device_blocks": s.device_blocks,
                                "worker": run.worker_names.get(r.worker_id) if r.worker_id is not None else None,
                                "rate": s.rate,
                                "repeat": s.repeat,
                                **r.to_json(),
                                **(accounts.get(r.index) or {}),
                            }
                        )
                        + "\n"
                    )


def first_error(runs: Sequence[ConfigRun]) -> str | None:
    for run in runs:
        for r in run.records:
            if r.error:
                return f"{run.label} request {r.index}: {r.error}"
    return None
