"""A test seam that loads wrong KV on purpose (FlexKVConnector's ``mover_hook`` setting,
``KVManager(mover_hook=...)``): every host->device load of two or more blocks writes the bytes of
its second block into its first, so the request attends to one 64-token block of other tokens'
keys and values, with valid checksums, exactly what a wrong index or a mixed-up slot would do.
The exactness tests' oracle (tokens and per-token logprobs against no offload, exactness.py) must
catch it: ``FLEXKV_TEST_WRONG_KV=1`` runs every vLLM exactness test with this hook, and they fail."""

from __future__ import annotations

import dataclasses
import logging

from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp

HOOK = "wrong_kv:one_wrong_block"
log = logging.getLogger(__name__)


class _SecondBlockIntoFirst:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.wrong_loads = 0

    def run(self, op: TransferOp) -> int:
        if op.src.size >= 2:
            src = op.src.copy()
            src[0] = src[1]
            if not self.wrong_loads:
                log.warning(
                    "wrong_kv: loading host block %d into device block %d instead of host block %d "
                    "(a test seam: every load gets one wrong block)",
                    op.src[1],
                    op.dst[0],
                    op.src[0],
                )
            self.wrong_loads += 1
            op = dataclasses.replace(op, src=src)
        return self.inner.run(op)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def one_wrong_block(kind: OpKind, mover):
    return _SecondBlockIntoFirst(mover) if kind is OpKind.H2D else mover
