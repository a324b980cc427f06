"""Helpers for tests of the node cache (not a test module): a service in this process, engines
(NodeOffload over CPU tensors standing in for device memory) whose KV bytes are a function of
the tokens they hold, so any loaded block can be checked against what it must be, and an engine
in a process of its own (node_engine.py) for kills."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions
from dynamo_flexkv.core.offload import EngineOffload, open_offload

SPEC = ModelSpec(num_layers=4, num_kv_heads=2, head_size=32, dtype="float32")
BS = 16
DEVICE_BLOCKS = 128
HERE = Path(__file__).parent


def server_config(tmp: Path, host_gb: float = 0.02, ssd_gb: float = 0.0) -> CacheConfig:
    return CacheConfig(
        tokens_per_block=BS, cpu_cache_gb=host_gb, ssd_cache_gb=ssd_gb, ssd_cache_dir=str(tmp / "ssd") if ssd_gb else ()
    )


@contextlib.contextmanager
def node_server(tmp: Path, host_gb: float = 0.02, ssd_gb: float = 0.0, **options) -> Iterator[NodeCacheServer]:
    with NodeCacheServer(server_config(tmp, host_gb, ssd_gb), ServerOptions(str(tmp / "node.sock"), **options)) as s:
        yield s


class Engine:
    """A NodeOffload over per-layer CPU tensors (LAYERBLOCK), like an engine's paged KV cache."""

    def __init__(
        self,
        socket_path: str,
        name: str,
        model_id: str = "m",
        tenant: str = "",
        listener=None,
        spec: ModelSpec = SPEC,
        mover_hook=None,
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        cfg = CacheConfig(tokens_per_block=BS, mode="node", node_socket=socket_path)
        self.offload: EngineOffload = open_offload(
            spec,
            cfg,
            model_id=model_id,
            engine=name,
            namespace=tenant,
            listener=listener,
            mover_hook=mover_hook,
            rank=rank,
            ranks=ranks,
        )
        layout = KVLayout(KVLayoutType.LAYERBLOCK, spec, BS, DEVICE_BLOCKS)
        self.layers = [torch.zeros(layout.layer_shape(), dtype=torch.float32) for _ in range(spec.num_layers)]
        self.offload.register(self.layers)
        if listener is not None:
            self.offload.announce_adopted()  # the listener can take the node's events now

    def fill(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Computes the KV of each full block of ``tokens`` into ``blocks``: bytes that only these
        tokens at this position give."""
        for i, b in enumerate(blocks[: len(tokens) // BS]):
            for layer, t in enumerate(self.layers):
                t[b] = expected_block(tokens, i, layer, t.shape[1:])

    def check(self, tokens: Sequence[int], blocks: Sequence[int], first: int, count: int) -> list[int]:
        """Blocks [first, first + count) of ``tokens`` in ``blocks`` whose bytes are wrong."""
        wrong = []
        for i in range(first, first + count):
            for layer, t in enumerate(self.layers):
                if not torch.equal(t[blocks[i]], expected_block(tokens, i, layer, t.shape[1:])):
                    wrong.append(i)
                    break
        return wrong

    def store(self, tokens: Sequence[int], blocks: Sequence[int], key: str = "r", timeout: float = 30) -> None:
        """Stores and waits until the hold comes back (the device copy landed)."""
        self.fill(tokens, blocks)
        self.offload.store(tokens, blocks, key=key)
        deadline = time.monotonic() + timeout
        while not any(h.key == key for h in self.offload.finished_holds()):
            assert time.monotonic() < deadline, "the store's hold never came back"
            time.sleep(0.005)

    def load(self, tokens: Sequence[int], blocks: Sequence[int], skip: int = 0) -> int | None:
        """Loads and waits; returns the blocks loaded (None: nothing was)."""
        for t in self.layers:
            t[list(blocks)] = 0
        tid = self.offload.load(tokens, blocks, skip)
        if tid is None:
            return None
        planned = self.offload.planned_tokens(tid) // BS
        for layer in range(SPEC.num_layers):
            assert self.offload.wait_layer(tid, layer, 30)
        result = self.offload.finish(tid)
        assert result.ok, result
        return planned


def expected_block(tokens: Sequence[int], i: int, layer: int, shape) -> torch.Tensor:
    seed = (hash(tuple(int(t) for t in tokens[: (i + 1) * BS])) ^ (layer * 0x9E3779B1)) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g)


def prompt(seed: int, n: int) -> list[int]:
    r = np.random.default_rng(seed)
    return [int(x) for x in r.integers(10, 50000, n)]


def engine_process(socket_path: str, *args: str) -> subprocess.Popen:
    """node_engine.py in a process of its own; it prints one line per step it reached."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(HERE / "node_engine.py"), socket_path, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_line(proc: subprocess.Popen, want: str, timeout: float = 60) -> str:
    """The engine process's next line starting with ``want`` (lines are short and flushed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no line {want!r} from the engine process within {timeout} s"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the engine process exited ({proc.wait()}): {proc.stderr.read()[-3000:]}")
        if line.startswith(want):
            return line.strip()


class Held:
    """IndexListener: the node cache's blocks per tier, as its events tell an attached engine."""

    def __init__(self) -> None:
        self.blocks = {"host": set(), "disk": set()}

    def on_stored(self, tier, run) -> None:
        self.blocks[tier.value].update(int(h) for h in run.hashes)

    def on_removed(self, tier, hashes) -> None:
        self.blocks[tier.value].difference_update(int(h) for h in hashes)

    def prefix(self, tiers, hashes) -> int:
        """Blocks of ``hashes``, from the first, that one of ``tiers`` holds."""
        n = 0
        while n < len(hashes) and any(int(hashes[n]) in self.blocks[t] for t in tiers):
            n += 1
        return n


class CacheServerProcess:
    """``dynamo-flexkv cache-server`` started as an operator starts it (a process of its own, before
    and apart from any graph), on a private socket under ``tmp``, its metrics on a free port; its
    log in ``tmp/cache-server.log`` (a file: no pipe that nobody reads)."""

    def __init__(self, tmp: Path, *sets: str, timeout: float = 60) -> None:
        from dynamo_flexkv.core.sysutil import free_port

        self.socket = str(tmp / "ops" / "node.sock")  # ops/ is made 0700 by the server
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.log = tmp / "cache-server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXKV_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", self.socket,
             "--metrics-port", self.metrics_url.rsplit(":", 1)[1].split("/")[0],
             *[a for s in sets for a in ("--set", s)]],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while "cache server ready on" not in self.log.read_text():
            assert self.proc.poll() is None, f"the cache server exited ({self.proc.returncode}): {self.log.read_text()}"
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        from served import scrape, total

        return total(scrape(self.metrics_url), name, **labels)

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as an operator stops it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
