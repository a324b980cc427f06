"""RemoteStore: content-addressed KV blocks in Redis or Redis Cluster.

Every hit is advisory: a value that is missing, truncated, corrupt or of another fingerprint ends
the loaded prefix there, and the caller recomputes the rest. Every remote failure is bounded by
the socket timeout, counted, and reported as a shorter prefix or fewer stored blocks -- never as
an exception -- while a circuit breaker keeps a dead server from being hammered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import dynamo_flexkv.core.remote.quota as quota
from dynamo_flexkv.core.logutil import RateLimitedLog
from dynamo_flexkv.core.remote.breaker import BreakerState, CircuitBreaker
from dynamo_flexkv.core.remote.codec import (
    HEADER_BYTES,
    Verdict,
    check_header,
    encode_header,
    fingerprint_of,
    header_problem,
    key_prefix_bytes,
    payload_ok,
)
from dynamo_flexkv.core.remote.config import RemoteConfig
from dynamo_flexkv.core.remote.connections import NodeConnections
from dynamo_flexkv.core.remote.errors import RemoteAuthError, RemoteClosedError, RemoteError, RemoteUnavailableError
from dynamo_flexkv.core.remote.resp import ProtocolError, ReplyError, RespConnection, ServerError, encode_command
from dynamo_flexkv.core.remote.stats import RemoteStats

__all__ = [
    "RemoteAuthError",
    "RemoteClosedError",
    "RemoteError",
    "RemoteStats",
    "RemoteStore",
    "RemoteUnavailableError",
]

log = logging.getLogger(__name__)

Hashes = Sequence[int] | Any  # a list of ints or a numpy uint64 array
_U64 = (1 << 64) - 1


def _byte_view(buf: Any, writable: bool) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("remote store buffers must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("get_into needs writable destination buffers")
    return mv


def _hash_list(hashes: Hashes, what: str = "seq_hashes") -> list[int]:
    """``hashes`` as Python ints, each checked to be a u64: one outside [0, 2**64) would otherwise
    wrap onto another block's key, and a float would be truncated onto one. numpy integer arrays
    need at most one vectorized min; lists get one type test per element and a min/max."""
    if isinstance(hashes, (str, bytes, bytearray, memoryview, int, np.integer, set, frozenset, dict)) or (
        isinstance(hashes, np.ndarray) and hashes.ndim != 1
    ):  # a set or dict: no order to match buffers
        raise TypeError(
            f"{what} must be a sequence of u64 sequence hashes (a list of ints or a 1-D numpy uint64 "
            f"array), not {_kind_of(hashes)}: pass e.g. kv.hashes(tokens).sequence"
        )
    if isinstance(hashes, np.ndarray):
        if hashes.dtype.kind == "u":
            return hashes.tolist()
        if hashes.dtype.kind == "i" and hashes.size and hashes.min() < 0:
            _out_of_range(int(hashes.min()), what)
        if hashes.dtype.kind in "iu":
            return hashes.tolist()
        if hashes.size and hashes.dtype.kind != "O":  # a float64 above 2**53 is already another hash
            raise TypeError(f"{what} must hold integers, not a {hashes.dtype} array: pass a numpy uint64 array")
    items = hashes.tolist() if hasattr(hashes, "tolist") else list(hashes)
    for h in items:
        if not isinstance(h, (int, np.integer)) or isinstance(h, (bool, np.bool_)):
            raise TypeError(f"{what} must hold integers (u64 sequence hashes), not {type(h).__name__} ({h!r})")
    out = [int(h) for h in items]
    if out:
        low, high = min(out), max(out)
        if low < 0:
            _out_of_range(low, what)
        if high > _U64:
            _out_of_range(high, what)
    return out


def _kind_of(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D {value.dtype} array"
    return type(value).__name__


def _out_of_range(value: int, what: str) -> None:
    raise ValueError(
        f"{what} holds {value}, outside the u64 range [0, 2**64): sequence hashes are unsigned "
        f"64-bit (it would be stored under the key of {value & _U64:#x})"
    )


def _node_name(node: tuple[str, int]) -> str:
    host, port = node
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


REFUSED = (Verdict.TRUNCATED, Verdict.FOREIGN, Verdict.CORRUPT)  # a value that is there but bad
BAD_VALUE_LOG_EVERY_S = 1.0  # at most one "deleted bad value" line per second per store


@dataclass(frozen=True)
class RefusedValue:
    """A value that ended a read's prefix because verification refused it (not a missing one, nor a
    server error or timeout): the block's sequence hash, the verdict and why, in words."""

    seq_hash: int
    verdict: Verdict
    why: str


