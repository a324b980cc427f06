"""A small RESP2 connection over a raw socket, built for large values.

Writes go out with ``sendmsg`` scatter lists, so a block's bytes are sent straight from the
caller's buffer; bulk replies are received straight into the caller's buffer, by one native call
per payload that also hashes it and picks up the reply line after it (on TLS, by ``recv_into``).
The receive buffer only ever holds reply lines and the few bytes read past them, so no block is
copied through Python objects. Every socket wait is bounded by the timeout.
"""

from __future__ import annotations

import enum
import math
import os
import socket
import ssl
from collections.abc import Callable, Sequence

import xxhash

from dynamo_flexkv.core.errors import FlexKVError

Buffer = bytes | bytearray | memoryview

_IOV_MAX = 1024  # Linux UIO_MAXIOV
_RX_BYTES = 64 << 10
_FILL = 8 << 10  # read at most this much when waiting for a reply line: little payload lands here
_MAX_LINE = 64 << 10
_MAX_WAIT_MS = 2**31 - 1  # poll()'s limit (24.8 days); a longer timeout waits this long per piece


class _Recv(enum.IntEnum):
    """Outcome of a native receive (dfkv::RecvStatus in native/src/net.h)."""

    OK = 0
    CLOSED = 1
    TIMEOUT = 2
    ERROR = 3
    OTHER = 4  # not the bulk reply asked for: nothing consumed
    BAD_END = 5  # a payload not followed by CRLF


class ProtocolError(ConnectionError, FlexKVError):
    """The byte stream is not what RESP allows: the connection is unusable."""


class ReplyError(str):
    """A server error reply (``-ERR ...``) as a value inside a pipeline's results."""


class ServerError(FlexKVError):
    """A server error reply to a single command (see ``call``)."""


