"""What a NIXL read of a peer's KV ends in when it cannot be used (core/transfer/nixl_agent.py):
light, so a handover's payload (integrations/disagg/params.py) is checked without torch or NIXL."""

from collections.abc import Sequence

from dynamo_flexkv.core.errors import FlexKVError


class HandoverRefused(ValueError, FlexKVError):
    """The reader cannot use this handover or pull (a different model layout, a malformed payload);
    it recomputes the prompt instead."""


class HandoverFailed(IOError, FlexKVError):
    """A pull did not complete (peer gone, transfer error, timeout): the reader recomputes."""


class HandoverCorrupt(HandoverFailed):
    """A pull completed but a block's bytes do not hash to the source's checksum."""


class ReadNotCancelled(RuntimeError, FlexKVError):
    """A read that failed or timed out, which NIXL refused to cancel and which did not end within
    its settle time: it may still write into ``local_blocks``, so they must never be reused while
    this process lives. Not a HandoverFailed: a caller that recomputes into the same blocks must
    not catch it (an engine's own blocks: the worker ends and its supervisor restarts it)."""

    def __init__(self, message: str, local_blocks: Sequence[int]) -> None:
        super().__init__(message)
        self.local_blocks = list(local_blocks)
