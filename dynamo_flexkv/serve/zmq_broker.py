"""``python -m dynamo_flexkv.serve.zmq_broker XSUB XPUB``: the ZMQ event-plane broker the launcher
runs on loopback. With DYN_ZMQ_BROKER_URL set, Dynamo's publishers connect to it instead of each
binding a PUB socket on 0.0.0.0 (direct mode binds every interface), so nothing listens beyond
127.0.0.1."""

import signal
import sys

import zmq


def main(xsub: str, xpub: str) -> None:
    for endpoint in (xsub, xpub):
        if not endpoint.startswith("tcp://127.0.0.1:"):
            sys.exit(f"broker endpoints must be tcp://127.0.0.1:PORT, got {endpoint}")
    # Started from a background job (`make demo &`), a process inherits SIGINT ignored; the launcher
    # stops infrastructure with SIGINT, and would otherwise wait 30 s and SIGKILL the broker.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctx: zmq.Context = zmq.Context.instance()
    front, back = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    front.bind(xsub)
    back.bind(xpub)
    try:
        zmq.proxy(front, back)  # until SIGINT / SIGTERM
    except (KeyboardInterrupt, zmq.ContextTerminated):
        pass


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
