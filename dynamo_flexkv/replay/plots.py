"""PNG plots of a replay comparison: TTFT CDF per configuration, prompt tokens by where they came
from, requests per worker, throughput, and the device-size sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynamo_flexkv.replay.client import TIERS
from dynamo_flexkv.replay.configs import ConfigRun
from dynamo_flexkv.replay.report import Summary

TIER_COLORS = {"device": "#2b8cbe", "host": "#7bccc4", "disk": "#fdae6b", "remote": "#e6550d", "computed": "#d9d9d9"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    return plt


def write_plots(out: Path, runs: Sequence[ConfigRun], summaries: Sequence[Summary], main_blocks: int) -> list[Path]:
    """Writes the PNGs into ``out``; the per-configuration plots show the runs at ``main_blocks``."""
    main = [(r, s) for r, s in zip(runs, summaries) if s.device_blocks == main_blocks]
    if not any(r.error is None for run, _ in main for r in run.records):
        return []  # no request succeeded: nothing to plot (the caller reports the requests' errors)
    plt = _pyplot()
    labels = [s.config for _, s in main]
    paths = [
        _ttft_cdf(plt, out / "ttft_cdf.png", main, main_blocks),
        _cached(plt, out / "cached_tokens.png", [s for _, s in main], main_blocks),
        _throughput(plt, out / "throughput.png", [s for _, s in main], labels, main_blocks),
    ]
    if any(s.requests_per_worker for _, s in main):  # none when no request names its worker
        paths.insert(2, _workers(plt, out / "requests_per_worker.png", [s for _, s in main], main_blocks))
    if len({s.device_blocks for s in summaries}) > 1:
        paths.append(_sweep(plt, out / "device_sweep.png", summaries))
    return paths


def _ttft_cdf(plt, path: Path, main, blocks: int) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for run, s in main:
        xs = sorted(r.ttft_ms for r in run.records if r.error is None and r.ttft_ms is not None)
        if xs:
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                label=f"{s.config} (p50 {s.ttft_p50_ms:,.0f} ms)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF per configuration ({blocks} device blocks per worker)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return _save(plt, fig, path)


def _cached(plt, path: Path, summaries: Sequence[Summary], blocks: int) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    x = range(len(summaries))
    bottom = [0.0] * len(summaries)
    parts: dict[str, list[float]] = {t: [s.cached[t] / 1000 for s in summaries] for t in TIERS}
    parts["computed"] = [s.computed_tokens / 1000 for s in summaries]
    for name, values in parts.items():
        ax.bar(x, values, bottom=bottom, label=name, color=TIER_COLORS[name])
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, s in enumerate(summaries):
        ax.text(i, bottom[i], f"{s.hit_rate['all']:.0%} cached", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [s.config for s in summaries], rotation=15)
    ax.set_ylim(0, max(bottom, default=1) * 1.25)  # room for the legend above the bars
    ax.set_ylabel("prompt tokens (thousands)")
    ax.set_title(f"Prompt tokens by source ({blocks} device blocks per worker)")
    ax.legend(loc="upper center", ncol=4)
    return _save(plt, fig, path)


def _workers(plt, path: Path, summaries: Sequence[Summary], blocks: int) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    workers = sorted({w for s in summaries for w in s.requests_per_worker})
    width = 0.8 / max(1, len(workers))
    for k, w in enumerate(workers):
        ax.bar(
            [i + k * width - 0.4 + width / 2 for i in range(len(summaries))],
            [s.requests_per_worker.get(w, 0) for s in summaries],
            width,
            label=w,
        )
    ax.set_xticks(list(range(len(summaries))), [s.config for s in summaries], rotation=15)
    ax.set_ylim(0, max((n for s in summaries for n in s.requests_per_worker.values()), default=1) * 1.2)
    ax.set_ylabel("requests served")
    ax.set_title(f"Load per worker ({blocks} device blocks per worker)")
    ax.legend(loc="upper center", ncol=len(workers))
    return _save(plt, fig, path)


def _throughput(plt, path: Path, summaries: Sequence[Summary], labels: Sequence[str], blocks: int) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = list(range(len(summaries)))
    a.bar(x, [s.requests_per_s for s in summaries], color="#6a51a3")
    a.set_ylabel("requests / s")
    b.bar(x, [s.prompt_tokens_per_s / 1000 for s in summaries], color="#238b45")
    b.set_ylabel("prompt tokens / s (thousands)")
    for ax in (a, b):
        ax.set_xticks(x, labels, rotation=20)
        for bar in ax.patches:
            ax.annotate(
                f"{bar.get_height():.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    fig.suptitle(f"Throughput over the replay's wall time ({blocks} device blocks per worker)")
    return _save(plt, fig, path)


def _sweep(plt, path: Path, summaries: Sequence[Summary]) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for config in dict.fromkeys(s.config for s in summaries):
        pts = sorted((s.device_blocks, s) for s in summaries if s.config == config)
        if len(pts) < 2:
            continue
        a.plot([p for p, _ in pts], [s.ttft_p50_ms for _, s in pts], marker="o", label=config)
        b.plot([p for p, _ in pts], [100 * s.hit_rate["all"] for _, s in pts], marker="o", label=config)
    for ax, ylabel in ((a, "TTFT p50 (ms)"), (b, "prompt tokens cached (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("device blocks per worker")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Device cache size sweep")
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
