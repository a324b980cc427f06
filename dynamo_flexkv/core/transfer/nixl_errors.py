"""What a NIXL read of a peer's KV ends in when it cannot be used (core/transfer/nixl_agent.py):
light, so a handover's payload (integrations/disagg/params.py) is checked without torch or NIXL."""

from dynamo_flexkv.core.errors import FlexKVError


class HandoverRefused(ValueError, FlexKVError):
    """The reader cannot use this handover or pull (a different model layout, a malformed payload);
    it recomputes the prompt instead."""


class HandoverFailed(IOError, FlexKVError):
    """A pull did not complete (peer gone, transfer error, timeout): the reader recomputes."""


class HandoverCorrupt(HandoverFailed):
    """A pull completed but a block's bytes do not hash to the source's checksum."""
