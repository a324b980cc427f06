"""bench remote: put and get GB/s of the remote (Redis) link against same-run redis-benchmark.

For 128 KiB and 2 MiB blocks, RemoteStore.put / get_into move a batch of blocks (headers
included, values read straight into block buffers, every value's payload verified by its xxh3)
through one connection with ``pipeline_depth`` commands in flight. A put writes the checksums the
host pool recorded when the blocks' bytes landed (as RemoteMover's write-behind does: the D2H
copy hashes what it copies, see bench links' host-d2h cases), so they are taken before the timed
part; the note gives that hash pass alone. The baseline is ``redis-benchmark`` (the C client) against
the same server in the same run with the same value size (block + 48-byte header), the same
pipeline depth (-P), one connection (-c 1) and a keyspace of as many keys as blocks (four
requests per key); its GETs hit keys written beforehand (checked: the servers count no miss).
A sample of ours moves the batch four times, as many requests as a sample of redis-benchmark.
redis-benchmark also runs unpipelined (-P 1) and the better of its two figures is the baseline
(deep pipelines of large SETs are slow in it, and a weak baseline proves nothing). The sides
alternate and medians are reported. A local three-node Redis Cluster runs the same cases
(``cluster-*``) against redis-benchmark --cluster with one connection and one thread per node,
as ours uses (each call of ours returns when its fullest node is done, and the note gives the
batch's blocks per node: the 2 MiB batch's 32 keys fall 15, 10 and 7, so each call ends waiting on
the node with 15, 1.41x the mean); each of its runs there moves 16 GiB (4 GiB with --quick), because its cluster
mode's timing includes ~0.25 s of start-up and ends on a 0.25 s tick, both counted against it
(~0.5 s of ~4.5 s at most; medians of 3). Ratios are ours / baseline; higher is better.

``ttft-remote-90-*``: time to first token of the reference engine (``small`` preset) on a worker
whose own tiers are empty while 90% of the prompt's prefix sits in Redis (written behind by
another worker's offload), against recompute of the same prompt (offload off) in the same run. For
this case lower is better (the ratio is a fraction of the recompute time); the first token
must equal the recomputed one or the run fails. The two run back to back, in alternating order,
and each is the median of its runs (prompts of 4K tokens or fewer get twice the runs: their
times are short and the noise of a shared machine is not). The engine computes with one torch
intra-op thread on both sides: the CPU "device" stands in for a GPU, leaving the other core to
the copies and Redis, as a GPU would; with two threads on this shared 2-core machine torch's
thread pool stalls on any other runnable process, and a 2K recompute measured 0.7-2.0 s against
0.4-0.7 s with one (the same prompts, the same run), drowning what the tiers cost.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from collections.abc import Callable

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.offload import EngineOffload
from dynamo_flexkv.core.remote import HEADER_BYTES, RemoteStore, fingerprint_of
from dynamo_flexkv.core.remote.resp import RespConnection, encode_command
from dynamo_flexkv.serve.redis_server import RedisCluster, RedisServer, require_binary

# label -> (block bytes, pipeline depth): the depth RemoteConfig's default pipeline_bytes (4 MiB in
# flight) gives each size; redis-benchmark runs with the same -P (and -P 1).
SIZES = {"128KiB": (128 << 10, 16), "2MiB": (2 << 20, 2)}
BASELINE_ROUNDS = 4
LINK_REPEAT = 9  # samples per side of each link case (medians): a sample takes ~0.1-0.3 s
# Per redis-benchmark --cluster run: its timing includes ~0.25 s of start-up and ends on a 0.25 s
# tick, so a run must be long for them not to flatter us: 16 GiB takes ~4-7 s here (they then
# cost the baseline <= ~10%); --quick runs move 4 GiB (1.0-1.75 s, up to ~40%).
CLUSTER_BASELINE_BYTES = 16 << 30
CLUSTER_BASELINE_BYTES_QUICK = 4 << 30
CLUSTER_REPEAT = 3  # samples per side of each cluster case (its baseline runs are long)
TTFT_THREADS = 1  # torch intra-op threads of the reference engine in the ttft cases, both sides


def _rps(output: str, test: str) -> float:
    m = re.search(rf"^{test}: ([0-9.]+) requests per second", output.replace("\r", "\n"), re.M)
    if not m:
        raise RuntimeError(f"redis-benchmark printed no {test} result:\n{output[-2000:]}")
    return float(m.group(1))


def _redis_benchmark_seconds(
    port: int, test: str, value_bytes: int, requests: int, keyspace: int, depth: int, conns: int, cluster: bool
) -> float:
    """Seconds redis-benchmark took for ``requests`` requests (from its own requests/s, so process
    start is not counted)."""
    cmd = [
        require_binary("redis-benchmark"),
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-t",
        test,
        "-d",
        str(value_bytes),
        "-P",
        str(depth),
        "-c",
        str(conns),
        "-n",
        str(requests),
        "-r",
        str(keyspace),
        "-q",
    ]
    if cluster:
        cmd.append("--cluster")
    if conns > 1:  # ours runs one thread per cluster node; so does the baseline
        cmd += ["--threads", str(conns)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return requests / _rps(out.stdout + out.stderr, test.upper())


def redis_benchmark(
    port: int,
    test: str,
    value_bytes: int,
    n: int,
    depth: int,
    conns: int,
    cluster: bool,
    cluster_bytes: int = CLUSTER_BASELINE_BYTES,
) -> float:
    """Seconds per ``n`` requests of redis-benchmark on a keyspace of ``n`` keys. On one server it
    issues BASELINE_ROUNDS * n requests. In cluster mode its own timing includes ~0.25 s of
    start-up (the slot map) and ends on a 0.25 s tick (a 128-request run of 2 MiB SETs reads 0.28
    s, 384 reads 0.52 s, 1024 reads 1.02 s), so a short run measures those, not the link: each
    cluster run moves ``cluster_bytes``: a run of 4 GiB (1.0-1.75 s here) read up to 25% slow, so
    the full bench moves 16 GiB per run."""
    requests = BASELINE_ROUNDS * n
    if cluster:
        requests = max(requests, -(-cluster_bytes // value_bytes))
    return _redis_benchmark_seconds(port, test, value_bytes, requests, n, depth, conns, cluster) * n / requests


def _benchmark_keys(ports: list[int], n: int) -> dict[int, list[bytes]]:
    """The keys redis-benchmark's GETs ask each node for: ``key:%012d`` on one server; in cluster
    mode each connection is bound to one node and tags its keys (``key:{tag}:%012d``) so they
    hash there, so one probe SET per node shows each node's tag."""
    if len(ports) == 1:
        return {ports[0]: [b"key:%012d" % i for i in range(n)]}
    subprocess.run(
        [
            require_binary("redis-benchmark"),
            "-h",
            "127.0.0.1",
            "-p",
            str(ports[0]),
            "--cluster",
            "-t",
            "set",
            "-d",
            "1",
            "-P",
            "1",
            "-c",
            str(len(ports)),
            "-n",
            str(100 * len(ports)),
            "-r",
            "1",
            "-q",
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    out: dict[int, list[bytes]] = {}
    for port in ports:
        conn = RespConnection("127.0.0.1", port, timeout_s=30, connect_timeout_s=5)
        try:
            probes = conn.call(b"KEYS", b"key:*:000000000000")
        finally:
            conn.close()
        if not isinstance(probes, list) or len(probes) != 1:
            raise RuntimeError(f"expected one redis-benchmark probe key on node {port}, found {probes}")
        tag = probes[0][: -len(b"000000000000")]
        out[port] = [tag + b"%012d" % i for i in range(n)]
    return out


def _populate(ports: list[int], value_bytes: int, n: int, depth: int) -> None:
    """Writes every key redis-benchmark's GETs will ask for, so each of its GETs is a hit."""
    value = b"x" * value_bytes
    for port, keys in _benchmark_keys(ports, n).items():
        conn = RespConnection("127.0.0.1", port, timeout_s=30, connect_timeout_s=5)
        try:
            for lo in range(0, n, depth):
                replies = conn.pipeline([encode_command(b"SET", k, value) for k in keys[lo : lo + depth]])
                if any(r != "OK" for r in replies):
                    raise RuntimeError(f"populating node {port} failed: {replies[:3]}")
        finally:
            conn.close()


def _remote_hits(offload: EngineOffload) -> int:
    """The remote tier's hits so far (the offloads here are opened with one)."""
    stats = offload.stats()
    remote = stats.remote if stats is not None else None
    if remote is None:
        raise RuntimeError("bench remote: an offload without its remote tier")
    return int(remote.hits)


def _keyspace_misses(ports: list[int]) -> int:
    total = 0
    for port in ports:
        conn = RespConnection("127.0.0.1", port, timeout_s=30, connect_timeout_s=5)
        try:
            reply = conn.call(b"INFO", b"stats")
        finally:
            conn.close()
        found = re.search(r"keyspace_misses:(\d+)", reply.decode() if isinstance(reply, bytes) else "")
        if found is None:
            raise RuntimeError(f"node {port}: INFO stats has no keyspace_misses: {reply!r:.200}")
        total += int(found.group(1))
    return total


def _alternate(fns: list[Callable[[], float]], repeat: int) -> list[float]:
    """Median of each timing function, run alternately (drift hits every side alike), one warm-up."""
    for f in fns:
        f()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for f, r in zip(fns, runs):
            r.append(f())
    return [statistics.median(r) for r in runs]


def link_cases(
    prefix: str,
    url: str,
    ports: list[int],
    cluster: bool,
    total_bytes: int,
    repeat: int,
    cluster_bytes: int = CLUSTER_BASELINE_BYTES,
) -> list[Case]:
    cases: list[Case] = []
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
            _populate(ports, value_bytes, n, depth)

            def baseline(test: str, p: int) -> Callable[[], float]:
                return lambda: redis_benchmark(ports[0], test, value_bytes, n, p, len(ports), cluster, cluster_bytes)

            def ours(op: str, call: Callable[[], int]) -> Callable[[], float]:
                def timed() -> float:
                    # As many requests per sample as redis-benchmark's (BASELINE_ROUNDS batches):
                    # both sides average over the same stretch of this shared machine's load.
                    t0 = time.perf_counter()
                    done = [call() for _ in range(BASELINE_ROUNDS)]
                    dt = (time.perf_counter() - t0) / BASELINE_ROUNDS
                    if done != [n] * BASELINE_ROUNDS:
                        raise RuntimeError(f"remote {op} moved {done} of {n} blocks per batch: {store.stats()}")
                    return dt

                return timed

            t0 = time.perf_counter()
            # What the host pool holds for these blocks: hashed once, when their bytes landed.
            sums = _native.checksums(src.ctypes.data, np.arange(n, dtype=np.uint64) * np.uint64(block), block).tolist()
            hash_s = time.perf_counter() - t0
            ours_put = ours("put", lambda: store.put(seq, src_rows, checksums=sums))
            ours_get = ours("get", lambda: store.get_into(seq, dst_rows))

            put_s, set_s, set1_s, get_s, get_s_base, get1_s = _alternate(
                [
                    ours_put,
                    baseline("set", depth),
                    baseline("set", 1),
                    ours_get,
                    baseline("get", depth),
                    baseline("get", 1),
                ],
                repeat,
            )
            if not np.array_equal(src, dst):
                raise RuntimeError("remote get returned other bytes than were put")
            misses = _keyspace_misses(ports)
            if misses:
                raise RuntimeError(f"{misses} GETs missed: the baseline would have timed empty replies")
            nbytes = n * value_bytes
            placement = ""
            if cluster:
                # redis-benchmark keeps every node busy (one thread per node, no batches); a call of
                # ours ends when its fullest node is done: the note shows how the batch's keys fell.
                counts = list(store.blocks_per_node(seq).values())
                placement = (
                    f"; blocks per node {'/'.join(map(str, counts))}: a call waits for its fullest "
                    f"node, {max(counts) * len(counts) / n:.2f}x the mean"
                )
            for op, ours_s, deep_s, flat_s in (("put", put_s, set_s, set1_s), ("get", get_s, get_s_base, get1_s)):
                best_p = depth if deep_s <= flat_s else 1
                note = (
                    f"{n} blocks, ours -P {depth}; redis-benchmark -c/--threads {len(ports)} -P {depth}: "
                    f"{nbytes / deep_s / 1e9:.3g}, -P 1: {nbytes / flat_s / 1e9:.3g} GB/s"
                    + (
                        f"; checksums taken at landing (not timed here) {n * block / hash_s / 1e9:.3g} GB/s"
                        if op == "put"
                        else "; every payload verified"
                    )
                    + placement
                )
                cases.append(
                    Case(
                        "remote",
                        f"{prefix}{op}-{label}",
                        nbytes / ours_s / 1e9,
                        nbytes / min(deep_s, flat_s) / 1e9,
                        "GB/s",
                        f"redis-benchmark {'SET' if op == 'put' else 'GET'} -P {best_p}",
                        note,
                    )
                )
            store.delete(seq)
            store.close()
            # this size's buffers go before the next one's
            src_rows.clear()
            dst_rows.clear()
            src = dst = np.empty((0, block), dtype=np.uint8)
    finally:
        if store is not None:
            store.close()
    return cases


def ttft_cases(sizes: list[int], repeat: int) -> list[Case]:
    """Both sides with one torch intra-op thread (see the module docstring)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(TTFT_THREADS)
    try:
        return _ttft_cases(sizes, repeat)
    finally:
        torch.set_num_threads(threads)


def _ttft_cases(sizes: list[int], repeat: int) -> list[Case]:
    from dynamo_flexkv.bench.ttft import ONE
    from dynamo_flexkv.core.config import CacheConfig
    from dynamo_flexkv.core.offload import open_offload
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LlamaModel, LLMEngine

    cfg = EngineModelConfig.preset("small")
    model = LlamaModel(cfg)
    blocks = max(sizes) // cfg.block_size + 8
    gb = 2 * blocks * cfg.kv_spec().token_bytes() * cfg.block_size / (1 << 30)
    rng = np.random.default_rng(0)
    cases: list[Case] = []
    with RedisServer(maxmemory="2gb") as server:
        cache = CacheConfig.from_dict(
            dict(tokens_per_block=cfg.block_size, cpu_cache_gb=gb, enable_remote=True, remote_cache_url=server.url)
        )
        # Two workers' offloads, opened as an engine opens them, over one Redis.
        writer = open_offload(cfg.kv_spec(), cache)
        reader = open_offload(cfg.kv_spec(), cache)
        try:

            def first_token(offload: EngineOffload | None, prompt: list[int], puts: bool = False) -> tuple[float, int]:
                engine = LLMEngine(
                    cfg,
                    num_device_blocks=blocks,
                    model=model,
                    offload=offload,
                    offload_puts=puts,
                )
                r = engine.generate([prompt], ONE)[0]
                engine.flush()
                return r.ttft, r.output[0]

            first_token(None, rng.integers(0, cfg.vocab_size, 512).tolist())  # warm-up
            for size in sizes:
                base, remote = [], []
                runs = repeat if size > 4096 else 2 * repeat  # short prompts: more noise, cheap runs
                for i in range(runs):
                    prompt = rng.integers(0, cfg.vocab_size, size).tolist()
                    first_token(writer, prompt[: int(size * 0.9)], puts=True)  # computed once, written to Redis
                    if not writer.drain(120):
                        raise RuntimeError("remote writes still running after 120 s")
                    reader.reset_tiers(120)  # the reader's own tiers hold nothing: only Redis has the prefix
                    hits = _remote_hits(reader)

                    def recompute() -> int:
                        t, tok = first_token(None, prompt)
                        base.append(t)
                        return tok

                    def from_remote() -> int:
                        t, tok = first_token(reader, prompt)
                        remote.append(t)
                        return tok

                    # The two back to back, in alternating order: load drift hits both alike.
                    if i % 2 == 0:
                        want = recompute()
                        got = from_remote()
                    else:
                        got = from_remote()
                        want = recompute()
                    if _remote_hits(reader) < hits + int(size * 0.9) // cfg.block_size:
                        raise RuntimeError("the measured request did not load its prefix from Redis")
                    if got != want:
                        raise RuntimeError(f"remote-loaded first token {got} != recomputed {want}")
                    if not reader.drain(120):
                        raise RuntimeError("reader tasks still running after 120 s")
                hits = _remote_hits(reader)
                cases.append(
                    Case(
                        "remote",
                        f"ttft-remote-90-{size // 1024}K",
                        statistics.median(remote) * 1e3,
                        statistics.median(base) * 1e3,
                        "ms",
                        "recompute (offload off)",
                        f"small preset, {size} tokens, 90% in Redis only, median of {runs}, torch threads "
                        f"{TTFT_THREADS} both sides; "
                        f"lower is better; {hits} remote blocks read so far",
                    )
                )
        finally:
            writer.shutdown()
            reader.shutdown()
    return cases


def run(args: argparse.Namespace) -> list[Case]:
    total = (32 << 20) if args.quick else (64 << 20)
    repeat = 3 if args.quick else 5
    cases: list[Case] = ttft_cases([2048] if args.quick else [2048, 8192], repeat)
    with RedisServer(maxmemory="2gb") as server:
        cases += link_cases("remote-", server.url, [server.port], False, total, repeat if args.quick else LINK_REPEAT)
    with RedisCluster(maxmemory="1gb") as cluster:
        cases += link_cases(
            "cluster-",
            cluster.url,
            [s.port for s in cluster.servers],
            True,
            total,
            CLUSTER_REPEAT,
            CLUSTER_BASELINE_BYTES_QUICK if args.quick else CLUSTER_BASELINE_BYTES,
        )
    return cases
