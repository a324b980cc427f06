"""``bench disagg``: the prefill -> decode KV handover against a raw NIXL transfer of the same bytes
between the same two processes, in the same run.

A prefill process (``--child``: the reference engine, small preset, its own NIXL UCX agent)
computes a prompt and leases its blocks; this process plays the decode worker. Per prompt size:

* handover: DecodeSide.fill as the engine calls it (params checked, one prepared NIXL read of
  every leased block of every layer into freshly allocated engine blocks, the release notice riding
  on it), then the prefill process hands the same prompt over again (a device prefix hit: no
  compute) for the next repeat;
* raw NIXL: one READ of the same bytes between the same two agents into other freshly allocated
  blocks, with the cheapest per-transfer NIXL API: the same prepared descriptor lists, index lists
  computed outside the timed region, timed make_prepped_xfer + transfer + completion + release.
  What a handover adds on top (checks, index lists, the release notice, bookkeeping) is the gap.

Each repeat first reads the blocks once untimed into a third set of blocks, so both timed reads
find the source equally warm and write blocks not written since the previous repeat; which of the
two goes first alternates between repeats.

Ratio = handover GB/s / raw GB/s (higher is better; 1.0 = the handover adds nothing). Latency per
handover is reported too. UCX picks its transports (UCX_TLS) for both alike.

Then the served graphs on one mixed workload (``serving`` cases, milliseconds, lower is better):
graphs/disagg.py against graphs/agg.py, small preset. Short requests stream tokens while long
prompts arrive; TTFT of every request and the inter-token latency of the streaming ones, p50/p99.

Last the ``etcd`` cases: what carrying the prefill agent's NIXL metadata in every request costs
(handover params bytes and parse time, with vs without it) against publishing it once per worker
under an etcd lease (put under a lease and get latency, p50/p99, on a private etcd on 127.0.0.1
through its v3 JSON gateway over one keep-alive HTTP connection: no etcd client is installed).
Skipped with a note when no ``etcd`` binary is on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.procgroup import stop_process
from dynamo_flexkv.integrations.disagg.params import HandoverParams
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import Request, SamplingParams

PRESET = "small"
MARK = "HANDOVER "


def _child(lease_s: float, blocks: int) -> None:
    """The prefill process: one prompt per stdin line -> one handover per stdout line."""
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent, exit_past_libnl
    from dynamo_flexkv.integrations.disagg.roles import PrefillSide

    parent = os.getppid()

    def orphaned() -> None:  # the benchmark died: do not outlive it
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    with exit_past_libnl():
        engine = LLMEngine(EngineModelConfig.load(PRESET), num_device_blocks=blocks)
        side = PrefillSide(engine, KVAgent(engine.kv_cache.layers), lease_s)
        for line in sys.stdin:
            side.service()  # the previous repeat's release notice
            prompt = json.loads(line)
            engine.generate([prompt], SamplingParams(max_tokens=1))
            print(MARK + json.dumps(side.hand_over(prompt)), flush=True)
        time.sleep(0.2)
        side.service()
        side.close()


class _Prefill:
    def __init__(self, blocks: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_flexkv.bench.disagg", "--child", str(blocks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def hand_over(self, prompt: list[int]) -> HandoverParams:
        self.stdin.write(json.dumps(prompt) + "\n")
        self.stdin.flush()
        while True:
            line = self.stdout.readline()
            if not line:
                raise RuntimeError(f"the prefill process exited ({self.proc.wait()})")
            if line.startswith(MARK):  # NIXL logs to stdout too
                params = HandoverParams.from_dict(json.loads(line[len(MARK) :]))
                if params is None:
                    raise RuntimeError("the prefill process handed over nothing (no handover in its params)")
                return params

    def close(self) -> None:
        self.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawRead:
    """One raw NIXL READ of the leased blocks of every layer into ``local`` blocks, on the same
    prepared descriptor lists the agent holds (its own KV; the peer's, prepared on the first
    handover), index lists computed here (untimed); ``__call__`` is the timed part."""

    def __init__(self, agent, p: HandoverParams, local: Sequence[int], remote: Sequence[int] | None = None) -> None:
        from dynamo_flexkv.core.transfer.nixl_agent import _indices

        self.a = agent.agent
        peer = agent._connect(p)  # a no-op once the first handover added the prefill agent
        self.lists = agent._local, peer.dlist
        remote = p.blocks[: len(local)] if remote is None else remote
        self.idx = _indices(agent._offsets, local), _indices(peer.offsets, remote)

    def __call__(self) -> None:
        a = self.a
        handle = a.make_prepped_xfer("READ", self.lists[0], self.idx[0], self.lists[1], self.idx[1])
        try:
            state = a.transfer(handle)
            while state == "PROC":
                time.sleep(0)  # as the handover polls: a busy loop starves UCX's own thread on a small host
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL read failed ({state})")
        finally:
            a.release_xfer_handle(handle)


def _timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _stream(base_url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[list[float], int]:
    """Arrival times (perf_counter: the request, then each streamed chunk) of one greedy
    completion, and how many tokens it generated (the usage chunk)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(base_url)
    if u.hostname is None:
        raise ValueError(f"{base_url!r}: not an http://host:port URL")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"completion failed: HTTP {resp.status} {resp.read()[:200]!r}")
    times, tokens = [t0], 0
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            doc = json.loads(line[5:])
            if doc.get("choices"):
                times.append(time.perf_counter())
            if doc.get("usage"):
                tokens = int(doc["usage"]["completion_tokens"])
    conn.close()
    return times, tokens


