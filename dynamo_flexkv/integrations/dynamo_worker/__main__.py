"""``python -m dynamo_flexkv.integrations.dynamo_worker``: the Dynamo worker component
(see dynamo_flexkv.integrations.dynamo_worker.component)."""

import logging
import signal
from typing import Any

from dynamo_flexkv.integrations.dynamo_worker.args import build_parser, check_event_plane_binds_loopback, on_sigint


def name_our_records() -> None:
    """Dynamo's log bridge names a Python record by its module and function (``component.start``);
    this package's records are named by their logger instead
    (``dynamo_flexkv.integrations.dynamo_worker.component.start``), so a reader, and serve's quiet
    console (dynamo_flexkv.serve.logs), can tell our lines from Dynamo's."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith("dynamo_flexkv"):
            record.module = record.name
        return record

    logging.setLogRecordFactory(factory)


def main() -> None:
    signal.signal(signal.SIGINT, on_sigint)  # before the heavy imports: a stop while starting is quiet
    name_our_records()
    # Refuse a setup that would listen beyond loopback before the runtime is even imported.
    check_event_plane_binds_loopback(build_parser().parse_args().event_plane)
    from dynamo_flexkv.integrations.dynamo_worker.component import main as run_worker

    run_worker()


if __name__ == "__main__":
    main()
