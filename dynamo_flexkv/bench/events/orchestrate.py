"""The orchestrator: starts the event plane, the router and the publishers for one case, steps
them through the run over their stdin/stdout, and turns what they report into rows, cases and a plot."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_flexkv.bench.events.plumbing import low_port, percentile, worker_ids
from dynamo_flexkv.bench.events.router import LIVE_TIMEOUT
from dynamo_flexkv.bench.events.workload import PROBE_INTERVAL
from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.procgroup import kill_group, signal_group, wait_group
from dynamo_flexkv.core.sysutil import find_binary

PUBLISHERS_MAX = 4
WORKERS_PER_PUBLISHER = 250
ATTEMPTS = 3  # a case whose workers did not all go live starts again from scratch (see run_case)


# What Dynamo 1.6.1's router, indexer and event plane log when a KV event is lost, skipped or could
# not be applied (the messages' fixed text, read from the wheel's dynamo/_core.abi3.so). A line
# counts only if it holds one of these: its shutdown says "LocalScheduler worker config watch
# dropped, shutting down", which mentions "dropped" and loses nothing.
LOST_EVENT_MESSAGES = (
    "dropping the newest batch",  # Brokered-ZMQ publisher lane is full; ...
    "Event subscriber channel full; dropping event",
    "Replica subscriber channel full; dropping event",
    "Dropping KV event batch from an inactive or ambiguous source",
    "Dropping KV event with unknown medium",
    "event(s) dropped; first error",
    "Gap detected: expected seq",
    "Input event gap detected: raw events dropped before batching",
    "Non-consecutive KV event id; buffer may have gaps",
    "after an event sequence gap",  # Failed to clear KV state after an event sequence gap; ...
    "KV event sequence gap",
    "KV indexer rejected degraded",  # ... gap event / live events; rank remains fenced
    "KV event queue rejected a live event",
    "Failed to apply event",  # ": <error>" and " to local indexer"
    "Failed to apply lower-tier event",
    "unknown parent block hash",
    "failed to recover after internal lag",
)


def lost_event_lines(log: str) -> list[str]:
    """The lines of a router's or publisher's log that report a lost or unapplied KV event."""
    return [ln for ln in log.splitlines() if any(m in ln for m in LOST_EVENT_MESSAGES)]


class Infra:
    """The event plane for one transport: a ZMQ broker or a nats-server on loopback."""

    def __init__(self, transport: str, workdir: str) -> None:
        from dynamo_flexkv.core.sysutil import free_port
        from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV

        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, **LOOPBACK_ENV, DYN_LOG=os.environ.get("DYN_LOG", "warn"))
        for k in ("DYN_ZMQ_BROKER_URL", "NATS_SERVER", "DYN_SYSTEM_PORT"):
            self.env.pop(k, None)
        if transport == "zmq":
            xsub, xpub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dynamo_flexkv.serve.zmq_broker", xsub, xpub],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own group, as every process stop() stops
                )
            )
            self.env["DYN_ZMQ_BROKER_URL"] = f"xsub={xsub} , xpub={xpub}"
        elif transport == "nats":
            server = find_binary("nats-server")
            if not server:
                raise RuntimeError("nats-server not found: scripts/install.sh installs it (Debian's nats-server)")
            port = free_port()
            store = os.path.join(workdir, "nats")
            self.procs.append(
                subprocess.Popen(
                    [server, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            self.env["NATS_SERVER"] = f"nats://127.0.0.1:{port}"
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("nats-server did not listen within 10 s") from None
                    time.sleep(0.05)
        else:
            raise ValueError(f"unknown transport {transport!r}: zmq or nats")

    def close(self) -> None:
        stop(self.procs)


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """Each process's group its signal at once (the ZMQ broker stops on SIGINT), 10 s for all to
    exit, then SIGKILL to what is left (core/procgroup.py)."""
    for p in procs:
        args = p.args if isinstance(p.args, (list, tuple)) else [p.args]
        signal_group(p, signal.SIGINT if "zmq_broker" in " ".join(map(str, args)) else signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        wait_group(p, deadline)
        kill_group(p)


def _child(role: str, cfg: dict[str, Any], env: dict[str, str], log: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynamo_flexkv.bench.events", role, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),
        text=True,
        env=env,
        start_new_session=True,
    )


def _read(proc: subprocess.Popen, what: str, timeout: float, log: str) -> dict[str, Any]:
    result: list[Any] = []

    stdout = proc.stdout
    assert stdout is not None  # PIPE (_child)

    def reader() -> None:
        while True:
            line = stdout.readline()
            if not line:
                return
            if line.startswith("{"):
                result.append(json.loads(line))
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        tail = Path(log).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what}: no answer in {timeout:.0f} s (exit {proc.poll()}); its log ends:\n{tail}")
    return result[0]


def _send(proc: subprocess.Popen, obj: dict[str, Any]) -> None:
    assert proc.stdin is not None  # PIPE (_child)
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


class NotLive(RuntimeError, FlexKVError):
    """Some simulated workers' hello never reached the router before the run."""


