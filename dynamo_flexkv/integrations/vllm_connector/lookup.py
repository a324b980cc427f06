"""How the scheduler asks the worker's tiers how much of a prompt they hold.

vLLM runs its scheduler and its workers in separate processes, and the tiers (and their index)
live with the worker that owns the KV tensors. Each rank's worker answers lookups on a local
ipc:// socket of its own, and the scheduler takes the smallest answer (with tensor parallelism a
block is cached only when every rank holds its shard). The scheduler never waits long:
``LookupClient.query`` waits ``wait_s`` for the answer and otherwise says "not yet" (None), and
vLLM asks again at its next step; an answer that has
not come after ``give_up_s`` counts as a miss (the request is computed, nothing hangs).

A lookup with a usable router hint pulls the hinted blocks first (hints.py), which takes
milliseconds to the pull's timeout: the worker answers it from a thread of its own once the pull
is over, so a pull never holds up the other requests' lookups (their scheduler hears "not yet"
for the hinted one meanwhile, and asks again next step)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import zmq

from dynamo_flexkv.core.node.protocol import pack_tokens

log = logging.getLogger(__name__)

# (token ids, lora name, cache salt, the whole prompt's length, blocks vLLM holds already) -> end
# of the prefix to load, in tokens (the load policy's decision: the cost model compares loading
# the blocks beyond vLLM's with recomputing them, in a prompt that long)
# A router hint rides along as (source endpoint, leading blocks it names, why unusable or ""), or
# None (hints.py): the worker pulls what it lacks of those blocks before it answers.
Hint = tuple[str, int, str] | None
LookupFn = Callable[[np.ndarray, str | None, str | None, int, int, Hint], int]
ResetFn = Callable[[], bool]  # drops what the tiers hold; False when it could not
AdminFn = Callable[[bytes], bytes]  # an operator's cache request as JSON -> its answer as JSON
RESET_SEQ = -1  # the sequence number of a reset request (lookups count up from 1)
# An operator's request (dynamo-flexkv cache --vllm, core/inventory.py): frames [seq, b"", JSON],
# answered [seq, JSON] from a thread of its own (a clear may wait for writes: lookups go on).
ADMIN_SEQ = -2


class LookupServer:
    """Answers lookups on ``endpoint`` from a thread of its own until close()."""

    def __init__(
        self, endpoint: str, lookup: LookupFn, reset: ResetFn | None = None, admin: AdminFn | None = None
    ) -> None:
        self.endpoint, self._lookup, self._reset, self._admin = endpoint, lookup, reset, admin
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self.answered = self.failed = 0
        # Hinted lookups run here, one at a time (pulls share the host agent and a link per source);
        # their answers, and operators' (admin), come back through ``_done`` (the frames to send,
        # whether a lookup's) and a byte on the pipe wakes the socket's thread, the only one to send.
        self._pulls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexkv-hint-pull")
        self._done: queue.SimpleQueue[tuple[list[bytes], bool]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._serve, name="flexkv-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._wake_r in ready:
                self._send_deferred()
            if self._sock not in ready:
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 4:
                log.warning("flexkv lookup: dropped a message of %d frames (expected 4)", len(frames))
                continue
            ident, seq, tokens, extra = frames
            if struct.unpack("<q", seq)[0] == RESET_SEQ:
                self._sock.send_multipart([ident, seq, struct.pack("<q", int(self._answer_reset()))])
                continue
            if struct.unpack("<q", seq)[0] == ADMIN_SEQ:
                threading.Thread(
                    target=self._answer_admin, args=(ident, seq, extra), name="flexkv-cache-admin", daemon=True
                ).start()
                continue
            try:
                lora, salt, prompt_tokens, local_blocks, *rest = msgspec.msgpack.decode(extra)
                hint = (str(rest[0][0]), int(rest[0][1]), str(rest[0][2])) if rest and rest[0] else None
                # the ids stay a uint32 array: the tiers hash it and the node client sends it as is
                args = (np.frombuffer(tokens, dtype="<u4"), lora, salt, int(prompt_tokens), int(local_blocks), hint)
            except Exception:  # a lookup that cannot be read is a miss
                log.exception("flexkv lookup: a request that does not decode; answering 0 cached tokens")
                self.failed += 1
                args = None
            if args is not None and hint is not None and not hint[2]:  # a pull first: off this thread
                self._pulls.submit(self._deferred, ident, seq, args)
                continue
            n = 0 if args is None else self._answer(args)
            self._sock.send_multipart([ident, seq, struct.pack("<q", n)])
            self.answered += 1
        self._sock.close()

    def _answer(self, args: tuple) -> int:
        try:
            return int(self._lookup(*args))
        except Exception:  # a lookup that fails is a miss, the worker goes on
            log.exception("flexkv lookup failed; answering 0 cached tokens (the request is computed)")
            self.failed += 1
            return 0

    def _deferred(self, ident: bytes, seq: bytes, args: tuple) -> None:
        self._post([ident, seq, struct.pack("<q", self._answer(args))], lookup=True)

    def _post(self, frames: list[bytes], lookup: bool) -> None:
        """Hands an answer made on another thread to the socket's thread."""
        self._done.put((frames, lookup))
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # closed: nobody is left to answer
            pass

    def _send_deferred(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                frames, lookup = self._done.get_nowait()
            except queue.Empty:
                return
            self._sock.send_multipart(frames)
            self.answered += int(lookup)

    def _answer_reset(self) -> bool:
        if self._reset is None:
            return False
        try:
            return bool(self._reset())
        except Exception:  # the scheduler hears "not reset", the worker goes on
            log.exception("flexkv: resetting the tiers failed")
            return False

    def _answer_admin(self, ident: bytes, seq: bytes, body: bytes) -> None:
        if self._admin is None:
            answer = b'{"status": "error", "message": "this worker answers no cache requests"}'
        else:
            try:
                answer = self._admin(body)
            except Exception as e:  # the operator hears it, the worker goes on
                log.exception("flexkv: a cache request failed")
                answer = msgspec.json.encode({"status": "error", "message": f"{type(e).__name__}: {e}"})
        self._post([ident, seq, answer], lookup=False)

    def close(self) -> None:
        """Stops answering and removes the socket file (an ipc:// endpoint is a file)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._pulls.shutdown(wait=True, cancel_futures=True)  # a running pull ends by its timeout
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://") :])
            except FileNotFoundError:
                pass


class LookupClient:
    """The scheduler's side: one outstanding lookup per request id, asked of every rank's worker
    (``endpoints``: one per tensor-parallel rank). The answer is the smallest: a block counts as
    cached only when every rank holds its shard of it."""

    def __init__(self, endpoints: str | Sequence[str], wait_s: float = 0.005, give_up_s: float = 2.0) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.endpoint = self.endpoints[0]
        self.wait_s, self.give_up_s = wait_s, give_up_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks = []
        for ep in self.endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep)
            self._socks.append(sock)
        self._poller = zmq.Poller()
        for sock in self._socks:
            self._poller.register(sock, zmq.POLLIN)
        self._seq = 0
        self._asked: dict[str, tuple[int, float]] = {}  # request id -> (seq, when asked)
        self._by_seq: dict[int, str] = {}
        self._answers: dict[str, dict[int, int]] = {}  # request id -> rank -> its answer
        self._reset_answers: dict[int, int] = {}
        self.timeouts = 0

    def query(
        self,
        req_id: str,
        tokens: Sequence[int],
        lora: str | None = None,
        salt: str | None = None,
        prompt_tokens: int | None = None,
        local_blocks: int = 0,
        hint: Hint = None,
    ) -> int | None:
        """End of ``tokens``' cached prefix to load, in tokens (``prompt_tokens``: the whole
        prompt's length, default one more than ``tokens``; ``local_blocks``: blocks vLLM holds
        already; ``hint``: a router hint, pulled from before the answer); None while an answer
        is still on its way."""
        if req_id not in self._asked:
            self._seq += 1
            self._asked[req_id] = (self._seq, time.monotonic())
            self._by_seq[self._seq] = req_id
            self._answers[req_id] = {}
            frames = [
                struct.pack("<q", self._seq),
                pack_tokens(tokens),
                msgspec.msgpack.encode(
                    [lora, salt, prompt_tokens or len(tokens) + 1, local_blocks]
                    + ([list(hint)] if hint is not None else [])
                ),
            ]
            for sock in self._socks:
                sock.send_multipart(frames)
        deadline = time.monotonic() + self.wait_s
        while not self._complete(req_id):
            left = deadline - time.monotonic()
            if left <= 0 or not self._poller.poll(max(1, int(left * 1000))):
                break
            self._receive()
        if self._complete(req_id):
            answer = min(self._answers[req_id].values())
            self.forget(req_id)
            return answer
        if time.monotonic() - self._asked[req_id][1] > self.give_up_s:
            missing = len(self._socks) - len(self._answers[req_id])
            self.forget(req_id)
            self.timeouts += 1
            log.warning(
                "flexkv lookup for request %s: %d of %d worker(s) did not answer in %.1f s: computing it",
                req_id,
                missing,
                len(self._socks),
                self.give_up_s,
            )
            return 0
        return None

    def _complete(self, req_id: str) -> bool:
        return len(self._answers.get(req_id, ())) == len(self._socks)

    def reset(self, timeout_s: float) -> bool:
        """Asks every rank's worker to drop what its tiers hold; True once all did, False when
        one could not or did not answer within ``timeout_s``."""
        self._reset_answers = {}
        for sock in self._socks:
            sock.send_multipart([struct.pack("<q", RESET_SEQ), b"", msgspec.msgpack.encode([None, None, 0, 0])])
        deadline = time.monotonic() + timeout_s
        while len(self._reset_answers) < len(self._socks):
            left = deadline - time.monotonic()
            if left <= 0 or not self._poller.poll(max(1, int(left * 1000))):
                break
            self._receive()
        answers, self._reset_answers = self._reset_answers, {}
        return len(answers) == len(self._socks) and all(a == 1 for a in answers.values())

    def _receive(self) -> None:
        for rank, sock in enumerate(self._socks):
            while True:
                try:
                    seq, n = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if struct.unpack("<q", seq)[0] == RESET_SEQ:
                    self._reset_answers[rank] = struct.unpack("<q", n)[0]
                    continue
                rid = self._by_seq.get(struct.unpack("<q", seq)[0])
                if rid is not None and rid in self._asked:  # else: forgotten meanwhile
                    self._answers[rid][rank] = struct.unpack("<q", n)[0]

    def forget(self, req_id: str) -> None:
        """Drops what is pending for a request that finished or was aborted."""
        asked = self._asked.pop(req_id, None)
        if asked is not None:
            self._by_seq.pop(asked[0], None)
        self._answers.pop(req_id, None)

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
