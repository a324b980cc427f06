"""Connections to the nodes of one Redis deployment (a server, or a Redis Cluster's masters):
login and database selection with errors that name the fix, a pool of idle connections per node,
the cluster's slot map, ops fanned out to their nodes in parallel, and pipelined commands with a
bounded window. What the bytes mean is the store's business (store.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynamo_flexkv.core.remote.cluster import Node, SlotMap
from dynamo_flexkv.core.remote.config import RemoteConfig
from dynamo_flexkv.core.remote.errors import RemoteAuthError, RemoteError, RemoteUnavailableError
from dynamo_flexkv.core.remote.resp import RespConnection, ServerError

log = logging.getLogger("dynamo_flexkv.core.remote.store")


class _Pool:
    """Idle connections to one node."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.idle: list[RespConnection] = []
        self.lock = threading.Lock()


class NodeConnections:
    """Pooled connections to ``config``'s nodes (thread-safe). ``on_connect`` is called for each new
    connection (the store counts them)."""

    def __init__(self, config: RemoteConfig, on_connect: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self._ssl = config.ssl_context()
        self._on_connect = on_connect
        self._pools: dict[Node, _Pool] = {}
        self._pools_lock = threading.Lock()
        self.slots: SlotMap | None = None
        self.slots_stale = False  # set after a failed op on a cluster: the next op refetches the map
        self._executor: ThreadPoolExecutor | None = None
        self.closed = False
        self.policy_warning: str | None = None  # "noeviction" when the server would refuse writes when full

    def connect(self, node: Node) -> RespConnection:
        cfg = self.config
        where = f"{node[0]}:{node[1]} ({cfg.redacted_url})"
        try:
            conn = RespConnection(
                node[0],
                node[1],
                timeout_s=cfg.timeout_s,
                connect_timeout_s=cfg.connect_timeout_s,
                ssl_context=self._ssl,
            )
        except OSError as e:
            raise RemoteUnavailableError(
                f"cannot connect to redis at {where}: {e.strerror or e}; start Redis there, fix "
                f"remote_cache_url, or set enable_remote: false"
            ) from None
        self._on_connect()
        try:
            password = cfg.password
            if password is not None:
                user = cfg.parsed.username
                conn.call(b"AUTH", *([user] if user else []), password)
            if cfg.parsed.db:
                self.select(conn, where)
        except ServerError as e:
            conn.close()
            if "without any password configured" in str(e):
                raise RemoteAuthError(
                    f"redis at {where} has no password but one was given: remove it from "
                    f"remote_cache_url and unset ${cfg.password_env}"
                ) from None
            msg = str(e).split(" ", 1)[0]
            raise RemoteAuthError(
                f"redis at {where} refused the credentials ({msg}): set the right password in "
                f"remote_cache_url or in ${cfg.password_env}"
            ) from None
        except OSError as e:
            conn.close()
            raise RemoteUnavailableError(f"redis at {where} dropped the connection during login: {e}") from None
        return conn

    def select(self, conn: RespConnection, where: str) -> None:
        """SELECTs the URL's database; a refusal names the database and what the server has (a
        ServerError from it would read as a login failure)."""
        db = self.config.parsed.db
        try:
            conn.call(b"SELECT", db)
        except ServerError as e:
            if "NOAUTH" in str(e):
                raise
            try:
                reply = conn.call(b"CONFIG", b"GET", b"databases")
                count = int(reply[1]) if isinstance(reply, list) and len(reply) == 2 else None
            except (ServerError, ValueError):
                count = None  # CONFIG is disabled on many managed servers
            conn.close()
            has = f"has databases 0..{count - 1}" if count else "does not have it"
            raise RemoteError(
                f"redis at {where} refused database {db} ({str(e).strip()}): the server {has}; "
                f"name one of them after the port in remote_cache_url (e.g. /0), or raise 'databases' "
                f"in its redis.conf"
            ) from None

    def pool(self, node: Node) -> _Pool:
        with self._pools_lock:
            pool = self._pools.get(node)
            if pool is None:
                pool = self._pools[node] = _Pool(node)
            return pool

    def acquire(self, pool: _Pool) -> tuple[RespConnection, bool]:
        """A connection and whether it was pooled (it may have died while idle)."""
        with pool.lock:
            if pool.idle:
                return pool.idle.pop(), True
        return self.connect(pool.node), False

    @staticmethod
    def drop_idle(pool: _Pool) -> None:
        """After a failure the node's other idle connections are most likely dead too."""
        with pool.lock:
            idle, pool.idle = pool.idle, []
        for conn in idle:
            conn.close()

    def release(self, pool: _Pool, conn: RespConnection) -> None:
        if self.closed:
            conn.close()
            return
        with pool.lock:
            pool.idle.append(conn)

    def check_server(self) -> None:
        """Connects once: login errors and an unreachable server surface here, with their fix."""
        cfg = self.config
        last: RemoteUnavailableError | None = None
        for node in cfg.nodes:
            try:
                conn = self.connect(node)
            except RemoteUnavailableError as e:
                last = e
                continue
            try:
                self.check_policy(conn)
                if cfg.parsed.cluster:
                    self.slots = _slot_map(conn, node)
                elif self.cluster_enabled(conn):
                    raise RemoteError(
                        f"redis at {node[0]}:{node[1]} is a Redis Cluster node: write "
                        f"remote_cache_url as redis+cluster://{node[0]}:{node[1]}"
                    )
            except ServerError as e:
                conn.close()
                if "NOAUTH" in str(e):
                    raise RemoteAuthError(
                        f"redis at {cfg.redacted_url} needs a password: put it in "
                        f"remote_cache_url or in ${cfg.password_env}"
                    ) from None
                raise RemoteError(f"redis at {cfg.redacted_url} answered an error at startup: {e}") from None
            except OSError as e:
                conn.close()
                last = RemoteUnavailableError(f"redis at {cfg.redacted_url} dropped the connection: {e}")
                continue
            self.release(self.pool(node), conn)
            return
        assert last is not None
        raise last

    def check_policy(self, conn: RespConnection) -> None:
        try:
            reply = conn.call(b"CONFIG", b"GET", b"maxmemory-policy")
        except ServerError as e:
            if "NOAUTH" in str(e):
                raise
            return  # CONFIG is disabled on many managed servers: nothing to check
        policy = reply[1].decode() if isinstance(reply, list) and len(reply) == 2 else ""
        if policy == "noeviction":
            log.warning(
                "redis at %s has maxmemory-policy noeviction: when it fills up, every new block "
                "is refused; set maxmemory-policy allkeys-lru (and a maxmemory) so old blocks "
                "make room",
                self.config.redacted_url,
            )
            self.policy_warning = policy

    @staticmethod
    def cluster_enabled(conn: RespConnection) -> bool:
        try:
            conn.call(b"CLUSTER", b"MYID")
        except ServerError:
            return False  # "cluster support disabled"
        return True

    def refresh_slots(self) -> None:
        nodes = list(dict.fromkeys([*(self.slots.nodes if self.slots else []), *self.config.nodes]))
        for node in nodes:
            pool = self.pool(node)
            try:
                conn, _ = self.acquire(pool)
            except RemoteError:
                continue
            try:
                self.slots = _slot_map(conn, node)
            except (OSError, ServerError, ValueError):
                conn.close()
                continue
            self.release(pool, conn)
            self.slots_stale = False
            return
        raise RemoteUnavailableError(f"no node of {self.config.redacted_url} answered CLUSTER SLOTS")

    def route(self, keys: list[bytes]) -> dict[Node, list[int]]:
        """Positions of ``keys`` per node (in key order)."""
        if not self.config.parsed.cluster:
            return {self.config.nodes[0]: list(range(len(keys)))}
        if self.slots is None or self.slots_stale:  # never fetched (started while down) or outdated
            self.refresh_slots()
        slots = self.slots
        assert slots is not None  # refresh_slots() set it or raised; nothing sets it back to None
        return {slots.nodes[n]: idx for n, idx in slots.group(keys).items()}

    def per_node(self, groups: dict[Node, list[int]], work: Callable[[RespConnection, list[int]], None]) -> None:
        """Runs ``work(conn, positions)`` for each node, nodes in parallel; re-raises the first error
        after every node finished (so no connection is left mid-reply)."""

        def one(node: Node, idx: list[int]) -> None:
            pool = self.pool(node)
            conn, pooled = self.acquire(pool)
            try:
                work(conn, idx)
            except ConnectionError:
                conn.close()  # mid-pipeline: its stream position is unknown
                self.drop_idle(pool)
                if not pooled:
                    raise
                # A pooled connection the server dropped while idle (restart, idle timeout): the
                # ops are idempotent, so run once more on a fresh one. Timeouts are not retried.
                conn = self.connect(node)
                try:
                    work(conn, idx)
                except BaseException:
                    conn.close()
                    raise
            except BaseException:
                conn.close()
                self.drop_idle(pool)
                raise
            self.release(pool, conn)

        items = list(groups.items())
        if len(items) == 1:
            one(*items[0])
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="flexkv-remote")
        futures = [self._executor.submit(one, node, idx) for node, idx in items]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def windowed(
        self,
        conn: RespConnection,
        n: int,
        parts_of: Callable[[int], list[Any]],
        on_reply: Callable[[int], bool],
        value_bytes: int = 0,
    ) -> None:
        """Pipelines ``n`` commands with at most ``pipeline_depth`` in flight -- fewer for large
        values, so that at most ``pipeline_bytes`` of them are (Redis ingests and serves 2 MiB values
        slower when many are queued) -- topping the window up by halves. ``on_reply(j)`` reads
        reply j; False stops sending (in-flight replies are still read so the connection stays
        usable)."""
        depth = self.config.pipeline_depth
        if value_bytes:
            depth = max(1, min(depth, self.config.pipeline_bytes // value_bytes))
        refill_at = depth - max(1, depth // 2)
        sent = done = 0
        stop = False
        # Parts of the commands that go out next, built while a reply is awaited: a put's header
        # checksums a whole block when the caller has no checksum for it (~0.2 ms for 2 MiB read
        # from memory; RemoteMover passes the host pool's), which then overlaps the server's work
        # on the blocks in flight instead of delaying the next send.
        ready: list[list[Any]] = []
        while done < n:
            if not stop and sent < n and sent - done <= refill_at:
                hi = min(n, done + depth)
                while sent + len(ready) < hi:
                    ready.append(parts_of(sent + len(ready)))
                parts: list[Any] = []
                for p in ready[: hi - sent]:
                    parts.extend(p)
                del ready[: hi - sent]
                conn.send(parts)
                sent = hi
            if done == sent:
                break
            if not stop and sent + len(ready) < min(n, done + 1 + depth):
                ready.append(parts_of(sent + len(ready)))  # one per awaited reply
            if not on_reply(done):
                stop = True
            done += 1

    def close(self) -> None:
        """Closes every idle connection; a connection in use is closed when it comes back."""
        self.closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._pools_lock:
            pools = list(self._pools.values())
        for pool in pools:
            with pool.lock:
                idle, pool.idle = pool.idle, []
            for conn in idle:
                conn.close()


def _slot_map(conn: RespConnection, node: Node) -> SlotMap:
    """The cluster's slot map, as ``node`` answers CLUSTER SLOTS (an array of slot ranges)."""
    reply = conn.call(b"CLUSTER", b"SLOTS")
    if not isinstance(reply, list):
        raise ValueError(f"redis at {node[0]}:{node[1]}: CLUSTER SLOTS answered {type(reply).__name__}, not an array")
    return SlotMap(reply, node[0])
