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
import logging
import os
import shutil
import socket
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.inventory import (
    NO_TOKENIZER,
    BadCacheRequest,
    CacheReport,
    CacheRequest,
    answer,
    describe_selection,
)
from dynamo_flexkv.core.node.engines import Fence
from dynamo_flexkv.core.node.namespace import Namespace, ServerOptions
from dynamo_flexkv.core.node.protocol import Attach, attach_key, describe_key, shard
from dynamo_flexkv.core.node.quota import Quota
from dynamo_flexkv.core.node.session import Session
from dynamo_flexkv.core.sysutil import listening, private_dir

log = logging.getLogger(__name__)


class NodeCacheServer:
    """``with NodeCacheServer(config, ServerOptions(path)) as server: server.serve_forever()``."""

    def __init__(self, config: CacheConfig, options: ServerOptions) -> None:
        self.config, self.options = config, options
        if options.quotas is not None:
            options.quotas.check(config)  # each quota, and the named ones together, fit the node's budget
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._namespaces: dict[tuple[Any, ...], Namespace] = {}
        self._sessions: dict[int, Session] = {}
        self._next_session = 1
        self._closed = threading.Event()
        self.fence = Fence()
        self.counters: dict[str, int] = {
            "attached": 0,
            "detached": 0,
            "refused": 0,
            "protocol_errors": 0,
            "requests": 0,
            "request_errors": 0,
        }
        sock_dir = os.path.dirname(os.path.abspath(options.socket_path))
        self._made_dirs = _missing_dirs(sock_dir)
        try:
            self._listener = self._listen(options.socket_path)
            if not self._made_dirs:  # the directories a server that did not stop made: this one's now
                self._made_dirs = _adopt_made_dirs(sock_dir)
            if self._made_dirs:  # so that a next server can clean them up if this one is SIGKILLed
                _write_made_marker(self._made_dirs)
        except BaseException:  # refused (another server there, an unsafe directory): leave nothing made
            self._remove_made_dirs()
            raise
        self._accept_thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    @staticmethod
    def _listen(path: str) -> socket.socket:
        """Owner-only (engines of this user): the socket 0600 in a directory only this user may write
        to, made 0700 when missing (sysutil.private_dir: another user's or a world-writable one,
        such as /tmp itself, is refused: a socket of theirs could take the path)."""
        private_dir(os.path.dirname(os.path.abspath(path)), "node_socket's directory")
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):  # never remove a file that is not a socket
                raise ConfigError(
                    f"node_socket {path}: a {'directory' if os.path.isdir(path) else 'file'} that is not a "
                    "socket is there: give the cache server a path of its own (e.g. DIR/node.sock)"
                )
            if listening(path):
                raise ConfigError(
                    f"node_socket {path}: another cache server is listening there: stop it first, "
                    "or give this one another node_socket"
                )
            os.unlink(path)  # a dead server's socket file
            log.warning(
                "node_socket %s: removed the socket a cache server that did not stop left (nothing listened on it)",
                path,
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        return sock

    def _remove_made_dirs(self) -> None:
        """The directories made for the socket (innermost first), while empty."""
        if self._made_dirs:
            try:
                os.unlink(os.path.join(self._made_dirs[0], MADE_DIRS_MARKER))
            except OSError:
                pass
        for d in self._made_dirs:
            try:
                os.rmdir(d)
            except OSError:
                break

    def start(self) -> NodeCacheServer:
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
            try:  # wakes the accept thread: closing a listening socket alone does not on Linux
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
                self._accept_thread.join(5)
        finally:
            try:
                os.unlink(self.options.socket_path)
            except OSError:
                pass
            self._remove_made_dirs()
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close("the cache server is shutting down", fence=False)
        for s in sessions:
            s.join(5)
        for ns in list(self._namespaces.values()):
            ns.kv.shutdown()
        self.fence.close()

    def __enter__(self) -> NodeCacheServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- sessions ----------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
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
            with self._lock:  # started under the lock: close() joins every session it finds
                if self._closed.is_set():
                    session.refuse("the cache server is shutting down")
                    return
                self._sessions[sid] = session
                session.start()

    def session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
            if session.attach is not None:  # an engine; not a connection that never attached (a probe)
                self.counters["detached"] += 1

    def namespace_for(self, attach: Attach, session: Session) -> Namespace:
        """The namespace of this engine's attach key, made on first use (max_models of them)."""
        key = attach_key(attach)
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                # A model's shards of one split count once (they divide its budget); another split
                # of the same model (TP=4 beside TP=2, or unsharded) is budgeted as another model.
                models = {_split(k) for k in self._namespaces}
                if _split(key) not in models and len(models) >= self.options.max_models:
                    self._retire_idle(_split(key))  # e.g. the weights before an RL update, detached
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
                if self.options.quotas is not None:  # a quota covers one model of a tenant: its idle
                    self._retire_idle(_split(key), tenant=attach.tenant)  # other models (old weights) give way
                quota = self._quota_for(key, attach)
                ns = Namespace(
                    key,
                    self.config,
                    self.config.ssd_cache_dir,
                    len(self._namespaces),
                    ranks=attach.ranks if shard(attach) else 1,
                    quota=quota,
                )
                self._namespaces[key] = ns
            ns.sessions[session.id] = session
            return ns

    def _retire_idle(self, needed: Any, tenant: str | None = None) -> None:  # self._lock held
        """Makes room for another model: the namespaces of one idle model (no engine attached: an
        engine that changed its weights left them, or every engine of it went away) are shut down
        and their disk files removed, oldest first; with ``tenant``, every idle model of that
        tenant. A namespace an engine uses is never touched."""
        idle: dict[Any, list[Namespace]] = {}
        for k, ns in self._namespaces.items():
            idle.setdefault(_split(k), []).append(ns)
        for split, spaces in sorted(idle.items(), key=lambda kv: min(ns.created for ns in kv[1])):
            if split == needed or any(ns.sessions for ns in spaces):
                continue
            if tenant is not None and describe_key(spaces[0].key)["tenant"] != tenant:
                continue
            for ns in spaces:
                self._namespaces.pop(ns.key, None)
                ns.kv.shutdown()
                for d in ns.kv.config.ssd_cache_dir:
                    shutil.rmtree(d, ignore_errors=True)
                log.info("node cache: retired idle namespace %s to make room", describe_key(ns.key))
            if tenant is None:
                return

    def _quota_for(self, key: tuple[Any, ...], attach: Attach) -> Quota | None:
        """The quota a new namespace's tiers are sized to (None: quotas off). Each tenant's quota
        is reserved for it: its model's namespaces (one per shard) split it, another model of the
        tenant is refused while one holds it, and a tenant on the default quota is refused when
        the budget left after every reserved quota cannot hold it. Called under the lock."""
        quotas = self.options.quotas
        if quotas is None:
            return None
        tenant = attach.tenant
        quota = quotas.quota_for(tenant)
        mine = [k for k in self._namespaces if describe_key(k)["tenant"] == tenant]
        holder = next((k for k in mine if _split(k) != _split(key)), None)
        if holder is not None:
            held = describe_key(holder)
            raise ConfigError(
                f"tenant {tenant!r}'s quota ({quota} GB host:disk:remote) is held by its model "
                f"{held['model_id']!r} ({held['shard'] or 'one rank'}): a quota covers one model of a "
                f"tenant; give the engines of model_id={attach.model_id!r} a tenant of their own "
                "(with --tenant-quota) or run another cache server for them"
            )
        if not mine and tenant not in quotas.tenants:
            others = {describe_key(k)["tenant"] for k in self._namespaces} - set(quotas.tenants)
            reserved = quotas.reserved(others | {tenant})
            for tier, key_name, budget in (
                ("host", "cpu_cache_gb", self.config.cpu_cache_gb),
                ("disk", "ssd_cache_gb", self.config.ssd_cache_gb),
            ):
                if reserved[tier] > budget + 1e-9:
                    taken = reserved[tier] - (quota.host_gb if tier == "host" else quota.disk_gb)
                    raise ConfigError(
                        f"tenant {tenant!r} would get --default-quota {quota}, but the node's {tier} "
                        f"budget {key_name}={budget:g} holds {taken:g} "
                        f"GB of reserved quotas already ({len(quotas.tenants)} named, {len(others)} on the "
                        f"default): raise {key_name}, lower --default-quota, or run another cache server for it"
                    )
        return quota

    def leave(self, ns: Namespace, session: Session) -> None:
        with self._lock:
            ns.sessions.pop(session.id, None)

    # ---- reporting -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            sessions = list(self._sessions.values())
            namespaces = list(self._namespaces.values())
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            **self.counters,
            "engines": [s.describe() for s in sessions if not s.admin],  # an operator's tool is no engine
            "namespaces": [dict(ns.describe(), tiers=dataclasses.asdict(ns.kv.stats())) for ns in namespaces],
            "fenced_waiting": self.fence.waiting,
            "tenants": self._tenants(namespaces),
        }

    def _tenants(self, namespaces: list[Namespace]) -> dict[str, dict[str, dict[str, int]]]:
        """Per tenant: the bytes its blocks take per tier (``used``) and its quota (``quota``, with
        quotas on; the remote's as Redis accounts it, shared with the tenant's engines elsewhere)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        quotas = self.options.quotas
        for ns in namespaces:
            t = out.setdefault(ns.tenant, {"used": {"host": 0, "disk": 0}, "quota": {}})
            stats = ns.kv.stats()
            block = ns.kv.host.layout.block_bytes
            t["used"]["host"] += stats.host.used_blocks * block
            t["used"]["disk"] += stats.disk.used_blocks * block if stats.disk else 0
            if ns.kv.remote is not None:
                used = ns.kv.remote.quota_usage()
                if used is not None:
                    t["used"]["remote"] = used
        if quotas is not None:
            for tenant, t in out.items():
                t["quota"] = {k: v for k, v in quotas.quota_for(tenant).bytes().items() if k != "remote" or v}
        return out

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    # ---- what is cached (dynamo-flexkv cache; core/inventory.py) ----------------------------------------
    def tiers(self) -> list[str]:
        """The tiers this service's namespaces have (each namespace is sized from the same config)."""
        return (
            ["host"]
            + (["disk"] if self.config.ssd_cache_gb > 0 else [])
            + (["remote"] if self.config.enable_remote else [])
        )

    def admin(self, req: CacheRequest, only: Namespace | None = None) -> CacheReport:
        """Answers an operator's request over the namespaces it selects (``tenant``, ``model``; all by
        default), or over ``only`` (an attached engine's own namespace)."""
        if req.op == "prefix" and req.tokens is None and req.text is not None:
            raise BadCacheRequest(NO_TOKENIZER)
        req.check(self.tiers())
        spaces = [only] if only is not None else self._select(req.tenant, req.model)
        report = CacheReport(f"cache server pid {os.getpid()}", req.op)
        for ns in spaces:
            d = describe_key(ns.key)
            answer(ns.kv, req, report, tenant=ns.tenant, shard=d["shard"], engines=len(ns.sessions))
            if req.op == "clear" and report.cleared:
                log.info(
                    "node cache: cleared model %s%s%s: %s",
                    d["model_id"],
                    f" tenant {ns.tenant}" if ns.tenant else "",
                    f" shard {d['shard']}" if d["shard"] else "",
                    ", ".join(
                        f"{t.tier} {t.cleared} blocks (kept {t.kept or 'none'})" for t in report.cleared[-1].tiers
                    ),
                )
        return report

    def _select(self, tenant: str | None, model: str | None) -> list[Namespace]:
        spaces = self.namespaces()
        chosen = [
            ns
            for ns in spaces
            if (tenant is None or ns.tenant == tenant) and (model is None or describe_key(ns.key)["model_id"] == model)
        ]
        if not chosen and (tenant is not None or model is not None):
            have = sorted({(describe_key(ns.key)["model_id"], ns.tenant) for ns in spaces})
            held = "; ".join(f"model {m!r} tenant {t!r}" for m, t in have) or "nothing: no engine attached yet"
            raise BadCacheRequest(
                f"this cache server holds no namespace of {describe_selection(tenant, model)}; it holds {held}"
            )
        return chosen


