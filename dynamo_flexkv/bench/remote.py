"""bench remote: put and get GB/s of the remote (Redis) link against same-run redis-benchmark.

For 128 KiB and 2 MiB blocks, RemoteStore.put / get_into move a batch of blocks (headers and
checksums included, values read straight into block buffers) through one connection with
``pipeline_depth`` commands in flight. The baseline is ``redis-benchmark`` (the C client) against
the same server in the same run with the same value size (block + 48-byte header), the same
pipeline depth (-P), one connection (-c 1) and as many requests as blocks; its GETs hit keys
written beforehand. redis-benchmark is also run unpipelined (-P 1), and the better of its two
figures is the baseline (it is much slower with deep pipelines of large SETs here, and a weak
baseline proves nothing). The sides alternate and medians are reported. A local three-node Redis
Cluster runs the same cases (``cluster-*``) against redis-benchmark --cluster with one connection
per node. Ratios are ours / baseline; higher is better.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from typing import Callable, List, Tuple

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.remote import HEADER_BYTES, RemoteStore, fingerprint_of
from dynamo_flexkv.remote.resp import RespConnection, encode_command
from dynamo_flexkv.remote.server import RedisCluster, RedisServer, require_binary

SIZES = {"128KiB": (128 << 10, 16), "2MiB": (2 << 20, 4)}  # label -> (block bytes, pipeline depth)


def _rps(output: str, test: str) -> float:
    m = re.search(rf"^{test}: ([0-9.]+) requests per second", output.replace("\r", "\n"), re.M)
    if not m:
        raise RuntimeError(f"redis-benchmark printed no {test} result:\n{output[-2000:]}")
    return float(m.group(1))


def redis_benchmark(port: int, test: str, value_bytes: int, n: int, depth: int, conns: int, cluster: bool) -> float:
    """Seconds redis-benchmark needs for ``n`` requests (its own requests/s, so process start is not counted)."""
    cmd = [require_binary("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port), "-t", test,
           "-d", str(value_bytes), "-P", str(depth), "-c", str(conns), "-n", str(n), "-r", str(n), "-q"]
    if cluster:
        cmd.append("--cluster")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return n / _rps(out.stdout + out.stderr, test.upper())


def _populate(nodes: List[Tuple[str, int]], value_bytes: int, n: int, depth: int) -> None:
    """Writes the keys redis-benchmark's GETs ask for (key:000000000000 ...), so every GET hits."""
    from dynamo_flexkv.remote.cluster import SlotMap

    value = b"x" * value_bytes
    conns = [RespConnection(h, p, timeout_s=30, connect_timeout_s=5) for h, p in nodes]
    try:
        slots = SlotMap(conns[0].call(b"CLUSTER", b"SLOTS"), nodes[0][0]) if len(nodes) > 1 else None
        keys = [b"key:%012d" % i for i in range(n)]
        groups = slots.group(keys) if slots else {0: list(range(n))}
        by_node = {nodes.index(slots.nodes[g]) if slots else 0: idx for g, idx in groups.items()}
        for node, idx in by_node.items():
            for lo in range(0, len(idx), depth):
                conns[node].pipeline([encode_command(b"SET", keys[i], value) for i in idx[lo:lo + depth]])
    finally:
        for c in conns:
            c.close()


def _alternate(fns: List[Callable[[], float]], repeat: int) -> List[float]:
    """Median of each timing function, run alternately (drift hits every side alike), one warm-up."""
    for f in fns:
        f()
    runs: List[List[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for f, r in zip(fns, runs):
            r.append(f())
    return [statistics.median(r) for r in runs]


def link_cases(prefix: str, url: str, ports: List[int], cluster: bool, total_bytes: int, repeat: int) -> List[Case]:
    cases: List[Case] = []
    rng = np.random.default_rng(0)
    store = None
    try:
        for label, (block, depth) in SIZES.items():
            store = RemoteStore.open(url, fingerprint_of({"bench": "remote"}), pipeline_depth=depth, timeout_s=30)
            n = max(8, total_bytes // block)
            src = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
            dst = np.zeros_like(src)
            src_rows, dst_rows = list(src), list(dst)
            seq = rng.integers(1, 2**63, size=n, dtype=np.uint64)
            value_bytes = block + HEADER_BYTES
            _populate([("127.0.0.1", p) for p in ports], value_bytes, n, depth)

            def baseline(test: str, p: int) -> Callable[[], float]:
                return lambda: redis_benchmark(ports[0], test, value_bytes, n, p, len(ports), cluster)

            def ours_put() -> float:
                t0 = time.perf_counter()
                stored = store.put(seq, src_rows)
                dt = time.perf_counter() - t0
                if stored != n:
                    raise RuntimeError(f"remote put stored {stored} of {n} blocks: {store.stats()}")
                return dt

            def ours_get() -> float:
                t0 = time.perf_counter()
                got = store.get_into(seq, dst_rows)
                dt = time.perf_counter() - t0
                if got != n:
                    raise RuntimeError(f"remote get read {got} of {n} blocks: {store.stats()}")
                return dt

            put_s, set_s, set1_s, get_s, get_s_base, get1_s = _alternate(
                [ours_put, baseline("set", depth), baseline("set", 1),
                 ours_get, baseline("get", depth), baseline("get", 1)], repeat)
            if not np.array_equal(src, dst):
                raise RuntimeError("remote get returned other bytes than were put")
            nbytes = n * value_bytes
            for op, ours_s, deep_s, flat_s in (("put", put_s, set_s, set1_s), ("get", get_s, get_s_base, get1_s)):
                best_p = depth if deep_s <= flat_s else 1
                note = (f"{n} blocks, ours -P {depth}; redis-benchmark -c {len(ports)} -P {depth}: "
                        f"{nbytes / deep_s / 1e9:.3g}, -P 1: {nbytes / flat_s / 1e9:.3g} GB/s")
                cases.append(Case("remote", f"{prefix}{op}-{label}", nbytes / ours_s / 1e9,
                                  nbytes / min(deep_s, flat_s) / 1e9, "GB/s",
                                  f"redis-benchmark {'SET' if op == 'put' else 'GET'} -P {best_p}", note))
            store.delete(seq)
            store.close()
            del src, dst, src_rows, dst_rows
    finally:
        if store is not None:
            store.close()
    return cases


def run(args: argparse.Namespace) -> List[Case]:
    total = (32 << 20) if args.quick else (128 << 20)
    repeat = 3 if args.quick else 5
    cases: List[Case] = []
    with RedisServer(maxmemory="2gb") as server:
        cases += link_cases("remote-", server.url, [server.port], False, total, repeat)
    with RedisCluster(maxmemory="1gb") as cluster:
        cases += link_cases("cluster-", cluster.url, [s.port for s in cluster.servers], True, total, repeat)
    return cases