def _ok_prefix(verdicts: list[Verdict]) -> int:
    return next((i for i, v in enumerate(verdicts) if v is not Verdict.OK), len(verdicts))


def _note_refused(
    refused: list[RefusedValue] | None, seq: list[int], verdicts: list[Verdict], n: int, why: dict[int, str]
) -> None:
    if refused is not None and n < len(seq) and verdicts[n] in REFUSED:
        refused.append(RefusedValue(seq[n], verdicts[n], why.get(n, verdicts[n].value)))


def _parent_list(seq: list[int], parents: Sequence[int | None] | None) -> list[int | None]:
    """Parents as given, or the chain: block 0 has none, block i has seq[i-1]."""
    if parents is None:
        return [None] + seq[:-1]
    if isinstance(parents, (str, bytes, bytearray, memoryview)):
        _hash_list(parents, "parents")  # raises the TypeError
    out = [None if p is None else int(p) for p in (parents.tolist() if hasattr(parents, "tolist") else parents)]
    given = [p for p in out if p is not None]
    if given and (min(given) < 0 or max(given) > _U64):
        _out_of_range(min(given) if min(given) < 0 else max(given), "parents")
    if len(out) != len(seq):
        raise ValueError(f"got {len(out)} parents for {len(seq)} sequence hashes")
    return out