def run_case(
    transport: str,
    n: int,
    fmt: str,
    rate: float,
    warmup: float,
    duration: float,
    flush_interval: float,
    keep: str | None = None,
) -> dict[str, Any]:
    """run_once, started again (fresh processes) when some workers' events never reached the router
    before the run: seen in 2 of about 10 starts at 1,000 workers, a few workers of one publisher
    process, listed by the router as workers; the cause was not found. The row says how many
    attempts it took."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            row = run_once(transport, n, fmt, rate, warmup, duration, flush_interval, keep)
            row["attempts"] = attempt
            return row
        except NotLive as e:
            if attempt == ATTEMPTS:
                raise
            print(f"bench events: {e}; starting the case again", file=sys.stderr)
    raise AssertionError("unreachable")


def run_once(
    transport: str,
    n: int,
    fmt: str,
    rate: float,
    warmup: float,
    duration: float,
    flush_interval: float,
    keep: str | None = None,
) -> dict[str, Any]:
    """One measurement: a fresh event plane, router and publishers; every process is stopped
    before it returns."""
    workdir = tempfile.mkdtemp(prefix=f"bench-events-{transport}-{n}-{fmt}-")
    try:
        infra = Infra(transport, workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)  # nothing ran: no logs to keep
        raise
    procs: list[subprocess.Popen] = []
    failed = False
    try:
        env = dict(infra.env, DYN_FILE_KV=os.path.join(workdir, "discovery"))
        port = low_port()
        router_log = os.path.join(workdir, "router.log")
        router = _child(
            "router",
            {"transport": transport, "workers": n, "workdir": workdir, "system_port": port},
            dict(env, DYN_SYSTEM_PORT=str(port)),
            router_log,
        )
        procs.append(router)
        _read(router, "router process", 180, router_log)
        ids = worker_ids(n)
        n_pub = min(PUBLISHERS_MAX, max(1, math.ceil(n / WORKERS_PER_PUBLISHER)))
        pubs, logs = [], []
        for j in range(n_pub):
            log = os.path.join(workdir, f"publisher{j}.log")
            cfg = {
                "transport": transport,
                "workers": n,
                "ids": ids[j::n_pub],
                "format": fmt,
                "seed": j,
                "flush_interval": flush_interval,
            }
            pubs.append(_child("publisher", cfg, env, log))
            logs.append(log)
        procs.extend(pubs)
        for j, p in enumerate(pubs):
            _read(p, f"publisher {j}", 300, logs[j])
        _send(router, {"publishers": n_pub})
        live = _read(router, "router process", LIVE_TIMEOUT + 30, router_log)
        if live["live"] < n:
            raise NotLive(
                f"only {live['live']} of {n} simulated workers' events reached the router in {LIVE_TIMEOUT:.0f} s "
                f"(missing {live['missing']}, of them not listed as workers {live['missing_unlisted']}); "
                f"router log {router_log}"
            )
        for p in pubs:
            _send(p, {"quiet": True})
        hello = sum(_read(p, f"publisher {j}", 60, logs[j])["events"] for j, p in enumerate(pubs))
        _send(router, {"quiet": True})
        _read(router, "router process", 60, router_log)
        go = {"t0": time.time() + 1.0, "warmup": warmup, "duration": duration, "rate": rate}
        for p in [router, *pubs]:
            _send(p, go)
        pres = [_read(p, f"publisher {j}", warmup + duration + 120, logs[j]) for j, p in enumerate(pubs)]
        _read(router, "router process", 60, router_log)
        published = sum(r["events"] for r in pres) - hello
        _send(router, {"published": published, "settle": 30})
        rres = _read(router, "router process", 120, router_log)
        # The router's log up to its report, before it is stopped; lost_event_lines counts only
        # Dynamo's lost-event messages, not its shutdown's "... watch dropped, shutting down".
        stderr = Path(router_log).read_text(errors="replace")
        for p in pubs:
            _send(p, {"exit": True})
        stop([router])
        stop(pubs)
        warnings = lost_event_lines(stderr)
        probes: dict[int, float] = {}
        for r in pres:
            probes.update({int(k): v for k, v in r["probes"].items()})
        seen = {int(k): v for k, v in rres["probe_seen"].items()}
        lags = [seen[k] - t for k, t in probes.items() if k in seen]
        series = sorted((k * PROBE_INTERVAL, round(1e3 * (seen[k] - t), 2)) for k, t in probes.items() if k in seen)
        applied = rres["applied"]
        applied_total = sum(applied.values())
        not_ok = sum(v for k, v in applied.items() if not k.endswith("/ok"))
        blocks: dict[str, list[int]] = {}
        for r in pres:
            for t, (a, b) in r["blocks"].items():
                v = blocks.setdefault(t, [0, 0])
                v[0] += a
                v[1] += b
        requests = sum(r["requests"] for r in pres)
        return {
            "transport": transport,
            "workers": n,
            "format": fmt,
            "rate": rate,
            "duration": duration,
            "requests": requests,
            "blocks": blocks,
            "block_events_per_s": sum(a + b for a, b in blocks.values()) / duration,
            "published": published,
            "applied": applied_total,
            "applied_not_ok": not_ok,
            "frames": sum(r["frames"] for r in pres),
            "skipped": sum(r["skipped"] for r in pres),
            "dropped": max(0, published - applied_total) + not_ok,
            "drop_warnings": len(warnings),
            "drop_warning_sample": warnings[:3],
            "probes_sent": len(probes),
            "probes_seen": len(lags),
            "lag_p50_ms": 1e3 * statistics.median(lags) if lags else float("nan"),
            "lag_p99_ms": 1e3 * percentile(lags, 99) if lags else float("nan"),
            "lag_max_ms": 1e3 * max(lags) if lags else float("nan"),
            "decision_p50_ms": 1e3 * statistics.median(rres["decisions"]) if rres["decisions"] else float("nan"),
            "decision_p99_ms": 1e3 * percentile(rres["decisions"], 99) if rres["decisions"] else float("nan"),
            "decisions": len(rres["decisions"]),
            "router_cpu_cores": rres["cpu_cores"],
            "router_rss_mib": rres["rss_mib"],
            "router_hwm_mib": rres["hwm_mib"],
            "publisher_cpu_cores": sum(r["cpu_cores"] for r in pres),
            "publisher_late_max_s": max(r["late_max_s"] for r in pres),
            "publishers": n_pub,
            "router_loop_stall_max_ms": 1e3 * rres.get("loop_stall_max_s", 0.0),
            "lag_series_ms": series,  # (seconds into the measured window, lag) per probe
        }
    except BaseException:
        failed = True  # the logs of a failed case stay for a look
        print(f"bench events: logs of the failed case kept in {workdir}", file=sys.stderr)
        raise
    finally:
        stop(procs)
        infra.close()
        if keep:
            shutil.copytree(
                workdir,
                os.path.join(keep, os.path.basename(workdir)),
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("nats", "model"),
            )
        if not failed:
            shutil.rmtree(workdir, ignore_errors=True)


TRANSPORTS = ("zmq", "nats")


def check_plan(transports: Sequence[str], sizes: Sequence[int], rate: float, warmup: float, duration: float) -> None:
    """Refuses a plan that would run for minutes and measure nothing, before anything starts."""
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"bench events: unknown transport(s) {unknown}: use zmq and/or nats")
    bad = [n for n in sizes if not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"bench events: worker counts must be positive integers, got {bad}")
    if not (rate > 0 and duration > 0 and warmup >= 0):
        raise ValueError(
            f"bench events: need rate > 0 and duration > 0 (seconds) and warmup >= 0, got rate {rate}, "
            f"duration {duration}, warmup {warmup}"
        )


def measure(
    transports: Sequence[str],
    sizes: Sequence[int],
    rate: float,
    warmup: float,
    duration: float,
    flush_interval: float = 0.005,
    keep: str | None = None,
    log=print,
    rows_path: str | None = None,
) -> list[dict[str, Any]]:
    """Every (transport, size): device-only then ours, each on a fresh router. Returns raw rows
    (also appended to ``rows_path`` as JSON lines as they are measured)."""
    check_plan(transports, sizes, rate, warmup, duration)
    rows = []
    for transport in transports:
        for n in sizes:
            for fmt in ("device", "ours"):
                row = run_case(transport, n, fmt, rate, warmup, duration, flush_interval, keep)
                log(
                    f"  {transport} {n:>5} workers {fmt:<6}: lag p50 {row['lag_p50_ms']:.1f} ms p99 "
                    f"{row['lag_p99_ms']:.1f} ms, dropped {row['dropped']}, router {row['router_cpu_cores']:.2f} "
                    f"cores {row['router_rss_mib']:.0f} MiB, decision p50 {row['decision_p50_ms']:.2f} ms, "
                    f"{row['block_events_per_s']:.0f} block events/s, probes {row['probes_seen']}/{row['probes_sent']}"
                )
                rows.append(row)
                if rows_path:
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return rows


def cases(rows: Sequence[dict[str, Any]]) -> list[Case]:
    out: list[Case] = []
    by = {(r["transport"], r["workers"], r["format"]): r for r in rows}
    for (transport, n, fmt), ours in by.items():
        if fmt != "ours" or (transport, n, "device") not in by:
            continue
        base = by[(transport, n, "device")]
        note = (
            f"dropped ours {ours['dropped']} / device-only {base['dropped']}; "
            f"{ours['block_events_per_s']:.0f} vs {base['block_events_per_s']:.0f} block events/s"
        )
        tag = f"{transport}-{n}w"
        for key, name, unit in (
            ("lag_p50_ms", "lag-p50", "ms"),
            ("lag_p99_ms", "lag-p99", "ms"),
            ("decision_p50_ms", "decision-p50", "ms"),
            ("decision_p99_ms", "decision-p99", "ms"),
            ("router_cpu_cores", "router-cpu", "cores"),
            ("router_rss_mib", "router-rss", "MiB"),
        ):
            out.append(Case("events", f"{name}-{tag}", ours[key], base[key], unit, "device-only events", note))
    return out


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Lag p50/p99, router CPU and decision latency over the worker counts: ours solid, device-only
    dashed, one colour per event plane; the 1 s lag goal as a line."""
    if not rows:
        raise ValueError("bench events: no measured rows to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colours = {"zmq": "tab:blue", "nats": "tab:orange"}
    for transport in sorted({r["transport"] for r in rows}):
        for fmt, style in (("ours", "-o"), ("device", "--s")):
            rs = sorted(
                (r for r in rows if r["transport"] == transport and r["format"] == fmt), key=lambda r: r["workers"]
            )
            if not rs:
                continue
            xs = [r["workers"] for r in rs]
            label = f"{transport}, {'ours (4 tiers)' if fmt == 'ours' else 'device-only'}"
            c = colours.get(transport)
            axes[0].plot(xs, [r["lag_p99_ms"] for r in rs], style, color=c, label=label + " p99")
            axes[0].plot(xs, [r["lag_p50_ms"] for r in rs], style, color=c, alpha=0.35, label=label + " p50")
            axes[1].plot(xs, [r["router_cpu_cores"] for r in rs], style, color=c, label=label)
            axes[2].plot(xs, [r["decision_p50_ms"] for r in rs], style, color=c, label=label + " p50")
    axes[0].axhline(1000, color="red", lw=0.8, ls=":", label="1 s")
    axes[0].set_yscale("log")
    axes[0].set_title("event lag (publish -> visible in best_worker)")
    axes[0].set_ylabel("ms")
    axes[1].set_title("router process CPU")
    axes[1].set_ylabel("cores")
    axes[2].set_title("routing decision (best_worker) latency")
    axes[2].set_ylabel("ms")
    for ax in axes:
        ax.set_xlabel("simulated workers")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    r0 = rows[0]
    drops = [f"{r['transport']}/{r['workers']}/{r['format']}={r['dropped']:.0f}" for r in rows if r["dropped"]]
    fig.suptitle(
        f"bench events: Dynamo KvRouter, {r0['rate']} req/s per simulated worker (Mooncake trace), "
        f"{r0['duration']:.0f} s measured per point; "
        + ("dropped: " + ", ".join(drops) if drops else "no dropped batch"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
