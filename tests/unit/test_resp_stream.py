"""The RESP reader against a real TCP peer that sends scripted bytes, split anywhere.

Redis sends a reply in whatever pieces the kernel makes of it; these tests choose the pieces, so
every boundary (inside a reply line, a header, a payload, the CRLF after it) is crossed, on the
native path (plain sockets) and on the Python one (what TLS connections use), with the same
results."""

from __future__ import annotations

import platform
import random
import socket
import threading
import time

import pytest
import xxhash

from dynamo_flexkv.core.remote.resp import ProtocolError, ReplyError, RespConnection

HEADER = 48  # any fixed header length: the reader only needs it and the payload's


class ScriptedPeer:
    """A loopback server that, once a client connects, sends ``pieces`` one by one (a pause
    between them lets each arrive alone), then closes or holds the connection open."""

    def __init__(
        self, pieces: list[bytes], pause_s: float = 0.0, hold_open: bool = False, gate: threading.Event | None = None
    ) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pieces, self._pause, self._hold, self._gate = pieces, pause_s, hold_open, gate
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i, p in enumerate(self._pieces):
                if i == 1 and self._gate is not None:
                    self._gate.wait(30)  # the rest only when the test says
                conn.sendall(p)
                if self._pause:
                    time.sleep(self._pause)  # pacing the sender, not waiting for a result
            if self._hold:
                self._done.wait(30)

    def close(self) -> None:
        self._done.set()
        self._thread.join(30)
        self._listener.close()


def connect(peer: ScriptedPeer, timeout_s: float = 10, native: bool = True) -> RespConnection:
    return RespConnection("127.0.0.1", peer.port, timeout_s=timeout_s, connect_timeout_s=5, native_reads=native)