def _split(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """An attach key without the rank: the model and how many shards its engines split it into."""
    shard_of = key[-1]
    return (*key[:-1], shard_of.split("/")[1] if shard_of else "1")


# In the socket's directory when the server made it: the directories it made, innermost first, one
# a line. A server killed before it removed them leaves this file; the next one on that directory
# takes them over and removes them when it stops (only these, only while empty).
MADE_DIRS_MARKER = ".flexkv-made-dirs"


def _write_made_marker(made: list[str]) -> None:
    path = os.path.join(made[0], MADE_DIRS_MARKER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(d + "\n" for d in made))


def _adopt_made_dirs(sock_dir: str) -> list[str]:
    """The directories the marker in ``sock_dir`` names that are ``sock_dir`` or above it (nothing
    else is ever taken over), innermost first; [] without a marker."""
    try:
        with open(os.path.join(sock_dir, MADE_DIRS_MARKER), encoding="utf-8") as f:
            named = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []
    made = [d for d in named if d == sock_dir or sock_dir.startswith(d.rstrip(os.sep) + os.sep)]
    if sock_dir not in made:
        return []
    made.sort(key=len, reverse=True)
    log.warning(
        "node_socket's directory %s: made by a cache server that did not stop; this one removes it "
        "(and %d directories above it it made) when it stops",
        sock_dir,
        len(made) - 1,
    )
    return made


def _missing_dirs(path: str) -> list[str]:
    """The directories of ``path`` that do not exist yet, innermost first: what _listen makes."""
    out = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out


def default_socket_path() -> str:
    """Where engines and the service meet when node_socket is not set: under the user's runtime
    directory, else the temp dir (per user)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join("/tmp", f"dynamo-flexkv-{os.getuid()}")
    return str(Path(base) / "flexkv-node.sock")
