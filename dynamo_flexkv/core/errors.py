"""The one base of every exception dynamo_flexkv defines: ``except FlexKVError`` catches any of
them. Each also keeps the built-in base it had (ValueError, RuntimeError, OSError, ...), so callers
that catch those still do. Imports nothing: any module, light or heavy, may use it."""


class FlexKVError(Exception):
    """Base of every dynamo_flexkv exception (each also derives from its own built-in base)."""


__all__ = ["FlexKVError"]
