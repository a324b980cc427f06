"""The worker's engine class driven directly, the way Dynamo's Worker calls it (generate, abort,
cleanup), without a frontend: stream ends, aborts by abort(context) and by closing the stream,
refusals as InvalidArgument, and an engine thread that dies fails its requests instead of hanging
them and stops its worker."""

import asyncio
import time

import pytest

pytest.importorskip("dynamo.common.backend", reason="ai-dynamo is installed by make test")

from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from dynamo_flexkv.integrations.dynamo_worker import component
from dynamo_flexkv.integrations.dynamo_worker.args import build_parser
from dynamo_flexkv.integrations.dynamo_worker.component import FlexKVWorkerEngine


class Context:
    """What generate() and abort() use of Dynamo's request context."""

    def __init__(self, request_id: str) -> None:
        self._id = request_id

    def id(self) -> str:
        return self._id


def request(tokens, max_tokens):
    return {"token_ids": tokens, "stop_conditions": {"max_tokens": max_tokens}, "sampling_options": {}}


def blocks_in_use(worker) -> int:
    pool = worker.engine.pool
    return pool.num_blocks - pool.num_available


async def until_idle(worker, timeout=5.0):
    deadline = time.monotonic() + timeout
    while blocks_in_use(worker) or worker.live_requests:
        assert time.monotonic() < deadline, (blocks_in_use(worker), worker.live_requests)
        await asyncio.sleep(0.01)


def test_generate_abort_close_and_engine_failure(tmp_path):
    args = build_parser().parse_args(
        [
            "--model",
            "tiny",
            "--model-dir",
            str(tmp_path / "model"),
            "--no-offload",
            "--num-device-blocks",
            "64",
            "--drain-timeout",
            "2",
        ]
    )
    worker = FlexKVWorkerEngine(args)

    async def scenario():
        await worker.start(0)
        try:
            chunks = [c async for c in worker.generate(request(list(range(1, 40)), 3), Context("a"))]
            assert len(chunks) == 3 and chunks[-1]["finish_reason"] in ("length", "stop")
            assert chunks[-1]["completion_usage"]["prompt_tokens"] == 39
            assert chunks[-1]["engine_data"]["flexkv"]["cached_tokens"] == {"device": 0, "host": 0, "disk": 0}

            # Dynamo's abort(context) in the middle of a stream: it ends "cancelled".
            stream = worker.generate(request(list(range(1, 40)), 500), Context("b"))
            await stream.__anext__()
            await worker.abort(Context("b"))
            rest = [c async for c in stream]
            assert rest[-1]["finish_reason"] == "cancelled" and len(rest) < 400
            await until_idle(worker)

            # The client's stream closed without an abort call: the request stops too.
            stream = worker.generate(request(list(range(1, 40)), 500), Context("c"))
            await stream.__anext__()
            await stream.aclose()
            await until_idle(worker)
            assert worker.tally.aborted == 2 and worker.tally.requests == 1

            with pytest.raises(InvalidArgument, match="context window is 1,024"):
                await worker.generate(request([1] * 2000, 1), Context("d")).__anext__()

            # The engine thread dies: the request in flight fails, later ones are refused at once.
            def broken_step():
                raise RuntimeError("injected engine fault")

            stops: list = []
            worker.stop_worker = lambda: stops.append("SIGTERM")
            worker.engine.step = broken_step
            with pytest.raises(EngineShutdown, match="injected engine fault"):
                [c async for c in worker.generate(request([5, 6, 7], 2), Context("e"))]
            with pytest.raises(EngineShutdown, match="retry on another worker"):
                await worker.generate(request([5, 6, 7], 2), Context("f")).__anext__()
            # It stops itself (so serve or the pod's policy starts a fresh one) and exits non-zero.
            deadline = time.monotonic() + 10
            while not stops and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert stops == ["SIGTERM"] and component.engine_failed
        finally:
            await worker.cleanup()
            await worker.cleanup()  # idempotent

    asyncio.run(scenario())
