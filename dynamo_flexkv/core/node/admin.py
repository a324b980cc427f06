"""An operator's connection to the node cache service (``dynamo-flexkv cache --socket``): it never
attaches, sends Admin requests (protocol.py) and reads their Replies."""

from __future__ import annotations

import itertools
import socket

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.inventory import NO_TOKENIZER, CacheReport, CacheRequest, parse_report
from dynamo_flexkv.core.node.protocol import (
    HEADER_BYTES,
    Admin,
    Reply,
    decode_to_engine,
    encode,
    frame_length,
)


class AdminError(RuntimeError, FlexKVError):
    """The service refused the request (the message names why) or cannot be reached."""


class NodeAdmin:
    """``with NodeAdmin(path) as admin: admin.request(CacheRequest(op="contents"))``."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except FileNotFoundError:
            self.sock.close()
            raise AdminError(
                f"no cache server socket at {path}: start one (dynamo-flexkv cache-server --socket {path}) or "
                "name the socket it listens on (its ready line, or RUN_DIR/node-cache.sock under serve)"
            ) from None
        except OSError as e:
            self.sock.close()
            raise AdminError(
                f"cannot connect to the cache server at {path} ({e.strerror or e}): is it running, and as your user?"
            ) from None
        self._ids = itertools.count(1)

    def request(self, req: CacheRequest) -> CacheReport:
        if req.op == "prefix" and req.tokens is None and req.text is not None:
            raise AdminError(NO_TOKENIZER)  # the protocol carries token ids only
        rid = next(self._ids)
        msg = Admin.of(rid, req)
        self.sock.settimeout(req.wait_s + 30.0)  # a clear first waits for the writes in flight
        try:
            self.sock.sendall(encode(msg))
            while True:
                reply = decode_to_engine(self._frame())
                if isinstance(reply, Reply) and reply.id in (rid, 0):
                    break
        except (TimeoutError, ConnectionError) as e:
            raise AdminError(f"the cache server at {self.path} did not answer: {e}") from None
        if reply.error is not None:
            if reply.kind == "protocol":  # a service from before Admin requests
                raise AdminError(
                    f"the cache server at {self.path} does not take admin requests ({reply.error}): upgrade "
                    "dynamo-flexkv where it runs and restart it"
                )
            raise AdminError(reply.error)
        return parse_report(reply.value)

    def _frame(self) -> bytes:
        header = self._exact(HEADER_BYTES)
        return self._exact(frame_length(header))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the cache server closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> NodeAdmin:
        return self

    def __exit__(self, *exc: BaseException | None) -> None:
        self.close()
