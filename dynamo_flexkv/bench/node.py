"""bench node: the node cache (core/node/, docs/NODE_CACHE.md) against embedded tiers, at the engine
contract, with the small preset's KV shape (4 layers, 2 KV heads x 64, float32: 256 KiB per
64-token block) on CPU tensors standing in for device memory.

* ``host-90-node-vs-embedded-{8K,32K}``: a layerwise load of a prompt's 90% prefix from host, from
  ``load()`` until every layer is on the device and ``finish()`` returned: through a real
  ``dynamo-flexkv cache-server`` process (the engine copies out of its shared segment) against an
  EmbeddedOffload of the same sizes in this process (goal: ratio <= 1.1);
* ``lookup-p50/p99-node-vs-embedded-8K``: ``cached_tokens()`` of an 8K prompt, the round trip to
  the service against the same call in process;
* ``attach-node``: register + attach (connect, map the segment), against an embedded register;
* ``datapath-*``: the data path the node cache chose, the engine copying each layer out of the
  shared segment itself (one request, then local copies and local layer waits), against the
  alternative, the service copying into the engine's KV memory (shared with it) and telling the
  engine each layer landed (bench/node_datapath.py): time to layer 0 and to every layer.

Ratios are node / embedded (or chosen / alternative): lower is better."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.offload import EngineOffload, open_offload
from dynamo_flexkv.core.procgroup import stop_process

BENCH = "node"
SPEC = ModelSpec(num_layers=4, num_kv_heads=2, head_size=64, dtype="float32")
BS = 64
SIZES = (8192, 32768)
FRACTION = 0.9


def _tensors(blocks: int) -> list[torch.Tensor]:
    layout = KVLayout(KVLayoutType.LAYERBLOCK, SPEC, BS, blocks)
    return [torch.randn(layout.layer_shape()) for _ in range(SPEC.num_layers)]


def _load_seconds(off: EngineOffload, tokens: list[int], blocks: list[int], repeat: int) -> float:
    """Median seconds of a layerwise load of ``tokens``' cached prefix into ``blocks``."""
    times = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        tid = off.load(tokens, blocks, 0)
        assert tid is not None, "the prefix is not cached"
        for layer in range(SPEC.num_layers):
            off.wait_layer(tid, layer, 60)
        result = off.finish(tid)
        assert result.ok, result
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _lookups(off: EngineOffload, tokens: list[int], n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        off.cached_tokens(tokens)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def _store(off: EngineOffload, tokens: list[int], blocks: list[int]) -> None:
    off.store(tokens, blocks, key="bench")
    while not off.finished_holds():
        time.sleep(0.001)
    assert off.drain(60)


def run(args) -> list[Case]:
    quick = bool(getattr(args, "quick", False))
    sizes = (8192,) if quick else SIZES
    repeat = getattr(args, "repeat", None) or (5 if quick else 15)
    host_gb = 1.1 * max(sizes) * FRACTION / BS * KVLayout(KVLayoutType.BLOCKFIRST, SPEC, BS, 1).block_bytes / (1 << 30)
    device_blocks = max(sizes) // BS + 2
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="flexkv-bench-node-") as work:
        sock = os.path.join(work, "node.sock")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamo_flexkv.cli",
                "cache-server",
                "--socket",
                sock,
                "--set",
                f"cpu_cache_gb={host_gb}",
                "--set",
                f"tokens_per_block={BS}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert server.stdout is not None  # PIPE
        try:
            for line in server.stdout:
                if "cache server ready on" in line:
                    break
            else:
                raise RuntimeError(f"the cache server did not start (exit {server.wait()})")
            t0 = time.perf_counter()
            node = open_offload(
                SPEC,
                CacheConfig(tokens_per_block=BS, mode="node", node_socket=sock),
                model_id="bench",
                engine="bench-node",
            )
            node.register(_tensors(device_blocks))
            attach_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            embedded = open_offload(SPEC, CacheConfig(tokens_per_block=BS, cpu_cache_gb=host_gb), model_id="bench")
            embedded.register(_tensors(device_blocks))
            register_s = time.perf_counter() - t0
            cases.append(
                Case(
                    BENCH,
                    "attach-node-vs-embedded",
                    attach_s,
                    register_s,
                    "s",
                    "embedded register",
                    "connect, attach, map the host segment",
                )
            )
            for n in sizes:
                tokens = [int(x) for x in torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(n))]
                prefix = tokens[: int(n * FRACTION) // BS * BS]
                blocks = list(range(len(prefix) // BS))
                for off in (node, embedded):
                    _store(off, prefix, blocks)
                label = f"{n // 1024}K"
                ns, es = (
                    _load_seconds(node, tokens[: len(prefix)], blocks, repeat),
                    _load_seconds(embedded, tokens[: len(prefix)], blocks, repeat),
                )
                cases.append(
                    Case(
                        BENCH,
                        f"host-90-node-vs-embedded-{label}",
                        ns,
                        es,
                        "s",
                        "embedded",
                        f"{len(blocks)} blocks, layerwise, median of {repeat}",
                    )
                )
                if n == sizes[0]:
                    (np50, np99), (ep50, ep99) = (
                        _lookups(node, tokens, 200 if quick else 1000),
                        _lookups(embedded, tokens, 200 if quick else 1000),
                    )
                    cases.append(Case(BENCH, f"lookup-p50-node-vs-embedded-{label}", np50, ep50, "s", "embedded"))
                    cases.append(Case(BENCH, f"lookup-p99-node-vs-embedded-{label}", np99, ep99, "s", "embedded"))
            node.shutdown()
            embedded.shutdown()
        finally:
            stop_process(server, 30)
    from dynamo_flexkv.bench.node_datapath import compare

    cases += compare(SPEC, BS, sizes[0], repeat)
    return cases
