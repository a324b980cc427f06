"""An engine attached to the node cache in a process of its own, for tests that kill it mid-copy
(tests/integration/test_node_cache.py). Prints a line at each step it reaches, flushed:

    python tests/helpers/node_engine.py SOCKET store SEED TOKENS        # stores, prints "stored", waits on stdin
    python tests/helpers/node_engine.py SOCKET store-hang SEED TOKENS   # its device->host copy stops midway: "copying"
    python tests/helpers/node_engine.py SOCKET load-hang SEED TOKENS    # its host->device copy stops midway: "copying"
"""

import sys
import threading

from node_helpers import Engine, prompt

from dynamo_flexkv.core.transfer.graph import OpKind


class Hang:
    """A mover hook whose ``kind`` copies write part of their bytes, say so, and never return."""

    def __init__(self, kind):
        self.kind = kind

    def __call__(self, kind, mover):
        if kind is not self.kind:
            return mover

        class Stuck:
            def run(self, op):
                half = op.src.size // 2
                if half:
                    op_part = type(op)(op.kind, op.src[:half], op.dst[:half], layers=op.layers)
                    mover.run(op_part)  # half the blocks' bytes land: a torn copy if it were committed
                print("copying", flush=True)
                threading.Event().wait()

        return Stuck()


def main() -> int:
    socket_path, mode, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hook = {"store-hang": Hang(OpKind.D2H), "load-hang": Hang(OpKind.H2D)}.get(mode)
    engine = Engine(socket_path, f"proc-{mode}", mover_hook=hook)
    print("attached", flush=True)
    tokens = prompt(seed, n)
    blocks = list(range(n // 16))
    if mode == "load-hang":
        engine.offload.load(tokens, blocks, 0)
    elif mode == "store-hang":
        engine.fill(tokens, blocks)
        engine.offload.store(tokens, blocks, key="r")
    else:
        engine.store(tokens, blocks)
        print("stored", flush=True)
    sys.stdin.readline()  # until the test closes our stdin or kills us
    engine.offload.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
