"""``python -m dynamo_flexkv.integrations.dynamo_worker``: the Dynamo worker component
(see dynamo_flexkv.integrations.dynamo_worker.component)."""

import signal

from dynamo_flexkv.integrations.dynamo_worker.args import build_parser, check_event_plane_binds_loopback, on_sigint


def main() -> None:
    signal.signal(signal.SIGINT, on_sigint)  # before the heavy imports: a stop while starting is quiet
    # Refuse a setup that would listen beyond loopback before the runtime is even imported.
    check_event_plane_binds_loopback(build_parser().parse_args().event_plane)
    from dynamo_flexkv.integrations.dynamo_worker.component import main as run_worker

    run_worker()


if __name__ == "__main__":
    main()