def _serve_workload(graph: str, quick: bool, tmp: str) -> dict:
    """TTFT of every request, inter-token gaps of the streaming ones, on one served graph
    (agg / disagg: the reference engine; agg_vllm / disagg_vllm: vLLM workers)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    root = Path(__file__).resolve().parents[2]
    sections = (
        ["PrefillWorker", "DecodeWorker"]
        if graph.startswith("disagg")
        else ["VllmWorker"]
        if graph.endswith("vllm")
        else ["FlexKVWorker"]
    )
    overrides = ["Frontend.http-port=0"] + [f"{s}.cache.ssd_cache_dir={tmp}/{graph}-{s}{{replica}}" for s in sections]
    config = apply_overrides(load_config(str(root / "configs" / f"{graph}.yaml")), overrides)
    plan = build_plan(load_graph(str(root / "graphs" / f"{graph}.py")), config, run_dir=Path(tmp) / f"run-{graph}")
    rng = np.random.default_rng(1)
    vocab = EngineModelConfig.load(plan.model).vocab_size
    n_stream, n_long = (2, 2) if quick else (3, 4)
    streaming = [rng.integers(0, vocab, 64).tolist() for _ in range(n_stream)]
    longs = [rng.integers(0, vocab, 2048 if quick else 3072).tolist() for _ in range(n_long)]
    with Launcher(plan) as launcher:
        launcher.wait_ready(600 if graph.endswith("vllm") else 180)  # a vLLM engine starts in 1-3 min on 2 cores
        _stream(plan.base_url, plan.served_model_name, rng.integers(0, vocab, 128).tolist(), 2)  # warm-up
        with ThreadPoolExecutor(n_stream + n_long) as pool:
            chatty = [pool.submit(_stream, plan.base_url, plan.served_model_name, p, 48) for p in streaming]
            time.sleep(1.0)  # they are decoding when the long prompts arrive
            long_futs = []
            for p in longs:
                long_futs.append(pool.submit(_stream, plan.base_url, plan.served_model_name, p, 4))
                threading.Event().wait(0.5)
            runs = [f.result() for f in chatty], [f.result() for f in long_futs]
    ttft = [t[1] - t[0] for r in runs for t, _ in r]
    # Per streaming request, (last chunk - first token) / (tokens - 1): the frontend drops the
    # chunks of tokens that decode to no text (most of this random-weight model's), so gaps between
    # chunks are not gaps between tokens.
    itl = [(t[-1] - t[1]) / (n - 1) for t, n in runs[0] if n > 1]
    return {"ttft": ttft, "itl": itl}


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


def serving_cases(args: argparse.Namespace, engine: str = "") -> list[Case]:
    """``engine`` "vllm": graphs/disagg_vllm.py against graphs/agg_vllm.py."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="flexkv-bench-disagg-", dir=getattr(args, "dir", None))
    suffix = f"_{engine}" if engine else ""
    agg = _serve_workload("agg" + suffix, args.quick, tmp)
    dis = _serve_workload("disagg" + suffix, args.quick, tmp)
    cases = []
    for metric in ("ttft", "itl"):
        for q in (50, 99):
            cases.append(
                Case(
                    "disagg",
                    f"{engine + '-' if engine else ''}serving-{metric}-p{q}",
                    _pct(dis[metric], q),
                    _pct(agg[metric], q),
                    "ms",
                    "agg graph, same workload",
                    f"lower is better; {len(dis[metric])} samples"
                    + ("; per streaming request: (last chunk - first token) / (tokens - 1)" if metric == "itl" else ""),
                )
            )
    return cases


