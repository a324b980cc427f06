"""The options of a serve graph's components: each option's type, the defaults, the checks that
name the section, the key and the fix, and the restart policy a worker's options describe."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dynamo_flexkv.core.durations import is_duration
from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.sources import origin_of


def str_option(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ValueError("expected a string")
    return str(v)


def node_option(v: Any) -> str | list[str]:
    """A worker's ``node``: one node name for every replica, or a list of one name per replica."""
    if isinstance(v, list):
        if not v or not all(isinstance(n, str) and n for n in v):
            raise ValueError("expected a node name, or a list of one node name per replica (e.g. [A, B])")
        return list(v)
    return str_option(v)


def int_option(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected an integer")
    return v


def float_option(v: Any) -> float:
    # YAML 1.1 reads 1e3 (no dot, no sign in the exponent) as a string: a number to the user.
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("expected a number")
    return float(v)


def bool_option(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("expected true or false")
    return v


def args_option(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise ValueError("expected a list of strings")
    return list(v)


def mapping_option(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("expected a mapping of CacheConfig keys")
    return dict(v)


def parse_section(
    defaults: Mapping[str, Any],
    raw: Mapping[str, Any],
    allowed: Mapping[str, Callable[[Any], Any]],
    source: str,
    section: str,
    owner: str,
) -> dict[str, Any]:
    """``defaults`` with each of a config section's ``raw`` options, parsed by its ``allowed`` parser,
    over them. Errors name the option's origin (``source``: the file, or the --set that gave it), the
    ``section`` and the ``owner`` ("a worker")."""
    out = dict(defaults)
    for key, value in raw.items():
        if key not in allowed:
            raise GraphError(
                f"{origin_of(source, section, key)}: {section}.{key} is not an option of {owner}; "
                f"known: {sorted(allowed)}"
            )
        try:
            out[key] = allowed[key](value)
        except ValueError as e:
            raise GraphError(f"{origin_of(source, section, key)}: {section}.{key}={value!r}: {e}") from None
    return out


ROUTER_MODES = ("round-robin", "random", "power-of-two", "kv", "least-loaded")
OPTIONS: dict[Kind, dict[str, Callable[[Any], Any]]] = {
    Kind.FRONTEND: {
        "namespace": str_option,
        "http-port": int_option,
        "router-mode": str_option,
        "migration-limit": int_option,
        "router-host-cache-hit-weight": float_option,
        "router-disk-cache-hit-weight": float_option,
        "extra-args": args_option,
        "kv-cache-block-size": int_option,  # the router's block size; serve sets it from vLLM workers' block-size
        "node": str_option,  # serve --nodes: the node it runs on (etcd and NATS run there too)
    },
    Kind.WORKER: {
        "model": str_option,
        "served-model-name": str_option,
        "namespace": str_option,
        "replicas": int_option,
        "num-device-blocks": int_option,
        "offload": bool_option,
        "bulk-load": bool_option,
        "device-prefix-cache": bool_option,
        "system-port": int_option,
        "cache": mapping_option,
        "extra-args": args_option,
        "on-death": str_option,
        "max-restarts": int_option,
        "restart-window-s": float_option,
        "restart-backoff-s": float_option,
        "liveness-timeout-s": float_option,
        "disaggregation-mode": str_option,
        "handover-lease-s": float_option,
        "handover-timeout-s": float_option,
        "handover-renew-s": float_option,
        "node": node_option,  # one node for every replica, or a list of one per replica
    },
}
DISAGG_MODES = ("agg", "prefill", "decode")
DEFAULTS: dict[Kind, dict[str, Any]] = {
    # migration-limit: how often the frontend may move an in-flight request to another worker when
    # its worker dies (Dynamo's default, 0, fails those requests with a 503).
    Kind.FRONTEND: {
        "namespace": "dynamo",
        "http-port": 8000,
        "router-mode": "kv",
        "migration-limit": 3,
        "extra-args": [],
    },
    Kind.WORKER: {
        "model": "small",
        "namespace": "dynamo",
        "replicas": 1,
        "num-device-blocks": 256,
        "offload": True,
        "bulk-load": False,
        "device-prefix-cache": True,
        "cache": {},
        "extra-args": [],
        "on-death": "restart",
        "max-restarts": 3,
        "restart-window-s": 300.0,
        "restart-backoff-s": 1.0,
        "liveness-timeout-s": 30.0,
        "disaggregation-mode": "agg",
        "handover-lease-s": 30.0,
        "handover-timeout-s": 10.0,
        "handover-renew-s": 5.0,
    },
}


# Worker options in seconds: (lowest, highest or None, whether the lowest itself is allowed, whether
# 0 turns the option off). One check for all of them, so each refuses NaN, inf and out-of-range
# values with a message naming the option.
SECONDS_OPTIONS: dict[str, tuple] = {
    "restart-window-s": (0.0, None, False, False),
    "restart-backoff-s": (0.0, 30.0, True, False),
    "liveness-timeout-s": (5.0, 3600.0, True, True),
}


def seconds_problem(value: float, low: float, high: float | None, low_ok: bool, zero_off: bool) -> str | None:
    """Why ``value`` cannot be this option's number of seconds; None if it can."""
    if zero_off and value == 0:
        return None
    if is_duration(value, low, high, low_ok):
        return None
    want = f"> {low:g} seconds" if high is None else f"between {low:g} and {high:g} seconds"
    return f"{value} must be {'0 (off) or ' if zero_off else ''}{want} (a finite number)"


class OnDeath(Enum):
    RESTART = "restart"  # start it again, same replica, ports and SSD directory, within its budget
    STOP = "stop"  # stop the whole graph, exit 1


@dataclass(frozen=True)
class RestartPolicy:
    """What the launcher does when a worker exits on its own. A worker that dies more than
    ``max_restarts`` times within ``window_s`` seconds stops the graph (exit 1). The n-th restart
    within the window waits ``backoff_s * 2**(n-1)`` seconds (at most 30)."""

    on_death: OnDeath = OnDeath.RESTART
    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    liveness_s: float = 30.0  # a ready worker whose /health fails this long is SIGKILLed as hung; 0: off

    def delay(self, deaths_in_window: int) -> float:
        return min(30.0, self.backoff_s * 2 ** max(0, deaths_in_window - 1))


def restart_policy(o: Mapping[str, Any]) -> RestartPolicy:
    return RestartPolicy(
        OnDeath(o["on-death"]),
        o["max-restarts"],
        o["restart-window-s"],
        o["restart-backoff-s"],
        o["liveness-timeout-s"],
    )
