"""The one reader of OpenAI server-sent event streams the tests share: each ``data:`` line of a
streamed completion as its JSON document, and ``DONE`` for the closing ``data: [DONE]``."""

import json
from collections.abc import Iterable, Iterator
from typing import Any

DONE = None  # what sse_data yields for ``data: [DONE]``


def sse_data(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any] | None]:
    """The documents of a stream's ``data:`` lines in order (other lines, e.g. comments and blank
    separators, are skipped); ``DONE`` for ``[DONE]``."""
    for raw in lines:
        line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        yield DONE if data == "[DONE]" else json.loads(data)