def run(args: argparse.Namespace) -> list[Case]:
    """The reference engine's cases (``--vllm``: bench/vllm_disagg.py runs instead, the dispatch in
    bench/__init__.py)."""
    cases = _handover_cases(args)
    cases += serving_cases(args)
    cases += _etcd_cases(args)
    return cases


class _Etcd:
    """A private single-node etcd on 127.0.0.1 (temp data dir), spoken to through its v3 JSON gateway."""

    def __init__(self, binary: str, tmp: str) -> None:
        import http.client

        from dynamo_flexkv.core.sysutil import free_port
        from dynamo_flexkv.serve.infra import etcd_argv

        client, peer = free_port(), free_port()
        self.log = open(os.path.join(tmp, "etcd.log"), "wb")  # noqa: SIM115 - etcd's, closed in close()
        self.proc = subprocess.Popen(
            etcd_argv(binary, "bench", os.path.join(tmp, "data"), client, peer),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.conn = http.client.HTTPConnection("127.0.0.1", client, timeout=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.call("/v3/maintenance/status", {})
                return
            except OSError:
                self.conn.close()  # reconnects on the next request
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"etcd did not start (see {self.log.name})") from None
                time.sleep(0.1)

    def call(self, path: str, body: dict) -> dict:
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        doc = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"etcd {path}: HTTP {r.status} {doc}")
        return doc

    def close(self) -> None:
        self.conn.close()
        stop_process(self.proc, 10)
        self.log.close()