class RemoteStore:
    """Blocks of one fingerprint in Redis (thread-safe; connections are pooled per node)."""

    def __init__(
        self,
        config: RemoteConfig,
        fingerprint: int,
        *,
        strict: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the monotonic clock of the breaker's cool-down and the bad-value log's rate limit."""
        self.config = config
        if config.quota_bytes and config.tenant:  # a tenant's blocks are its own keys: another tenant's
            # quota eviction (remote/quota.py) can never delete a block this one accounts for
            fingerprint = fingerprint_of({"fingerprint": int(fingerprint) & _U64, "tenant": config.tenant})
        self.fingerprint = int(fingerprint) & _U64
        self._prefix = key_prefix_bytes(config.key_prefix, self.fingerprint)
        self._ttl_args = (
            b"" if config.ttl_s is None else encode_command(b"PX", int(round(config.ttl_s * 1000)))[len(b"*2\r\n") :]
        )
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self._stats = RemoteStats(quota_bytes=config.quota_bytes)
        # The tenant's account (remote/quota.py) when it has a quota: (blocks, bytes, clock) keys.
        self._account = quota.account_keys(config.key_prefix, config.tenant) if config.quota_bytes else None
        self._stats_lock = threading.Lock()
        self._nodes = NodeConnections(config, self._count_connect)
        self._closed = False
        self._bad_log = RateLimitedLog(log, BAD_VALUE_LOG_EVERY_S, clock)
        try:
            self._nodes.check_server()
        except RemoteUnavailableError as e:
            if strict:
                raise
            log.warning("%s; the remote tier starts disabled and retries every %.0f s", e, config.breaker_cooldown_s)
            self._breaker.trip()

    @property
    def policy_warning(self) -> str | None:
        """ "noeviction" when the server would refuse writes once full (checked at open)."""
        return self._nodes.policy_warning

    def _count_connect(self) -> None:
        with self._stats_lock:
            self._stats.connects += 1

    @classmethod
    def open(
        cls,
        url: str,
        fingerprint: int,
        *,
        strict: bool = True,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> RemoteStore:
        """``RemoteStore.open("redis://127.0.0.1:6379", fp, timeout_s=1.0, ttl_s=3600)``; settings are
        RemoteConfig fields. ``strict=False`` starts with the breaker open when the server is down."""
        return cls(RemoteConfig(url=url, **settings), fingerprint, strict=strict, clock=clock)

    # ---- connections ----

    def _keys(self, seq: list[int]) -> list[bytes]:
        p = self._prefix
        return [b"%s%016x" % (p, h) for h in seq]

    def key(self, seq_hash: int) -> bytes:
        """The Redis key block ``seq_hash`` is stored under: ``{key_prefix}{fingerprint:016x}:{seq_hash:016x}``
        (what ``redis-cli GET`` or ``DEL`` takes)."""
        return self._keys(_hash_list([seq_hash]))[0]

    # ---- running ops ----

    def _guard(self, run: Callable[[], None], seconds_field: str) -> bool:
        """Runs ``run`` unless the breaker is open; a connection failure or timeout is counted and
        feeds the breaker instead of raising. Returns whether it ran to the end."""
        if self._closed:
            raise RemoteClosedError("the remote store is closed")
        if not self._breaker.allow():
            with self._stats_lock:
                self._stats.breaker_refused += 1
            return False
        was = self._breaker.state
        t0 = time.perf_counter()
        try:
            run()
        except (OSError, ProtocolError, RemoteError) as e:
            if isinstance(e, RemoteAuthError):
                log.error("%s", e)
            self._breaker.failure()
            if self.config.parsed.cluster:
                self._nodes.slots_stale = True
            with self._stats_lock:
                self._stats.op_errors += 1
            if self._breaker.state is BreakerState.OPEN and was is not BreakerState.OPEN:
                log.warning(
                    "remote tier %s failing (%s: %s); pausing it for %.1f s",
                    self.config.redacted_url,
                    type(e).__name__,
                    e,
                    self.config.breaker_cooldown_s,
                )
            return False
        finally:
            with self._stats_lock:
                setattr(self._stats, seconds_field, getattr(self._stats, seconds_field) + time.perf_counter() - t0)
        if was is not BreakerState.CLOSED:
            log.info("remote tier %s is back", self.config.redacted_url)
        self._breaker.success()
        return True

    # ---- public API ----

    def exists(self, seq_hashes: Hashes) -> list[bool]:
        """Which blocks the store has now (one pipelined EXISTS per key, per node)."""
        seq = _hash_list(seq_hashes)
        found = [False] * len(seq)

        def run() -> None:
            keys = self._keys(seq)

            def work(conn: RespConnection, idx: list[int]) -> None:
                replies = conn.pipeline([encode_command(b"EXISTS", keys[i]) for i in idx])
                for i, r in zip(idx, replies):
                    found[i] = r == 1
                self._note_reply_errors(r for r in replies if isinstance(r, ReplyError))

            self._nodes.per_node(self._nodes.route(keys), work)

        if seq and self._guard(run, "exists_seconds"):
            with self._stats_lock:
                self._stats.exists_keys += len(seq)
        return found

    def exists_prefix(self, seq_hashes: Hashes) -> int:
        """Length of the longest prefix of ``seq_hashes`` present now, asked ``exists_chunk`` keys
        per round trip and stopping at the first chunk with a gap. 0 when the remote is down."""
        seq = _hash_list(seq_hashes)
        chunk = self.config.exists_chunk
        for base in range(0, len(seq), chunk):
            found = self.exists(seq[base : base + chunk])
            if not all(found):
                return base + found.index(False)
        return len(seq)

    def get_into(
        self,
        seq_hashes: Hashes,
        dests: Sequence[Any],
        parents: Sequence[int | None] | None = None,
        *,
        refused: list[RefusedValue] | None = None,
        checksums: list[int] | None = None,
    ) -> int:
        """Reads blocks straight into ``dests`` (writable buffers of each block's size) and returns
        how many leading blocks are present and verified. ``parents`` defaults to the chain
        (block 0 has none). Bytes of ``dests`` past the returned count are unspecified. When the
        value that ended the prefix was refused by verification, ``refused`` (if given) gets it.
        ``checksums`` (if given) gets the verified blocks' payload checksums, one per block."""
        seq, par, views = self._read_args(seq_hashes, dests, parents)
        fp = self.fingerprint
        why: dict[int, str] = {}
        sums = [0] * len(seq)

        def read(conn: RespConnection, header: memoryview, i: int) -> Verdict:
            return self._read_value(conn, header, fp, seq[i], par[i], views[i], why, i, sums)

        verdicts = self._read_pipelined(
            seq, lambda k: encode_command(b"GET", k), read, max((v.nbytes for v in views), default=0)
        )
        n = _ok_prefix(verdicts)
        self._count_read(n, sum(v.nbytes for v in views[:n]), verdicts[n] if n < len(seq) else None)
        _note_refused(refused, seq, verdicts, n, why)
        if checksums is not None:
            checksums[:] = sums[:n]
        return n

    def get_range_into(
        self,
        seq_hashes: Hashes,
        dests: Sequence[Any],
        offset: int,
        block_bytes: int,
        parents: Sequence[int | None] | None = None,
        *,
        refused: list[RefusedValue] | None = None,
    ) -> tuple[int, list[int]]:
        """Reads bytes ``[offset, offset + len(dest))`` of each block's payload into ``dests``
        (pipelined GETRANGE), for layerwise loads: the first layers land while later ones are on
        their way. Returns how many leading blocks landed and, when ``offset`` is 0 (the header is
        read and checked then, ``block_bytes`` being the whole payload's length), each landed
        block's payload checksum. Nothing is verified or counted as a hit yet: call
        ``verify_landed`` once every range of the blocks landed. ``refused`` as for ``get_into``."""
        seq, par, views = self._read_args(seq_hashes, dests, parents)
        if offset < 0 or any(offset + v.nbytes > block_bytes for v in views):
            raise ValueError(
                f"range [{offset}, +{views[0].nbytes if views else 0}) is outside {block_bytes}-byte blocks"
            )
        if views and len({v.nbytes for v in views}) != 1:
            raise ValueError("get_range_into reads one range length for every block")
        span = views[0].nbytes if views else 0
        fp, first, last = self.fingerprint, offset == 0, offset + span == block_bytes
        sums = [0] * len(seq)
        # A range that ends the payload asks for one byte more: a value longer than header + payload
        # then answers it, and is refused like a bulk get refuses it (a shorter one answers fewer bytes).
        start = 0 if first else HEADER_BYTES + offset
        end = HEADER_BYTES + offset + span - 1 + (1 if last else 0)
        want = span + (HEADER_BYTES if first else 0)
        empty = [False] * len(seq)
        why: dict[int, str] = {}

        def cmd(key: bytes) -> bytes:
            return encode_command(b"GETRANGE", key, start, end)

        def read(conn: RespConnection, header: memoryview, i: int) -> Verdict:
            size = self._bulk_size(conn, "GETRANGE")
            if size is None:
                return Verdict.ERROR
            if size != want:  # longer (last range), shorter, or empty: a missing key reads as empty too
                if size > 0:
                    conn.skip(size)
                if size >= 0:
                    conn.expect_crlf()
                empty[i] = size <= 0
                if size > 0:
                    why[i] = (
                        f"wrong size: bytes {start}..{end} of the value are {size} bytes, not {want} "
                        f"(a value is a {HEADER_BYTES}-byte header + {block_bytes} bytes)"
                    )
                return Verdict.MISSING if size <= 0 else Verdict.TRUNCATED
            verdict = Verdict.OK
            if first:
                conn.read_into(header)
                verdict, sums[i] = check_header(header, fp, seq[i], par[i], block_bytes)
                if verdict is not Verdict.OK:
                    why[i] = header_problem(header, fp, seq[i], par[i], block_bytes)
            if verdict is Verdict.OK:
                conn.read_into(views[i])
            else:
                conn.skip(views[i].nbytes)
            conn.expect_crlf()
            return verdict

        verdicts = self._read_pipelined(seq, cmd, read, span)
        n = _ok_prefix(verdicts)
        if n < len(seq) and empty[n] and self.exists(seq[n : n + 1])[0]:
            # An empty range of a key that exists: an empty (or header-short) value, not an eviction.
            # Asked only for the block that ended the prefix: no round trip on the way of a hit.
            verdicts[n] = Verdict.TRUNCATED
            why[n] = (
                f"wrong size: the value ends before byte {start} (a value is a {HEADER_BYTES}-byte header + "
                f"{block_bytes} bytes)"
                if start
                else "wrong size: the value is empty"
            )
        if n < len(seq):
            self._count_read(0, 0, verdicts[n])
        _note_refused(refused, seq, verdicts, n, why)
        return n, sums[:n]

    def verify_landed(
        self,
        blocks: Sequence[Any],
        checksums: Sequence[int],
        *,
        seq_hashes: Hashes | None = None,
        refused: list[RefusedValue] | None = None,
    ) -> int:
        """Checks whole blocks that ``get_range_into`` filled range by range against the
        checksums its first range returned; counts and returns the verified leading blocks. With
        the blocks' ``seq_hashes``, ``refused`` (if given) gets the one that failed its checksum."""
        views = [_byte_view(b, writable=False) for b in blocks[: len(checksums)]]
        n = next((i for i, (v, c) in enumerate(zip(views, checksums)) if not payload_ok(v, c)), len(views))
        self._count_read(n, sum(v.nbytes for v in views[:n]), Verdict.CORRUPT if n < len(views) else None)
        if n < len(views) and refused is not None and seq_hashes is not None:
            refused.append(
                RefusedValue(
                    _hash_list(seq_hashes)[n], Verdict.CORRUPT, "payload checksum mismatch (read layer by layer)"
                )
            )
        return n

    def drop_refused(self, value: RefusedValue) -> bool:
        """Deletes a value verification refused, so the next put of its block rewrites it instead of
        every later get ending there, and says so in one WARNING line naming its key and why (at
        most one line a second: a burst of them is counted in the next line). True if deleted."""
        deleted = self.delete([value.seq_hash]) == 1
        key = (self._prefix + b"%016x" % value.seq_hash).decode("ascii", "replace")
        if deleted:
            self._bad_log.warning(
                "remote tier: deleted bad value %s (%s: %s); the block is recomputed and its next put rewrites it",
                key,
                value.verdict.value,
                value.why,
            )
        else:
            self._bad_log.warning(
                "remote tier: bad value %s (%s: %s) was not deleted (already gone, or the "
                "server did not answer); the block is recomputed",
                key,
                value.verdict.value,
                value.why,
            )
        return deleted

    def _read_args(
        self, seq_hashes: Hashes, dests: Sequence[Any], parents: Sequence[int | None] | None
    ) -> tuple[list[int], list, list[memoryview]]:
        seq = _hash_list(seq_hashes)
        if len(dests) != len(seq):
            raise ValueError(f"got {len(dests)} destination buffers for {len(seq)} sequence hashes")
        return seq, _parent_list(seq, parents), [_byte_view(d, writable=True) for d in dests]

    def _read_pipelined(
        self,
        seq: list[int],
        command: Callable[[bytes], bytes],
        read: Callable[[RespConnection, memoryview, int], Verdict],
        value_bytes: int,
    ) -> list[Verdict]:
        """Sends ``command(key)`` per block, pipelined per node, and ``read``s each reply until the
        first one that is not OK on each node. Verdicts of blocks never read stay ERROR."""
        verdicts: list[Verdict] = [Verdict.ERROR] * len(seq)

        def work(conn: RespConnection, idx: list[int]) -> None:
            cmds = [command(self._prefix + b"%016x" % seq[i]) for i in idx]
            header = memoryview(bytearray(HEADER_BYTES))

            def one(j: int) -> bool:
                i = idx[j]
                verdicts[i] = v = read(conn, header, i)
                return v is Verdict.OK

            self._nodes.windowed(conn, len(idx), lambda j: [cmds[j]], one, value_bytes)

        def run() -> None:
            self._nodes.per_node(self._nodes.route(self._keys(seq)), work)

        if seq:
            self._guard(run, "get_seconds")
        return verdicts

    def _count_read(self, hits: int, nbytes: int, end: Verdict | None) -> None:
        """Counts a read's verified blocks and what ended its prefix (when something did)."""
        with self._stats_lock:
            s = self._stats
            s.hits += hits
            s.bytes_read += nbytes
            if end is Verdict.MISSING:
                s.misses += 1
            elif end is Verdict.TRUNCATED:
                s.truncated += 1
            elif end is Verdict.FOREIGN:
                s.foreign += 1
            elif end is Verdict.CORRUPT:
                s.corrupt += 1

    def _note_reply_errors(self, errors: Iterable[bytes | str]) -> None:
        """Counts error replies; a MOVED or ASK (the cluster moved a slot since the map was read)
        makes the next op fetch the slot map again."""
        n = 0
        for e in errors:
            n += 1
            text = e.decode("ascii", "replace").lstrip("-") if isinstance(e, bytes) else e
            if text.startswith(("MOVED", "ASK")):
                self._nodes.slots_stale = True
        if n:
            with self._stats_lock:
                self._stats.server_errors += n

    def _bulk_size(self, conn: RespConnection, command: str) -> int | None:
        """Length of the next bulk reply (-1: nil), or None for an error reply (counted)."""
        line = conn.readline()
        if line[:1] == b"-":
            self._note_reply_errors([line])
            return None
        if line[:1] != b"$":
            raise ProtocolError(f"redis {conn.host}:{conn.port}: {command} answered {line[:16]!r}")
        return conn.reply_number(line)

    def _read_value(
        self,
        conn: RespConnection,
        header: memoryview,
        fp: int,
        seq: int,
        parent: int | None,
        dest: memoryview,
        why: dict[int, str],
        i: int,
        sums: list[int],
    ) -> Verdict:
        """One GET reply into ``dest``; a refused value's reason goes to ``why[i]``."""
        got = conn.read_bulk(header, dest)  # the usual reply, a value of the right size: one call
        if got is not None:
            verdict, checksum = check_header(header, fp, seq, parent, dest.nbytes)
            if verdict is not Verdict.OK:
                why[i] = header_problem(header, fp, seq, parent, dest.nbytes)
                return verdict
            if got != checksum:
                why[i] = "payload checksum mismatch"
                return Verdict.CORRUPT
            sums[i] = checksum
            return Verdict.OK
        size = self._bulk_size(conn, "GET")
        if size is None:
            return Verdict.ERROR
        if size < 0:
            return Verdict.MISSING
        if size < HEADER_BYTES:
            conn.skip(size)
            conn.expect_crlf()
            why[i] = f"wrong size: {size} bytes, shorter than the {HEADER_BYTES}-byte header"
            return Verdict.TRUNCATED
        conn.read_into(header)
        verdict, checksum = check_header(header, fp, seq, parent, dest.nbytes)
        body = size - HEADER_BYTES
        if verdict is not Verdict.OK:
            why[i] = header_problem(header, fp, seq, parent, dest.nbytes)
        elif body != dest.nbytes:
            verdict = Verdict.TRUNCATED
            why[i] = f"wrong size: {size} bytes, not the {HEADER_BYTES}-byte header + {dest.nbytes} bytes"
        if verdict is Verdict.OK:
            if conn.read_into(dest, checksum=True) != checksum:
                verdict = Verdict.CORRUPT
                why[i] = "payload checksum mismatch"
            else:
                sums[i] = checksum
        else:
            conn.skip(body)
        conn.expect_crlf()
        return verdict

    def put(
        self,
        seq_hashes: Hashes,
        srcs: Sequence[Any],
        parents: Sequence[int | None] | None = None,
        *,
        skip_existing: bool = False,
        checksums: Sequence[int] | None = None,
    ) -> int:
        """Stores blocks (pipelined SET, with PX when ttl_s is set); idempotent, since a key names
        its content. Returns how many are in the store afterwards as far as this call knows
        (stored or, with ``skip_existing``, already there). Refused writes are counted, not raised.
        ``checksums``: each source's xxh3_64 when the caller has it (the host pool's, taken when
        the bytes landed), so no block is hashed again here; otherwise each is hashed as it goes."""
        seq = _hash_list(seq_hashes)
        if len(srcs) != len(seq):
            raise ValueError(f"got {len(srcs)} source buffers for {len(seq)} sequence hashes")
        if checksums is not None and len(checksums) != len(seq):
            raise ValueError(f"got {len(checksums)} checksums for {len(seq)} sequence hashes")
        sums = [None] * len(seq) if checksums is None else [int(c) for c in checksums]
        par = _parent_list(seq, parents)
        views = [_byte_view(s, writable=False) for s in srcs]
        todo = list(range(len(seq)))
        skipped = 0
        if skip_existing and seq:
            present = self.exists(seq)
            todo = [i for i in todo if not present[i]]
            skipped = len(seq) - len(todo)
        stored = [False] * len(seq)
        answered = [False] * len(seq)
        refused = [0]
        fp, ttl = self.fingerprint, self._ttl_args
        ttl_argc = 2 if ttl else 0

        def work(conn: RespConnection, idx: list[int]) -> None:
            def parts(j: int) -> list[Any]:
                i = idx[j]
                key = self._prefix + b"%016x" % seq[i]
                view = views[i]
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                    3 + ttl_argc,
                    len(key),
                    key,
                    HEADER_BYTES + view.nbytes,
                )
                return [head + encode_header(fp, seq[i], par[i], view, sums[i]), view, b"\r\n" + ttl]

            def read(j: int) -> bool:
                reply = conn.readline()
                answered[idx[j]] = reply[:1] in (b"+", b"-")  # a reply (a garbled one raises below)
                if reply == b"+OK":
                    stored[idx[j]] = True
                elif reply.startswith(b"-OOM"):
                    refused[0] += 1
                elif reply.startswith(b"-"):
                    self._note_reply_errors([reply])
                else:
                    raise ProtocolError(f"redis {conn.host}:{conn.port}: SET answered {reply[:16]!r}")
                return True

            self._nodes.windowed(conn, len(idx), parts, read, max((views[i].nbytes for i in idx), default=0))

        gone: list[int] = []  # blocks of this call the tenant's quota left out (or, if present, deleted)

        def run() -> None:
            write = todo
            if self._account is not None:
                # Skipped blocks are accounted too: present, they become the tenant's youngest.
                gone.extend(self._reserve(seq, views, list(range(len(seq)))))
                write = [i for i in todo if i not in set(gone)]
            keys = self._keys([seq[i] for i in write])
            groups = {node: [write[k] for k in ks] for node, ks in self._nodes.route(keys).items()}
            if groups:
                self._nodes.per_node(groups, work)

        if todo or (self._account is not None and seq):
            self._guard(run, "put_seconds")
        for i in gone:  # never written (or deleted again): not in the store, and not a failure
            answered[i] = True
        skipped -= sum(1 for i in gone if i not in todo)
        n_stored = sum(stored)
        with self._stats_lock:
            s = self._stats
            s.puts += n_stored
            s.put_failed += len(todo) - sum(answered)
            s.put_skipped += skipped
            s.put_refused += refused[0]
            s.bytes_written += sum(views[i].nbytes for i in range(len(seq)) if stored[i])
        return n_stored + skipped

    def delete(self, seq_hashes: Hashes) -> int:
        """Removes blocks (tests, tools; their tenant's account forgets them); returns how many existed."""
        seq = _hash_list(seq_hashes)
        removed = [0]

        def run() -> None:
            keys = self._keys(seq)
            removed[0] = self._delete_keys(keys)
            if self._account is not None:
                used = self._eval(quota.FORGET, list(self._account[:3]), keys)
                with self._stats_lock:
                    self._stats.quota_used_bytes = int(used)

        if seq:
            self._guard(run, "exists_seconds")
        return removed[0]

    def _delete_keys(self, keys: list[bytes]) -> int:
        removed = [0]

        def work(conn: RespConnection, idx: list[int]) -> None:
            replies = conn.pipeline([encode_command(b"DEL", keys[i]) for i in idx])
            removed[0] += sum(r for r in replies if isinstance(r, int))
            self._note_reply_errors(r for r in replies if isinstance(r, ReplyError))

        if keys:
            self._nodes.per_node(self._nodes.route(keys), work)
        return removed[0]

    # ---- the tenant's quota (remote/quota.py) ----

    def _eval(self, script: bytes, keys: list[bytes], args: list[bytes]) -> Any:
        """Runs a quota script on the node of the tenant's account (its keys share one slot)."""
        reply: list[Any] = [None]

        def work(conn: RespConnection, _: list[int]) -> None:
            try:
                reply[0] = conn.call(b"EVAL", script, len(keys), *keys, *args)
            except ServerError as e:  # MOVED (the slot moved), a script error: the op failed
                self._note_reply_errors([str(e)])
                raise RemoteError(f"redis at {self.config.redacted_url}: the quota script failed: {e}") from None

        self._nodes.per_node({node: [0] for node in self._nodes.route(keys[:1])}, work)
        return reply[0]

    def _reserve(self, seq: list[int], views: list[memoryview], idx: list[int]) -> list[int]:
        """Accounts blocks ``idx`` of a put to the tenant (in order: the batch's last blocks go
        first when it alone passes the quota), deletes the tenant's blocks popped to make room, and
        returns the positions of ``idx`` among those popped (not to be written)."""
        assert self._account is not None
        keys = {self._prefix + b"%016x" % seq[i]: i for i in idx}
        args = [b"%d" % self.config.quota_bytes]
        for key, i in keys.items():
            args += [key, b"%d" % (HEADER_BYTES + views[i].nbytes)]
        reply = self._eval(quota.RESERVE, list(self._account), args)
        used, victims = int(reply[0]), list(reply[1:])
        mine = [keys[v] for v in victims if v in keys]
        self._delete_keys(victims)
        with self._stats_lock:
            self._stats.quota_used_bytes = used
            self._stats.quota_evicted += len(victims)
        return mine

    def quota_usage(self) -> int | None:
        """The bytes the tenant's account holds now (read from Redis), or None: no quota, or the
        server did not answer (the breaker counts it)."""
        account = self._account
        if account is None:
            return None
        got: list[int | None] = [None]

        def run() -> None:
            def work(conn: RespConnection, _: list[int]) -> None:
                got[0] = int(conn.call(b"GET", account[2]) or 0)  # type: ignore[call-overload]

            self._nodes.per_node({node: [0] for node in self._nodes.route([account[2]])}, work)

        if self._guard(run, "exists_seconds") and got[0] is not None:
            with self._stats_lock:
                self._stats.quota_used_bytes = got[0]
        return got[0]

    def blocks_per_node(self, seq_hashes: Hashes) -> dict[str, int]:
        """How many of these blocks each node serves now: "host:port" -> count, every node listed,
        0 included (one entry on a single server; a cluster's slot map is fetched again first).
        A get or put of them returns when its fullest node is done: on a cluster, a batch whose
        keys fall unevenly ends waiting on that node while the others idle. Raises
        RemoteUnavailableError when no node answers for the slot map, or while the circuit
        breaker pauses the tier after failures."""
        seq = _hash_list(seq_hashes)
        counts: dict[str, int] = {}

        def run() -> None:
            if self.config.parsed.cluster:
                self._nodes.slots_stale = True  # a diagnostic: ask the cluster where its slots are now
            groups = self._nodes.route(self._keys(seq))
            nodes = self._nodes.slots.nodes if self.config.parsed.cluster and self._nodes.slots else list(groups)
            counts.update((_node_name(node), 0) for node in nodes)
            counts.update((_node_name(node), len(idx)) for node, idx in groups.items())

        if not self._guard(run, "exists_seconds"):
            raise RemoteUnavailableError(
                f"no node of {self.config.redacted_url} answered for the slot map (or the "
                f"tier is paused for {self.config.breaker_cooldown_s:.0f} s after failures)"
            )
        return counts

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def stats(self) -> RemoteStats:
        with self._stats_lock:
            snap = replace(self._stats)
        snap.breaker_state = self._breaker.state.value
        snap.breaker_opened = self._breaker.times_opened
        return snap

    def close(self) -> None:
        """Closes every connection; later ops raise RemoteClosedError. Safe to call twice."""
        self._bad_log.flush("bad values refused and dropped")
        self._closed = True
        self._nodes.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
