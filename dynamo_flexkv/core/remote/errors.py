"""The remote tier's errors: each names what is wrong and how to fix it."""

from dynamo_flexkv.core.errors import FlexKVError


class RemoteError(FlexKVError):
    """The remote tier cannot be used as configured; the message says why and how to fix it."""


class RemoteUnavailableError(RemoteError):
    pass


class RemoteAuthError(RemoteError):
    pass


class RemoteClosedError(RemoteError):
    pass
