"""The main job: the agg_router graph (frontend in KV-router mode, two FlexKV workers with host and
SSD offload) serving multi-turn conversations from the Mooncake trace over the OpenAI HTTP API,
then the same workload on the same graph with offload disabled. Prints per turn the worker the
router chose, the prompt tokens served from each tier and the TTFT, and the totals of both runs.

Which worker served a request comes from the frontend's ``nvext.worker_id``; the tokens per tier
from that worker's ``flexkv_prompt_tokens_cached_total`` on its /metrics (requests go one at a
time, so the change across a request is that request's)."""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dynamo_flexkv.workload import Scale, Turn, trace_turns

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("device", "host", "disk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph", default=str(ROOT / "graphs" / "agg_router.py"))
    p.add_argument("-f", "--config", default=str(ROOT / "configs" / "agg_router.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for both runs (e.g. FlexKVWorker.num-device-blocks=64)")
    p.add_argument("--trace", help="Mooncake-format trace (default: ../shared/traces/mooncake_conversation_trace.jsonl)")
    p.add_argument("--conversations", type=int, default=Scale.conversations)
    p.add_argument("--max-turns", type=int, default=Scale.max_turns)
    p.add_argument("--tokens-per-hash-block", type=int, default=Scale.tokens_per_hash_block,
                   help="tokens per 512-token trace block (scales prompt length)")
    p.add_argument("--max-prompt-tokens", type=int, default=Scale.max_prompt_tokens)
    p.add_argument("--json", help="append both runs' per-turn records and totals to this JSONL file")
    p.add_argument("--logs", action="store_true", help="stream the components' logs (default: files only)")


@dataclass
class TurnResult:
    turn: Turn
    worker: str
    cached: Dict[str, int]
    ttft_ms: float
    prompt_tokens: int


@dataclass
class RunResult:
    label: str
    results: List[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    def totals(self) -> Dict[str, float]:
        ttft = [r.ttft_ms for r in self.results]
        later = [r.ttft_ms for r in self.results if r.turn.turn > 0]
        prompt = sum(r.prompt_tokens for r in self.results)
        cached = {t: sum(r.cached.get(t, 0) for r in self.results) for t in TIERS}
        return {"requests": len(ttft), "ttft_mean_ms": statistics.fmean(ttft),
                "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": _pct(ttft, 0.9),
                "ttft_later_turns_mean_ms": statistics.fmean(later) if later else 0.0,
                "prompt_tokens": prompt, **{f"cached_{t}": n for t, n in cached.items()},
                "computed_tokens": prompt - sum(cached.values()), "wall_s": self.wall_s}


def _pct(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Client:
    """Streams completions from the frontend and reads the workers' metrics."""

    def __init__(self, base_url: str, model: str, workers: Dict[str, int]) -> None:
        m = re.match(r"http://([^:/]+):(\d+)", base_url)
        self.host, self.port, self.model = m.group(1), int(m.group(2)), model
        self.system_ports = workers  # worker name -> system port
        self.ids = {self._worker_id(port): name for name, port in workers.items()}

    def complete(self, turn: Turn) -> Tuple[float, Optional[int], int]:
        """(TTFT ms, decode worker id, prompt tokens) of one streamed completion."""
        body = json.dumps({"model": self.model, "prompt": turn.tokens, "max_tokens": turn.output_tokens,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                           "nvext": {"extra_fields": ["worker_id"]}})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion failed: HTTP {resp.status}: {resp.read()[:500]!r}")
        ttft, worker, prompt = None, None, len(turn.tokens)
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = (time.perf_counter() - t0) * 1000
            wid = (chunk.get("nvext") or {}).get("worker_id") or {}
            worker = wid.get("decode_worker_id", worker)
            if chunk.get("usage"):
                prompt = chunk["usage"].get("prompt_tokens", prompt)
        conn.close()
        if ttft is None:
            raise RuntimeError("the stream ended without a token")
        return ttft, worker, prompt

    def cached_tokens(self, name: str) -> Dict[str, int]:
        text = self._metrics(self.system_ports[name])
        out = {t: 0 for t in TIERS}
        for m in re.finditer(r'^flexkv_prompt_tokens_cached_total\{[^}]*tier="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M):
            out[m.group(1)] = int(float(m.group(2)))
        return out

    def _worker_id(self, port: int) -> int:
        m = re.search(r'dynamo_component_\w+\{[^}]*worker_id="([0-9a-f]+)"', self._metrics(port))
        if m is None:
            raise RuntimeError(f"worker on system port {port} reports no worker_id on /metrics")
        return int(m.group(1), 16)

    @staticmethod
    def _metrics(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()


class Progress:
    def __init__(self, total: int, label: str, out=sys.stderr) -> None:
        self.total, self.label, self.out, self.n, self.t0 = total, label, out, 0, time.monotonic()

    def step(self, note: str = "") -> None:
        self.n += 1
        width = 30
        done = width * self.n // self.total
        self.out.write(f"\r{self.label:<12} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} "
                       f"{time.monotonic() - self.t0:5.0f}s {note:<28}")
        if self.n == self.total:
            self.out.write("\n")
        self.out.flush()


def run_workload(label: str, args: argparse.Namespace, turns: List[Turn], overrides: List[str]) -> RunResult:
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    run_dir = Path(tempfile.mkdtemp(prefix=f"dynamo-flexkv-demo-{label}-"))
    config = apply_overrides(load_config(args.config), [
        "Frontend.http-port=0",  # any free port: the demo never collides with a running graph
        f"FlexKVWorker.cache.ssd_cache_dir={run_dir}/ssd{{replica}}",  # fresh disk tier per run
        *args.set, *overrides])
    plan = build_plan(load_graph(args.graph), config, run_dir=run_dir, source=args.config)
    sys.stderr.write(f"{label}: starting {plan.graph.name} ({len(plan.workers)} workers), logs in {run_dir}/logs\n")
    run = RunResult(label)
    with Launcher(plan, sys.stderr if args.logs else None) as launcher:
        launcher.wait_ready(300)
        client = Client(plan.base_url, plan.served_model_name, {p.name: p.port for p in plan.workers})
        before = {name: client.cached_tokens(name) for name in client.system_ports}
        bar = Progress(len(turns), label)
        t0 = time.perf_counter()
        for turn in turns:
            launcher.check_alive()
            ttft, wid, prompt = client.complete(turn)
            name = client.ids.get(wid, f"? {wid}")
            cached = {t: 0 for t in TIERS}
            if name in client.system_ports:
                after = client.cached_tokens(name)
                cached = {t: after[t] - before[name][t] for t in TIERS}
                before[name] = after
            run.results.append(TurnResult(turn, name, cached, ttft, prompt))
            bar.step(f"conv {turn.conversation} turn {turn.turn} {ttft:7.0f} ms")
        run.wall_s = time.perf_counter() - t0
    return run


def print_report(scale: Scale, on: RunResult, off: RunResult, out=sys.stdout) -> None:
    w = out.write
    w(f"\nWorkload: {scale.describe()}.\n\n")
    w("| # | conv | turn | prompt | worker | device | host | disk | TTFT offload ms | "
      "no-offload worker | no-offload cached | TTFT no-offload ms |\n")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for i, (a, b) in enumerate(zip(on.results, off.results)):
        w(f"| {i} | {a.turn.conversation} | {a.turn.turn} | {a.prompt_tokens} | {a.worker} | {a.cached['device']} | "
          f"{a.cached['host']} | {a.cached['disk']} | {a.ttft_ms:.0f} | {b.worker} | {sum(b.cached.values())} | "
          f"{b.ttft_ms:.0f} |\n")
    t_on, t_off = on.totals(), off.totals()
    w("\n| total | offload (host+SSD) | no offload | ratio no-offload/offload |\n|---|---|---|---|\n")
    for key, fmt in (("ttft_mean_ms", "{:.0f}"), ("ttft_p50_ms", "{:.0f}"), ("ttft_p90_ms", "{:.0f}"),
                     ("ttft_later_turns_mean_ms", "{:.0f}"), ("cached_device", "{:d}"), ("cached_host", "{:d}"),
                     ("cached_disk", "{:d}"), ("computed_tokens", "{:d}"), ("wall_s", "{:.1f}")):
        a, b = t_on[key], t_off[key]
        ratio = f"{b / a:.2f}" if a else "-"
        w(f"| {key} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |\n")
    w(f"\nTTFT gain with offload: mean {t_off['ttft_mean_ms'] / t_on['ttft_mean_ms']:.2f}x, later turns "
      f"{t_off['ttft_later_turns_mean_ms'] / max(t_on['ttft_later_turns_mean_ms'], 1e-9):.2f}x; prompt tokens "
      f"computed {t_on['computed_tokens']} vs {t_off['computed_tokens']} of {t_on['prompt_tokens']}.\n")


def run(args: argparse.Namespace) -> int:
    from dynamo_flexkv.serve import GraphError
    from dynamo_flexkv.serve.launcher import ComponentDied

    scale = Scale(conversations=args.conversations, max_turns=args.max_turns,
                  tokens_per_hash_block=args.tokens_per_hash_block, max_prompt_tokens=args.max_prompt_tokens)
    try:
        turns = trace_turns(scale, args.trace)
        on = run_workload("offload", args, turns, [])
        off = run_workload("no-offload", args, turns, ["FlexKVWorker.offload=false"])
    except (GraphError, ComponentDied, TimeoutError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_report(scale, on, off)
    if args.json:
        with open(args.json, "a") as f:
            for r in (on, off):
                f.write(json.dumps({"bench": "demo", "run": r.label, "workload": scale.describe(),
                                    "totals": r.totals(),
                                    "turns": [{"conversation": x.turn.conversation, "turn": x.turn.turn,
                                               "prompt": x.prompt_tokens, "worker": x.worker, "cached": x.cached,
                                               "ttft_ms": round(x.ttft_ms, 1)} for x in r.results]}) + "\n")
    return 0
