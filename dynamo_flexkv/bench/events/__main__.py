"""Entry point of the router and publisher processes: ``python -m dynamo_flexkv.bench.events ROLE CFG``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence

from dynamo_flexkv.bench.events.publisher import publisher_main
from dynamo_flexkv.bench.events.router import router_main


def main_child(argv: Sequence[str]) -> None:
    role, cfg = argv[0], json.loads(argv[1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    coro = {"router": router_main, "publisher": publisher_main}[role](cfg)
    code = 0
    try:
        asyncio.run(coro)
    except BaseException:  # noqa: BLE001 - printed with its traceback; the orchestrator shows this log's tail
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the runtime keeps background tasks; nothing left to flush


if __name__ == "__main__":
    main_child(sys.argv[1:])
