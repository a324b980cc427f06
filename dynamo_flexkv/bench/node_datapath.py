"""The node cache's data path, measured against the alternative (bench node's ``datapath-*`` cases).

Both sides share memory through memfds passed over a Unix socket, as the node cache does: a
"service" process (this module's ``__main__``) owns a host pool of blocks; the engine (the bench
process) owns its KV tensors. A host hit of a prompt's blocks is then loaded two ways, each layer
copied with the same native gather (HostDeviceMover):

* **engine-driven** (what the node cache does): one request, the service answers with the host
  slots, the engine copies each layer out of the mapped host segment; its layer waits are local;
* **service-driven** (LMCache's lmcache_driven mode): one request, the service copies each layer
  into the engine's KV memory, which it maps too, and tells the engine each layer landed.

Measured per load: from the request to layer 0 on the device, and to every layer."""

from __future__ import annotations

import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np
import torch

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.storage.device import TORCH_DTYPES, DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.core.transfer.movers import HostDeviceMover

_LEN = struct.Struct("<I")


def _send(sock: socket.socket, obj, fds=()) -> None:
    body = msgspec.msgpack.encode(obj)
    frame = _LEN.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def _recv(sock: socket.socket, want_fds: int = 0):
    fds: list[int] = []
    if want_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, want_fds)
    else:
        head = b""
    while len(head) < _LEN.size:
        head += sock.recv(_LEN.size - len(head))
    (n,) = _LEN.unpack(head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return msgspec.msgpack.decode(body), fds


def _shared_tensors(spec: ModelSpec, bs: int, blocks: int, fd: int = -1) -> tuple[list[torch.Tensor], int, mmap.mmap]:
    """Per-layer LAYERBLOCK tensors over one memfd (made here when ``fd`` is -1)."""
    layout = KVLayout(KVLayoutType.LAYERBLOCK, spec, bs, blocks)
    per_layer = int(np.prod(layout.layer_shape())) * layout.model.dtype_bytes
    size = per_layer * spec.num_layers
    if fd < 0:
        fd = os.memfd_create("flexkv-bench-engine-kv", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    flat = torch.frombuffer(mm, dtype=TORCH_DTYPES[spec.dtype])
    n = per_layer // layout.model.dtype_bytes
    return [flat[i * n : (i + 1) * n].view(layout.layer_shape()) for i in range(spec.num_layers)], fd, mm


def compare(spec: ModelSpec, bs: int, tokens: int, repeat: int) -> list[Case]:
    blocks = tokens // bs
    host_blocks, dev_blocks = blocks + 2, blocks + 2
    with tempfile.TemporaryDirectory(prefix="flexkv-bench-datapath-") as work:
        path = os.path.join(work, "s.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamo_flexkv.bench.node_datapath",
                path,
                msgspec.json.encode(
                    [spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype, bs, host_blocks, dev_blocks]
                ).decode(),
            ]
        )
        try:
            sock, _ = listener.accept()
            (_, fds) = _recv(sock, 1)  # the service's host segment
            host = HostPool(KVLayout(KVLayoutType.BLOCKFIRST, spec, bs, host_blocks), shared_fd=fds[0])
            os.close(fds[0])
            layers, kv_fd, mm = _shared_tensors(spec, bs, dev_blocks)
            _send(sock, "kv", fds=[kv_fd])  # the engine's KV memory, for the service-driven path
            device = DeviceCache.register(layers, spec, KVLayoutType.LAYERBLOCK, bs)
            mover = HostDeviceMover(host, device)
            ids = list(range(blocks))

            def engine_driven() -> tuple[float, float]:
                t0 = time.perf_counter()
                _send(sock, ["plan", blocks])
                (_, src), _ = _recv(sock)
                first = 0.0
                for layer in range(spec.num_layers):
                    mover.run(TransferOp(OpKind.H2D, np.asarray(src), np.asarray(ids), layers=(layer, layer + 1)))
                    if layer == 0:
                        first = time.perf_counter() - t0
                return first, time.perf_counter() - t0

            def service_driven() -> tuple[float, float]:
                t0 = time.perf_counter()
                _send(sock, ["load", blocks])
                first = 0.0
                for layer in range(spec.num_layers):
                    (_, got), _ = _recv(sock)
                    assert got == layer
                    if layer == 0:
                        first = time.perf_counter() - t0
                return first, time.perf_counter() - t0

            rows: dict[str, list[tuple[float, float]]] = {"engine": [], "service": []}
            for i in range(repeat + 1):
                for name, fn in (("engine", engine_driven), ("service", service_driven)):  # alternated
                    got = fn()
                    if i:
                        rows[name].append(got)
            _send(sock, ["quit", 0])
            sock.close()
            host.close()
        finally:
            proc.wait(30)
            listener.close()
    label = f"{tokens // 1024}K"
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    return [
        Case(
            "node",
            f"datapath-layer0-engine-vs-service-driven-{label}",
            med["engine"][0],
            med["service"][0],
            "s",
            "service-driven (the service copies, notifies per layer)",
            f"{blocks} blocks",
        ),
        Case(
            "node",
            f"datapath-all-layers-engine-vs-service-driven-{label}",
            med["engine"][1],
            med["service"][1],
            "s",
            "service-driven (the service copies, notifies per layer)",
            f"{blocks} blocks",
        ),
    ]


def _service(path: str, shape: str) -> None:
    layers, heads, head_size, dtype, bs, host_blocks, dev_blocks = msgspec.json.decode(shape)
    spec = ModelSpec(num_layers=layers, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    host = HostPool(KVLayout(KVLayoutType.BLOCKFIRST, spec, bs, host_blocks), share=True)
    host.array[:] = np.random.default_rng(0).integers(0, 255, host.nbytes, dtype=np.uint8)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _send(sock, "host", fds=[host.fd])
    _, fds = _recv(sock, 1)
    tensors, _, mm = _shared_tensors(spec, bs, dev_blocks, fds[0])
    mover = HostDeviceMover(host, DeviceCache.register(tensors, spec, KVLayoutType.LAYERBLOCK, bs))
    while True:
        (kind, blocks), _ = _recv(sock)
        if kind == "quit":
            return
        src = list(range(blocks))
        if kind == "plan":  # engine-driven: the slots, the engine copies
            _send(sock, ["slots", src])
            continue
        for layer in range(layers):  # service-driven: copy, then say so
            mover.run(TransferOp(OpKind.H2D, np.asarray(src), np.asarray(src), layers=(layer, layer + 1)))
            _send(sock, ["layer", layer])


if __name__ == "__main__":
    _service(sys.argv[1], sys.argv[2])
