"""The apps' HTTP client, one of each (serve, the replay, the benchmarks and the tests use these):
a JSON request, and a Prometheus /metrics page read and its samples summed (vLLM's ``vllm:``
names included). Standard library only."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

from dynamo_flexkv.core.errors import FlexKVError

LOOPBACK = "127.0.0.1"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')  # name="value", a value may hold \" and commas


class MetricsUnreachable(OSError, RuntimeError, FlexKVError):
    """A /metrics page could not be read (the process is gone, or not listening yet)."""


def http_json(url: str, body: Any | None = None, *, method: str | None = None, timeout: float = 30.0) -> Any:
    """One JSON request: GET without ``body``, POST with it (or ``method``); returns the parsed
    reply. An HTTP error status raises urllib.error.HTTPError, an unreachable server an OSError."""
    data = None if body is None else json.dumps(body).encode()
    method = method or ("GET" if body is None else "POST")
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics_url(where: int | str) -> str:
    """A port on 127.0.0.1 (a worker's system port), or a URL: a ``.../metrics`` one or a base URL."""
    url = where if isinstance(where, str) else f"http://{LOOPBACK}:{where}/metrics"
    return url if url.endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape(where: int | str, timeout: float = 10.0) -> str:
    """The Prometheus text page at ``where`` (see metrics_url); MetricsUnreachable names the URL."""
    url = metrics_url(where)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError as e:
        raise MetricsUnreachable(f"cannot read the metrics at {url}: {e}") from None


def samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """Each sample named exactly ``name`` in a Prometheus text page, as (labels, value). Names are
    read as written (prometheus_client's parser would rename a counter's samples to ``..._total``,
    which Dynamo's ``dynamo_component_kv_cache_events_applied`` is not)."""
    line = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)(?: -?\d+)?$", re.M)
    for m in line.finditer(text):
        yield dict(_LABEL.findall(m.group(1) or "")), float(m.group(2))


def total(text: str, name: str, **labels: Any) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 when there is none: a
    counter not incremented yet)."""
    return sum(v for have, v in samples(text, name) if all(have.get(k) == str(w) for k, w in labels.items()))


def sums_by(text: str, name: str, *by: str) -> dict[tuple[str, ...], float]:
    """The samples of ``name`` summed per the values of the labels ``by`` ("" where one is absent)."""
    out: dict[tuple[str, ...], float] = {}
    for labels, value in samples(text, name):
        key = tuple(labels.get(b, "") for b in by)
        out[key] = out.get(key, 0.0) + value
    return out
