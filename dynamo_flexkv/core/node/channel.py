"""One end of a node cache connection: framed messages over a Unix stream socket, file descriptors
beside them (SCM_RIGHTS), and an outbound queue drained by a thread of its own, so a sender (a
transfer thread of the service, an engine thread) never blocks on a peer that stopped reading: a
queue past its bound closes the connection instead."""

from __future__ import annotations

import array
import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.node.protocol import HEADER_BYTES, ProtocolError, encode, frame_length

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 256 << 20


class ChannelClosed(ConnectionError, FlexKVError):
    """The connection is gone (closed by either side, or its outbound queue overflowed)."""


class Channel:
    def __init__(
        self,
        sock: socket.socket,
        name: str,
        max_queued: int = MAX_QUEUED_BYTES,
        on_close: Callable[[str], None] | None = None,
    ) -> None:
        self.sock, self.name = sock, name
        self._max_queued = max_queued
        self._queue: collections.deque[tuple[bytes, Sequence[int]]] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._closed: str | None = None
        self._on_close = on_close
        self._rbuf = bytearray()
        self._sending = False  # the writer holds a frame it took off the queue
        self._writer = threading.Thread(target=self._write_loop, name=f"flexkv-node-send-{name}", daemon=True)
        self._writer.start()

    @property
    def closed(self) -> str | None:
        """Why the channel closed, or None while it is open."""
        return self._closed

    def send(self, message: msgspec.Struct, fds: Sequence[int] = ()) -> None:
        frame = encode(message)
        with self._cond:
            if self._closed is not None:
                raise ChannelClosed(f"{self.name}: {self._closed}")
            try:
                frame, fds = self._send_now(frame, fds)
            except OSError as e:
                why = f"send failed: {e}"
            else:
                if not frame:
                    return
                if self._queued + len(frame) > self._max_queued:
                    why = f"more than {self._max_queued} bytes queued for a peer that does not read"
                else:
                    self._queue.append((frame, tuple(fds)))
                    self._queued += len(frame)
                    self._cond.notify()
                    return
        self.close(why)
        raise ChannelClosed(f"{self.name}: {why}")

    def _send_now(self, frame: bytes, fds: Sequence[int]) -> tuple[bytes, Sequence[int]]:
        """With nothing queued ahead (lock held): as much of ``frame`` as the socket takes without
        waiting, straight from this thread (a load's request and per-layer messages save the
        writer thread's wake-up, ~0.1 ms each way); returns what is left for the writer."""
        if self._queue or self._sending or self.sock.gettimeout() is not None:
            return frame, fds
        try:
            if fds:
                sent = socket.send_fds(self.sock, [frame], list(fds), socket.MSG_DONTWAIT)
            else:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return frame, fds
        return frame[sent:], (fds if sent == 0 else ())

    def frames(self) -> Iterator[tuple[bytes, list[int]]]:
        """Each received frame's body and the descriptors that came with its bytes; ends when the
        peer closes; ProtocolError on a frame this protocol refuses (oversized, cut off)."""
        fds: list[int] = []
        while True:
            while len(self._rbuf) < HEADER_BYTES:
                if not self._fill(fds):
                    if self._rbuf:
                        raise ProtocolError(f"{self.name}: the connection closed inside a frame header")
                    return
            n = frame_length(bytes(self._rbuf[:HEADER_BYTES]))
            while len(self._rbuf) < HEADER_BYTES + n:
                if not self._fill(fds):
                    raise ProtocolError(f"{self.name}: the connection closed inside a frame of {n} bytes")
            body = bytes(self._rbuf[HEADER_BYTES : HEADER_BYTES + n])
            del self._rbuf[: HEADER_BYTES + n]
            got, fds = fds, []
            yield body, got

    def _fill(self, fds: list[int]) -> bool:
        anc = socket.CMSG_SPACE(4 * array.array("i").itemsize)
        try:
            data, ancdata, _, _ = self.sock.recvmsg(1 << 20, anc)
        except TimeoutError:
            raise ChannelClosed(f"{self.name}: nothing received within {self.sock.gettimeout()} s") from None
        except OSError as e:
            if self._closed is not None:
                return False
            raise ChannelClosed(f"{self.name}: {e}") from None
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                fds.extend(got)
        if not data:
            return False
        self._rbuf += data
        return True

    def close(self, why: str = "closed", flush_s: float = 0.0) -> None:
        """Closes; with ``flush_s``, what is queued first gets that long to leave (a last Detach)."""
        with self._cond:
            deadline = time.monotonic() + flush_s
            while (self._queue or self._sending) and self._closed is None and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            if self._closed is not None:
                return
            self._closed = why
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._on_close is not None:
            self._on_close(why)

    def release(self) -> None:
        """Closes the socket itself once both sides are done with it (after close())."""
        self._writer.join(timeout=5)
        self.sock.close()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._closed is None:
                    self._cond.wait()
                if self._closed is not None:
                    return
                frame, fds = self._queue.popleft()
                self._queued -= len(frame)
                self._sending = True
            try:
                if fds:
                    sent = socket.send_fds(self.sock, [frame], list(fds))
                    if sent < len(frame):
                        self.sock.sendall(frame[sent:])
                else:
                    self.sock.sendall(frame)
            except OSError as e:
                with self._cond:
                    self._sending = False
                self.close(f"send failed: {e}")
                return
            with self._cond:
                self._sending = False
                self._cond.notify_all()  # a flushing close() waits for the queue to empty