def _etcd_cases(args: argparse.Namespace) -> list[Case]:
    import base64
    import shutil
    import tempfile

    from dynamo_flexkv.core.sysutil import find_binary
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent

    binary = find_binary("etcd")
    if binary is None:
        print("bench disagg: etcd cases skipped: no etcd on PATH (Debian: apt-get install etcd-server)")
        return []
    n = 200 if args.quick else 1000
    cfg = EngineModelConfig.load(PRESET)
    engine = LLMEngine(cfg, num_device_blocks=64)
    agent = KVAgent(engine.kv_cache.layers)
    tmp = tempfile.mkdtemp(prefix="flexkv-bench-etcd-", dir=getattr(args, "dir", None))
    etcd = None
    try:
        # A 4K-token prompt's handover, with the metadata inline and without it.
        leased, expires = list(range((4096 - 1) // cfg.block_size)), time.time() + 30
        inline = json.dumps(HandoverParams.of_agent(agent, "L", leased, 1, expires).to_dict())
        bare = json.dumps(HandoverParams.of_agent(agent, "L", leased, 1, expires, with_metadata=False).to_dict())

        # What decode does per request (JSON -> checked params), in alternating 20-parse batches so
        # both forms see the same machine load; medians.
        batches: tuple[list[float], list[float]] = ([], [])
        for _ in range(40 if args.quick else 200):
            for side, text in enumerate((inline, bare)):
                t0 = time.perf_counter()
                for _ in range(20):
                    HandoverParams.from_dict(json.loads(text))
                batches[side].append((time.perf_counter() - t0) / 20 * 1e6)
        parse_inline, parse_bare = (statistics.median(b) for b in batches)

        etcd = _Etcd(binary, tmp)
        b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731 (the gateway takes bytes as base64)
        key, value = b64(f"flexkv/nixl/{agent.name}".encode()), b64(agent.metadata.encode())
        lease = etcd.call("/v3/lease/grant", {"TTL": 30})["ID"]
        puts, gets = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            etcd.call("/v3/kv/put", {"key": key, "value": value, "lease": lease})
            puts.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            got = etcd.call("/v3/kv/range", {"key": key})
            gets.append(time.perf_counter() - t0)
        if base64.b64decode(got["kvs"][0]["value"]).decode() != agent.metadata:
            raise RuntimeError("etcd returned other metadata than was put")
    finally:
        if etcd is not None:
            etcd.close()
        agent.close()
        shutil.rmtree(tmp, ignore_errors=True)
    meta = f"metadata {len(agent.metadata)} B packed; a 4K-token handover ({len(leased)} blocks)"
    cases = [
        Case(
            "disagg",
            "etcd-params-bytes",
            len(bare),
            len(inline),
            "B",
            "params with the metadata inline",
            f"lower is better; {meta}",
        ),
        Case(
            "disagg",
            "etcd-params-parse",
            parse_bare,
            parse_inline,
            "us",
            "parse with the metadata inline",
            "lower is better; json.loads + HandoverParams.from_dict, medians of alternating 20-parse batches",
        ),
    ]
    for name, xs in (("put-under-lease", puts), ("get", gets)):
        for q in (50, 99):
            cases.append(
                Case(
                    "disagg",
                    f"etcd-{name}-p{q}",
                    _pct(xs, q) * 1e3,
                    parse_inline,
                    "us",
                    "one request's params parse, metadata inline",
                    f"lower is better; paid once per worker (put) / per new peer (get), not per request; "
                    f"{n} ops, one keep-alive HTTP connection to etcd's v3 JSON gateway"
                    + ("; a put waits for etcd's WAL fsync" if name.startswith("put") else ""),
                )
            )
    return cases


def _handover_cases(args: argparse.Namespace) -> list[Case]:
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
    from dynamo_flexkv.integrations.disagg.roles import DecodeSide

    cfg = EngineModelConfig.load(PRESET)
    sizes = [1024, 4096] if args.quick else [1024, 4096, 8192]
    repeat = 6 if args.quick else 20
    blocks = 3 * (max(sizes) // cfg.block_size + 2) + 8  # three fresh block sets per repeat
    rng = np.random.default_rng(0)
    decode = LLMEngine(cfg, num_device_blocks=blocks)
    agent = KVAgent(decode.kv_cache.layers)
    side = DecodeSide(decode, agent, pull_timeout=60)
    prefill = _Prefill(sum(s // cfg.block_size + 2 for s in sizes) + 8)
    cases: list[Case] = []
    try:
        for size in sizes:
            prompt = rng.integers(0, cfg.vocab_size, size).tolist()
            hashes = block_hashes(prompt, cfg.block_size)
            cap = (size - 1) // cfg.block_size
            nbytes = cap * agent.block_bytes * cfg.num_layers
            ours, raw = [], []
            for i in range(repeat + 1):  # the first round connects the agents and warms up
                p = prefill.hand_over(prompt)
                assert len(p.blocks) == cap, (len(p.blocks), cap)
                warm, dst = decode.pool.allocate(cap), decode.pool.allocate(cap)
                req = Request(f"b{size}-{i}", prompt, SamplingParams(max_tokens=1), hashes)
                req.block_table = decode.pool.allocate(cap + 1)
                warm_read, raw_read = RawRead(agent, p, warm), RawRead(agent, p, dst)
                warm_read()  # the source is as warm for both timed reads
                side.expect(req.id, p)
                # Alternate which goes first: on a shared host the later read of a pair is more
                # often preempted (measured: either one, 3-5x slower at the median at 1K).
                if i % 2:
                    t_raw, _ = _timed(raw_read)
                    t_ours, got = _timed(side.fill, req, 0, cap)
                else:
                    t_ours, got = _timed(side.fill, req, 0, cap)
                    t_raw, _ = _timed(raw_read)
                for b in (warm, dst, req.block_table):
                    decode.pool.release(b)
                if got != cap:
                    raise RuntimeError(f"handover of {size} tokens pulled {got} of {cap} blocks")
                if i:
                    ours.append(t_ours)
                    raw.append(t_raw)
            t_ours, t_raw = statistics.median(ours), statistics.median(raw)
            label = f"{size // 1024}K" if size >= 1024 else str(size)
            cases.append(
                Case(
                    "disagg",
                    f"handover-{label}",
                    nbytes / t_ours / 1e9,
                    nbytes / t_raw / 1e9,
                    "GB/s",
                    "raw NIXL READ, same bytes, same processes",
                    f"{nbytes / 2**20:.0f} MiB, {t_ours * 1e3:.2f} ms per handover vs {t_raw * 1e3:.2f} ms "
                    f"raw, medians of {repeat}",
                )
            )
    finally:
        prefill.close()
        agent.close()
    return cases


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        _child(lease_s=60.0, blocks=int(sys.argv[2]))
