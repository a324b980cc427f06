"""One result format for every benchmark: a human table and JSON lines.

Each case carries our number and the baseline measured in the same run, so ratios stay
meaningful on shared machines whose absolute speed drifts.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO


@dataclass(frozen=True)
class Case:
    bench: str
    case: str
    ours: float
    baseline: float
    unit: str
    baseline_name: str = ""
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("inf")

    def to_json(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def paired_cases(
    cases: Sequence[Case], labels: Sequence[str], same_case: Sequence[tuple[str, str, str]]
) -> Iterator[tuple[str, str, str, Case, Case]]:
    """The cases both sides of a comparison measured: for each size label, then each ``(ours, other,
    what)`` of ``same_case`` (case-name stems, without the size label), ``(label, ours, what, our case,
    the other's case)`` where both ``<ours>-<label>`` and ``<other>-<label>`` are among ``cases``."""
    by = {c.case: c for c in cases}
    for lab in labels:
        for ours, other, what in same_case:
            a, b = by.get(f"{ours}-{lab}"), by.get(f"{other}-{lab}")
            if a is not None and b is not None:
                yield lab, ours, what, a, b


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(cases: Iterable[Case], out: TextIO | None = None, lower_is_better: bool = True) -> None:
    rows: list[Case] = list(cases)
    if not rows:
        return
    better = "lower is better" if lower_is_better else "higher is better"
    width = max(24, *(len(c.case) for c in rows))
    header = f"{'case':<{width}} {'ours':>12} {'baseline':>12} {'unit':<9} {'ratio':>7}  baseline"
    print(f"\n== bench {rows[0].bench}  (ratio = ours / baseline, {better})", file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    for c in rows:
        print(
            f"{c.case:<{width}} {c.ours:>12.4g} {c.baseline:>12.4g} {c.unit:<9} {c.ratio:>7.3f}  "
            f"{c.baseline_name}{'  (' + c.note + ')' if c.note else ''}",
            file=out,
        )


def write_json(cases: Iterable[Case], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c.to_json()) + "\n")
