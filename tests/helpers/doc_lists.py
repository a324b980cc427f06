"""What the docs keep by hand, read back for the tests that hold them true to the code: the metric
names a doc's code spans name, and one section of a doc."""

from __future__ import annotations

import re
from pathlib import Path


def documented_metrics(text: str) -> set:
    """The metric names in ``text``'s code spans: ``{a,b}`` inside a name is each alternative,
    ``{labels}`` at its end is dropped."""
    names = set()
    for span in re.findall(r"`([^`]+)`", text):
        span = re.sub(r"\{[^{}]*\}$", "", span.strip())
        alternatives = re.match(r"^(.*?)\{([^{}]*)\}(.*)$", span)
        expanded = (
            [alternatives.group(1) + a + alternatives.group(3) for a in alternatives.group(2).split(",")]
            if alternatives
            else [span]
        )
        names.update(n for n in expanded if re.fullmatch(r"flexkv_[a-z_]+", n))
    return names


def section(doc: Path, heading: str) -> str:
    text = doc.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]
