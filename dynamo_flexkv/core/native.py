"""The one access point to the C++ core (native/, built as the extension ``dynamo_flexkv.core._native``):
every module that calls native code imports this one, ``from dynamo_flexkv.core import native``, so
which extension is loaded, and when, is decided here (importing this module loads it). The code
calls the names bound here: a test that replaces one patches it on this module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dynamo_flexkv.core._native as extension

PATH = extension.__file__  # where the loaded extension lives (dynamo-flexkv doctor reports it)
# Its functions and constants as this module's own names (a plain lookup on the hot paths).
globals().update({name: getattr(extension, name) for name in dir(extension) if not name.startswith("__")})


# Declared for type checkers (bound by the update above): a module that calls it at import time
# (core/index/tier_index.py) is checked before __getattr__ below is, inside an import cycle.
set_index_error_types: Callable[[type[BaseException], type[BaseException]], None]


def __getattr__(name: str) -> Any:  # what type checkers see: the names come from the extension
    return getattr(extension, name)