def encode_command(*args: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode("utf-8")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RespConnection:
    """One connection to one Redis node; not thread-safe (the store pools them)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float | None,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        native_reads: bool = True,
    ) -> None:
        """``native_reads=False`` reads through Python's socket calls, the path TLS connections take."""
        self.host, self.port = host, port
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            sock.settimeout(timeout_s)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._scatter = ssl_context is None  # SSLSocket has no sendmsg
        # Plain sockets take payloads natively: one call (one GIL release) per reply instead of a
        # recv_into per arriving piece and four Python reads per reply. With a thread per cluster
        # node on 2 vCPUs that made cluster gets 4% (128 KiB) and 6% (2 MiB) faster.
        self._fd = sock.fileno() if ssl_context is None and native_reads else -1
        from dynamo_flexkv.core import native as _native  # here: reading a config must not load it

        self._recv_exact, self._recv_bulk = _native.recv_exact, _native.recv_bulk
        # Per wait, as the socket's timeout applies; None waits forever, as a blocking socket does.
        self._timeout_ms = -1 if timeout_s is None else min(math.ceil(timeout_s * 1000), _MAX_WAIT_MS)
        self._buf = bytearray(_RX_BYTES)
        self._mv = memoryview(self._buf)
        self._r = self._w = 0
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._fd = -1  # the number may soon name another socket: native reads must not use it
            try:
                # A read still waiting (misuse from another thread: connections are not shared)
                # wakes now and fails as closed, before the number can be reused.
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self._sock.close()
            except OSError:
                pass

    # ---- sending ----

    def send(self, parts: list[Buffer]) -> None:
        """Sends every part in order (the list is consumed). Scatter-gather without copies."""
        if not self._scatter:
            for p in parts:
                self._sock.sendall(p)
            return
        i, n = 0, len(parts)
        while i < n:
            sent = self._sock.sendmsg(parts[i : i + _IOV_MAX])
            while sent:
                part = parts[i]
                size = len(part) if not isinstance(part, memoryview) else part.nbytes
                if sent >= size:
                    sent -= size
                    i += 1
                else:
                    parts[i] = memoryview(parts[i])[sent:]
                    sent = 0

    # ---- receiving ----

    def _fill(self) -> None:
        if self._r == self._w:
            self._r = self._w = 0
        elif len(self._buf) - self._w < _FILL:
            n = self._w - self._r
            self._mv[:n] = self._mv[self._r : self._w]
            self._r, self._w = 0, n
        got = self._sock.recv_into(self._mv[self._w : self._w + _FILL])
        if not got:
            raise ConnectionError(f"redis {self.host}:{self.port} closed the connection")
        self._w += got

    def readline(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            i = self._buf.find(b"\r\n", self._r, self._w)
            if i >= 0:
                line = bytes(self._mv[self._r : i])
                self._r = i + 2
                return line
            if self._w - self._r > _MAX_LINE:
                raise ProtocolError(f"redis {self.host}:{self.port}: reply line longer than {_MAX_LINE} bytes")
            self._fill()

    def read_into(self, dest: memoryview, checksum: bool = False) -> int:
        """Fills ``dest`` (a byte memoryview) with the next ``dest.nbytes`` bytes of the stream;
        returns their xxh3_64 with ``checksum`` (hashed while in cache), else 0."""
        if self._fd >= 0:
            digest = self._recv_natively(self._recv_exact, dest, checksum)
            assert digest is not None  # native recv_exact never answers OTHER (only recv_bulk does)
            return digest
        n = dest.nbytes
        k = min(self._w - self._r, n)
        if k:
            dest[:k] = self._mv[self._r : self._r + k]
            self._r += k
        pos = k
        recv_into = self._sock.recv_into
        while pos < n:
            got = recv_into(dest[pos:], n - pos)
            if not got:
                raise ConnectionError(f"redis {self.host}:{self.port} closed the connection mid-reply")
            pos += got
        return xxhash.xxh3_64_intdigest(dest) if checksum else 0

    def read_bulk(self, header: memoryview, dest: memoryview) -> int | None:
        """Reads the next reply when it is a bulk string of exactly ``header`` + ``dest`` bytes:
        fills both and returns the payload's xxh3_64. None when the reply is anything else (nil,
        an error, another length), with nothing consumed: read it with ``readline`` and co."""
        if self._fd < 0:
            return None  # TLS: the general path
        return self._recv_natively(self._recv_bulk, header, dest)

    def _recv_natively(self, call: Callable[..., tuple[int, int, int, int, int]], *args: object) -> int | None:
        """Runs a native receive on the socket and this buffer. A signal does not cut its waits
        short (each ends within the timeout); the handler's exception follows it."""
        code, err, self._r, self._w, digest = call(
            self._fd, self._buf, self._r, self._w, _FILL, self._timeout_ms, *args
        )
        if code == _Recv.OK:
            return digest
        status = _Recv(code)
        if status is _Recv.OTHER:
            return None
        where = f"redis {self.host}:{self.port}"
        if status is _Recv.CLOSED:
            raise ConnectionError(f"{where} closed the connection mid-reply")
        if status is _Recv.TIMEOUT:
            raise TimeoutError(f"{where}: no reply data for {self._timeout_ms} ms")
        if status is _Recv.BAD_END:
            raise ProtocolError(f"{where}: bulk reply not followed by CRLF")
        raise OSError(err, f"{where}: recv failed mid-reply: {os.strerror(err)}")

    def skip(self, n: int) -> None:
        """Discards the next ``n`` bytes of the stream."""
        k = min(self._w - self._r, n)
        self._r += k
        n -= k
        if n:
            scratch = memoryview(bytearray(min(n, 1 << 20)))
            while n:
                got = self._sock.recv_into(scratch, min(n, scratch.nbytes))
                if not got:
                    raise ConnectionError(f"redis {self.host}:{self.port} closed the connection mid-reply")
                n -= got

    def expect_crlf(self) -> None:
        while self._w - self._r < 2:
            self._fill()
        if self._buf[self._r : self._r + 2] != b"\r\n":
            raise ProtocolError(f"redis {self.host}:{self.port}: bulk reply not followed by CRLF")
        self._r += 2

    def read_reply(self) -> object:
        """One reply: str (status), ReplyError, int, bytes or None (bulk), list (array)."""
        line = self.readline()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return self.reply_number(line)
        if kind == b"$":
            n = self.reply_number(line)
            if n < 0:
                return None
            out = bytearray(n)
            self.read_into(memoryview(out))
            self.expect_crlf()
            return bytes(out)
        if kind == b"*":
            n = self.reply_number(line)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise ProtocolError(f"redis {self.host}:{self.port}: unexpected reply type {line[:16]!r}")

    def reply_number(self, line: bytes) -> int:
        """The number after a reply line's type byte; ProtocolError when it is not one."""
        try:
            return int(line[1:])
        except ValueError:
            raise ProtocolError(
                f"redis {self.host}:{self.port}: {line[:1]!r} reply with a length or value that is "
                f"not a number ({len(line)}-byte line)"
            ) from None

    def call(self, *args: bytes | str | int) -> object:
        """Sends one command and returns its reply; an error reply raises ServerError."""
        self.send([encode_command(*args)])
        reply = self.read_reply()
        if isinstance(reply, ReplyError):
            raise ServerError(str(reply))
        return reply

    def pipeline(self, commands: Sequence[bytes]) -> list:
        """Sends encoded commands at once and returns their replies (errors as ReplyError)."""
        self.send(list(commands))
        return [self.read_reply() for _ in commands]
