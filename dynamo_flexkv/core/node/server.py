"""The node cache service: one process per node owns the host tier (a shared-memory segment every
attached engine maps), the disk and remote tiers, the index, eviction and the metrics; every engine
and rank on the node attaches over a local socket (docs/NODE_CACHE.md).

Each group of engines whose KV bytes are interchangeable (same weights, KV shape, dtype, block
size, tenant and tensor-parallel split: protocol.attach_key) is a namespace: one KVManager over
tiers of its own, shared by those engines. An engine reaches only its own namespace: the service
hashes the token ids it is sent with that namespace's salt, so another tenant's blocks cannot
even be named. Each connection is a session (session.py) with a thread of its own."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.layout import ModelSpec
from dynamo_flexkv.core.manager import KVManager
from dynamo_flexkv.core.node.engines import Fence
from dynamo_flexkv.core.node.mirror import EventMirror
from dynamo_flexkv.core.node.protocol import Attach, attach_key, describe_key, shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    socket_path: str
    max_clients: int = 64  # attached engines (ranks count one each); more are refused, the others served
    max_models: int = 1  # namespaces: each holds its own tiers of the configured sizes
    max_queued_mb: int = 256  # per engine: events and copies queued for an engine that does not read

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ConfigError("the node cache needs a socket path (node_socket)")
        if len(os.fsencode(self.socket_path)) > 107:
            raise ConfigError(
                f"node_socket {self.socket_path!r} is longer than a Unix socket path may be (107 "
                "bytes): choose a shorter one"
            )
        for name in ("max_clients", "max_models", "max_queued_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")


class Namespace:
    """The tiers shared by the engines of one attach_key."""

    def __init__(
        self, key: Tuple[Any, ...], config: CacheConfig, ssd_root: Tuple[str, ...], index: int, ranks: int = 1
    ) -> None:
        self.key = key
        d = describe_key(key)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        self.salt = f"{d['tenant']}" if d["tenant"] else ""
        # A tensor-parallel model's shards split its tiers: one model's memory and disk in all.
        cfg = config.replace(
            tokens_per_block=d["tokens_per_block"],
            cpu_cache_gb=config.cpu_cache_gb / ranks,
            ssd_cache_gb=config.ssd_cache_gb / ranks,
            ssd_cache_dir=tuple(os.path.join(r, f"ns-{digest}") for r in ssd_root),
        )
        model = ModelSpec(
            num_layers=d["num_layers"],
            num_kv_heads=d["num_kv_heads"],
            head_size=d["head_size"],
            dtype=d["dtype"],
            kv_dim=d["kv_dim"],
        )
        self.mirror = EventMirror(d["tokens_per_block"])
        self.kv = KVManager(
            model, cfg, namespace=self.salt or None, listener=self.mirror, model_id=d["model_id"], share_host=True
        )
        self.index = index
        self.sessions: Dict[int, Any] = {}
        self.created = time.monotonic()

    def describe(self) -> Dict[str, Any]:
        return {**describe_key(self.key), "engines": len(self.sessions), "blocks": self.mirror.blocks}


class NodeCacheServer:
    """``with NodeCacheServer(config, ServerOptions(path)) as server: server.serve_forever()``."""

    def __init__(self, config: CacheConfig, options: ServerOptions) -> None:
        self.config, self.options = config, options
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._namespaces: Dict[Tuple[Any, ...], Namespace] = {}
        self._sessions: Dict[int, Any] = {}
        self._next_session = 1
        self._closed = threading.Event()
        self.fence = Fence()
        self.counters: Dict[str, int] = {
            "attached": 0,
            "detached": 0,
            "refused": 0,
            "protocol_errors": 0,
            "requests": 0,
            "request_errors": 0,
        }
        self._listener = self._listen(options.socket_path)
        self._accept_thread: Optional[threading.Thread] = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    @staticmethod
    def _listen(path: str) -> socket.socket:
        """Owner-only: the directory 0700 when we make it, the socket 0600 (engines of this user)."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                raise ConfigError(
                    f"node_socket {path}: another cache server is listening there: stop it first, "
                    "or give this one another node_socket"
                )
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # a dead server's socket file
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        return sock

    def start(self) -> "NodeCacheServer":
        self._accept_thread = threading.Thread(target=self._accept_loop, name="flexkv-node-accept", daemon=True)
        self._accept_thread.start()
        log.info(
            "node cache: listening on %s (%d engines at most, %d model(s))",
            self.options.socket_path,
            self.options.max_clients,
            self.options.max_models,
        )
        return self

    def serve_forever(self) -> None:
        if self._accept_thread is None:
            self.start()
        self._closed.wait()

    def close(self) -> None:
        """Detaches every engine (their loads fail: they recompute), then shuts the tiers down (the
        disk tier's journal stays: the next service re-adopts it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.close()
        finally:
            try:
                os.unlink(self.options.socket_path)
            except OSError:
                pass
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close("the cache server is shutting down", fence=False)
        for s in sessions:
            s.join(5)
        for ns in list(self._namespaces.values()):
            ns.kv.shutdown()
        self.fence.close()

    def __enter__(self) -> "NodeCacheServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- sessions ----------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        from dynamo_flexkv.core.node.session import Session

        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                sid = self._next_session
                self._next_session += 1
                full = len(self._sessions) >= self.options.max_clients
            session = Session(self, sid, conn)
            if full:
                self.counters["refused"] += 1
                session.refuse(
                    f"the cache server has {self.options.max_clients} engines attached (max_clients): "
                    "detach one, or start it with a higher --max-clients"
                )
                continue
            with self._lock:
                self._sessions[sid] = session
            session.start()

    def session_ended(self, session: Any) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
            self.counters["detached"] += 1

    def namespace_for(self, attach: Attach, session: Any) -> Namespace:
        """The namespace of this engine's attach key, made on first use (max_models of them)."""
        key = attach_key(attach)
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                # A model's shards of one split count once (they divide its budget); another split
                # of the same model (TP=4 beside TP=2, or unsharded) is budgeted as another model.
                models = {_split(k) for k in self._namespaces}
                if _split(key) not in models and len(models) >= self.options.max_models:
                    have = [describe_key(k) for k in self._namespaces]
                    raise ConfigError(
                        f"this cache server holds {len(have)} model(s) already ({have}) and "
                        f"max_models={self.options.max_models}: an engine of model_id="
                        f"{attach.model_id!r} (tenant {attach.tenant!r}, {attach.ranks} rank(s)) "
                        "needs tiers of its own: start the server with a higher --max-models (each "
                        "takes cpu_cache_gb and ssd_cache_gb) or run another server for it"
                    )
                ns = Namespace(
                    key,
                    self.config,
                    self.config.ssd_cache_dir,
                    len(self._namespaces),
                    ranks=attach.ranks if shard(attach) else 1,
                )
                self._namespaces[key] = ns
            ns.sessions[session.id] = session
            return ns

    def leave(self, ns: Namespace, session: Any) -> None:
        with self._lock:
            ns.sessions.pop(session.id, None)

    # ---- reporting -----------------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        with self._lock:
            sessions = list(self._sessions.values())
            namespaces = list(self._namespaces.values())
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            **self.counters,
            "engines": [s.describe() for s in sessions],
            "namespaces": [dict(ns.describe(), tiers=dataclasses.asdict(ns.kv.stats())) for ns in namespaces],
            "fenced_waiting": self.fence.waiting,
        }

    def namespaces(self) -> List[Namespace]:
        with self._lock:
            return list(self._namespaces.values())


def _split(key: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """An attach key without the rank: the model and how many shards its engines split it into."""
    shard_of = key[-1]
    return (*key[:-1], shard_of.split("/")[1] if shard_of else "1")


def default_socket_path() -> str:
    """Where engines and the service meet when node_socket is not set: under the user's runtime
    directory, else the temp dir (per user)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join("/tmp", f"dynamo-flexkv-{os.getuid()}")
    return str(Path(base) / "flexkv-node.sock")