def split(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` in pieces of 1 byte to 20 KiB, cut anywhere."""
    out, i = [], 0
    while i < len(data):
        n = rng.choice([1, 2, 3, 7, rng.randint(1, 300), rng.randint(1, 20000)])
        out.append(data[i : i + n])
        i += n
    return out


def bulk(payload: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(payload), payload)


Expected = tuple[str, object]


def script(rng: random.Random, size: int, count: int) -> tuple[bytes, list[Expected]]:
    """A pipeline's replies: mostly values of the expected size, and every other kind."""
    data, want = [], []
    for _ in range(count):
        kind = rng.choice(["value"] * 6 + ["nil", "error", "short", "long", "status", "int"])
        if kind == "value":
            header, payload = rng.randbytes(HEADER), rng.randbytes(size)
            data.append(bulk(header + payload))
            want.append(("value", (header, payload)))
        elif kind == "nil":
            data.append(b"$-1\r\n")
            want.append(("reply", None))
        elif kind == "error":
            data.append(b"-MOVED 3999 127.0.0.1:6381\r\n")
            want.append(("reply", ReplyError("MOVED 3999 127.0.0.1:6381")))
        elif kind in ("short", "long"):
            v = rng.randbytes(HEADER + size + (-1 if kind == "short" else 1))
            data.append(bulk(v))
            want.append(("reply", v))
        elif kind == "status":
            data.append(b"+OK\r\n")
            want.append(("reply", "OK"))
        else:
            data.append(b":42\r\n")
            want.append(("reply", 42))
    return b"".join(data), want


def read_script(conn: RespConnection, size: int, want: list[Expected]) -> int:
    """Reads the replies as the store does; returns how many values the one-call path took."""
    header, dest = memoryview(bytearray(HEADER)), memoryview(bytearray(size))
    whole = 0
    for i, (kind, value) in enumerate(want):
        got: int | None = conn.read_bulk(header, dest)
        whole += got is not None
        if got is None:  # another reply, or a value whose line has not all arrived
            if kind == "value":
                line = conn.readline()
                assert line == b"$%d" % (HEADER + size)
                conn.read_into(header)
                got = conn.read_into(dest, checksum=True)
                conn.expect_crlf()
            else:
                assert conn.read_reply() == value, f"reply {i}"
                continue
        assert kind == "value", f"reply {i}: read as a value"
        assert (bytes(header), bytes(dest)) == value, f"reply {i}: other bytes"
        assert got == xxhash.xxh3_64_intdigest(value[1]), f"reply {i}: wrong checksum"
    return whole


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("size", [0, 1, 4096, 128 << 10])
def test_replies_split_anywhere_read_exactly(native, size):
    rng = random.Random(size * 2 + native)
    whole = 0
    for _ in range(3):
        data, want = script(rng, size, 40)
        peer = ScriptedPeer(split(data, rng))
        conn = connect(peer, native=native)
        try:
            whole += read_script(conn, size, want)
        finally:
            conn.close()
            peer.close()
    assert (whole > 0) == native  # TLS's path never takes it


def test_one_byte_at_a_time_with_pauses():
    """Every piece arrives alone: each wait inside the native read is taken."""
    rng = random.Random(7)
    data, want = script(rng, 200, 6)
    peer = ScriptedPeer([data[i : i + 1] for i in range(len(data))], pause_s=0.0005)
    conn = connect(peer)
    try:
        read_script(conn, 200, want)
    finally:
        conn.close()
        peer.close()


def test_a_payload_without_its_crlf_is_a_protocol_error():
    payload = bytes(HEADER + 1000)
    peer = ScriptedPeer([b"+OK\r\n$%d\r\n" % len(payload) + payload + b"XX"])
    conn = connect(peer)
    try:
        assert conn.read_reply() == "OK"  # the reply after it has arrived with it
        with pytest.raises(ProtocolError, match="not followed by CRLF"):
            conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(1000)))
    finally:
        conn.close()
        peer.close()


@pytest.mark.parametrize("cut", ["line", "header", "payload", "crlf"])
def test_peer_closing_mid_reply_is_a_connection_error(cut):
    payload = bytes(range(256)) * 40
    whole = bulk(bytes(HEADER) + payload)
    at = {"line": 3, "header": 10 + HEADER // 2, "payload": 10 + HEADER + 5000, "crlf": len(whole) - 1}[cut]
    peer = ScriptedPeer([b"+OK\r\n" + whole[:at]], pause_s=0.05)
    conn = connect(peer)
    try:
        assert conn.read_reply() == "OK"
        with pytest.raises(ConnectionError, match="closed the connection"):
            got = conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(len(payload))))
            assert got is None  # only a line cut short leaves it to the general path
            conn.readline()
    finally:
        conn.close()
        peer.close()


def test_a_stalled_peer_times_out_within_the_timeout():
    payload = bytes(HEADER + 100000)
    peer = ScriptedPeer([b"+OK\r\n$%d\r\n" % len(payload) + payload[:5000]], hold_open=True)
    conn = connect(peer, timeout_s=0.3)
    try:
        assert conn.read_reply() == "OK"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply data for 300 ms"):
            conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(100000)))
        assert time.monotonic() - t0 < 10
    finally:
        conn.close()
        peer.close()


def test_a_closed_connection_never_reads_through_its_old_descriptor():
    peer = ScriptedPeer([bulk(bytes(HEADER + 10))], hold_open=True)
    conn = connect(peer)
    conn.close()
    try:
        assert conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(10))) is None
        with pytest.raises(OSError):
            conn.read_into(memoryview(bytearray(10)))
    finally:
        peer.close()


@pytest.mark.parametrize("timeout_s", [None, 2147484.0, 1e7])
def test_any_socket_timeout_reads(timeout_s):
    """None waits forever and timeouts past poll()'s 24.8-day limit are clamped, as the socket
    path takes them, instead of refusing the call."""
    peer = ScriptedPeer([bulk(bytes(HEADER) + b"x" * 100)], hold_open=True)
    conn = connect(peer, timeout_s=timeout_s)
    try:
        assert (
            conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(100))) is not None
            or conn.read_reply() == bytes(HEADER) + b"x" * 100
        )
    finally:
        conn.close()
        peer.close()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86-64 syscall numbers")
def test_close_wakes_a_reader_waiting_in_another_thread():
    """Connections are not shared, but if one is closed under a waiting read, that read fails as
    closed at once instead of waiting out its timeout (or reading a reused descriptor)."""
    peer = ScriptedPeer([b"+OK\r\n$%d\r\n" % (HEADER + 100000) + bytes(500)], hold_open=True)
    conn = connect(peer, timeout_s=60)
    assert conn.read_reply() == "OK"
    errors: list[BaseException] = []

    def read() -> None:
        try:
            conn.read_bulk(memoryview(bytearray(HEADER)), memoryview(bytearray(100000)))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while reader.is_alive() and not in_poll(reader) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert in_poll(reader), "the read never waited for its payload"
        conn.close()
        reader.join(30)
        assert not reader.is_alive(), "the read kept waiting after close"
        assert errors and isinstance(errors[0], OSError)
    finally:
        peer.close()


def in_poll(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in poll (x86-64 poll/ppoll), not waiting for the GIL."""
    with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
        return f.read().split()[0] in ("7", "271")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86-64 syscall numbers")
def test_a_destination_cannot_be_resized_while_a_read_fills_it():
    """The buffer stays exported for the whole native read: once the read waits for its payload,
    releasing the view and resizing the bytearray is refused, never a write into freed memory."""
    payload = b"Z" * 4096
    gate = threading.Event()
    peer = ScriptedPeer([b"+OK\r\n$%d\r\n" % len(payload), payload], gate=gate)
    conn = connect(peer)
    assert conn.read_reply() == "OK" and conn.readline() == b"$4096"
    dest = bytearray(len(payload))
    view = memoryview(dest)
    reader = threading.Thread(target=conn.read_into, args=(view,))
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not in_poll(reader) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert in_poll(reader), "the read never waited for its payload"
        with pytest.raises(BufferError):
            view.release()
        with pytest.raises(BufferError):
            dest.extend(bytes(1 << 20))
        gate.set()
        reader.join(30)
        assert bytes(dest) == payload
    finally:
        gate.set()
        conn.close()
        peer.close()


@pytest.mark.parametrize("line", [b"$abc\r\n", b":x\r\n", b"*1z\r\n"])
def test_a_length_that_is_not_a_number_is_a_protocol_error(line):
    peer = ScriptedPeer([line])
    conn = connect(peer)
    try:
        with pytest.raises(ProtocolError, match="not a number"):
            conn.read_reply()
    finally:
        conn.close()
        peer.close()
