"""The worker's command line, and the checks that run before anything heavy is imported."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

_serving = False  # the engine started: Dynamo's Worker owns SIGINT from here on


def on_sigint(signum: int, frame: object) -> None:
    """The worker's SIGINT handler, installed first thing. Until the engine starts nothing was
    accepted and nothing needs draining, so SIGINT (serve stopping a graph while a worker still
    imports or registers) ends the process quietly, where Python's default would print a
    KeyboardInterrupt traceback from whatever it interrupted. Once the engine started, Dynamo's
    Worker owns SIGINT (unregister, grace period, drain, cleanup) and chains to this handler
    afterwards: it only logs, so the drain is never cut short."""
    if not _serving:
        raise SystemExit(0)
    logging.getLogger("dynamo_flexkv.integrations.dynamo_worker.component").info(
        "SIGINT: graceful shutdown (Dynamo drains, then cleanup)"
    )


def mark_serving() -> None:
    global _serving
    _serving = True


def handover_seconds(text: str) -> float:
    """argparse type of --handover-lease-s / --handover-timeout-s: refused before anything starts."""
    from dynamo_flexkv.integrations.disagg.leases import handover_seconds_problem

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    problem = handover_seconds_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


# Where the worker registers and publishes, read as dynamo.vllm and dynamo.frontend read it
# (dynamo.common.configuration.groups.runtime_args): the flag, else the environment variable (the
# Dynamo operator sets them in every pod of a DynamoGraphDeployment), else the default. The
# defaults are this project's local ones (file discovery, the ZMQ event plane).
RUNTIME_ENV = {
    "--namespace": "DYN_NAMESPACE",
    "--discovery-backend": "DYN_DISCOVERY_BACKEND",
    "--request-plane": "DYN_REQUEST_PLANE",
    "--event-plane": "DYN_EVENT_PLANE",
}
DISCOVERY_BACKENDS = ["file", "etcd", "mem", "kubernetes"]
REQUEST_PLANES = ["tcp", "nats"]
EVENT_PLANES = ["zmq", "nats"]
# The operator sets it on worker pods: each rollout's workers register in NAMESPACE-SUFFIX, which
# the frontend finds by its DYN_NAMESPACE_PREFIX (dynamo.common.utils.namespace.get_worker_namespace).
WORKER_SUFFIX_ENV = "DYN_NAMESPACE_WORKER_SUFFIX"


def worker_namespace(text: str) -> str:
    """argparse type of --namespace, applied to the flag's value or else to the default (argparse
    converts a string default too): the namespace with the operator's worker suffix, if any."""
    suffix = os.environ.get(WORKER_SUFFIX_ENV)
    return f"{text}-{suffix}" if suffix else text


def one_of(flag: str, choices: list[str]) -> Callable[[str], str]:
    """argparse type of a runtime option: argparse checks ``choices`` against a flag's value but
    not against a default, which here may come from the environment."""

    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"{text!r} (the flag's value, else ${RUNTIME_ENV[flag]}) is not one of {', '.join(choices)}"
            )
        return text

    return check


def _env_default(flag: str, default: str) -> str:
    return os.environ.get(RUNTIME_ENV[flag]) or default  # set but empty: unset


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynamo_flexkv.integrations.dynamo_worker",
        description="The reference engine with KVManager offload as a Dynamo backend.",
    )
    p.add_argument("--model", default="small", help="model preset (configs/models) or a local HF directory")
    p.add_argument("--served-model-name", default="flexkv-small")
    p.add_argument("--model-dir", help="where to write the model directory (default: a temp dir)")
    p.add_argument(
        "--namespace",
        default=_env_default("--namespace", "dynamo"),
        type=worker_namespace,
        help="Dynamo namespace to register in (default: $DYN_NAMESPACE, else dynamo); "
        f"${WORKER_SUFFIX_ENV}, when set, is appended as -SUFFIX",
    )
    for flag, default, choices in (
        ("--discovery-backend", "file", DISCOVERY_BACKENDS),
        ("--request-plane", "tcp", REQUEST_PLANES),
        ("--event-plane", "zmq", EVENT_PLANES),
    ):
        p.add_argument(
            flag,
            default=_env_default(flag, default),
            type=one_of(flag, choices),
            choices=choices,
            help=f"default: ${RUNTIME_ENV[flag]}, else {default}",
        )
    p.add_argument("--component", default="flexkv")
    p.add_argument("--endpoint", default="generate")
    p.add_argument(
        "--num-device-blocks",
        type=int,
        default=256,
        help="the engine's own KV blocks; x block size = the context window",
    )
    p.add_argument("--no-offload", action="store_true", help="serve without host/disk tiers")
    p.add_argument("--bulk-load", action="store_true", help="load cached prefixes before compute")
    p.add_argument(
        "--no-device-prefix-cache",
        action="store_true",
        help="free device blocks when a request ends: reuse then comes only from offload tiers",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on shutdown, seconds in-flight requests get to finish before they are aborted",
    )
    # Disaggregated prefill/decode (dynamo_flexkv.integrations.disagg.dynamo_handlers).
    p.add_argument(
        "--disaggregation-mode",
        default="agg",
        choices=["agg", "prefill", "decode"],
        help="agg: prefill and decode here; prefill: compute prompts and hand their KV over; "
        "decode: pull prefilled KV over NIXL and generate",
    )
    p.add_argument(
        "--handover-lease-s",
        type=handover_seconds,
        default=30.0,
        help="prefill: seconds handed-over blocks stay held without the decode worker's release",
    )
    p.add_argument(
        "--handover-timeout-s",
        type=handover_seconds,
        default=10.0,
        help="decode: seconds a KV pull may take before the prompt is recomputed instead",
    )
    p.add_argument(
        "--handover-renew-s",
        type=handover_renew_seconds,
        default=5.0,  # leases.DEFAULT_RENEW_S
        help="prefill: seconds a lease holds unless the decode worker claims or renews it (it does "
        "when the request reaches it and while the request waits there); at most "
        "--handover-lease-s",
    )
    return p


def handover_renew_seconds(text: str) -> float:
    """argparse type of --handover-renew-s: a decode worker claims a lease with 1 s to spare
    (clock skew, the notice's way), so a window under 2 s would leave it almost no time."""
    value = handover_seconds(text)
    if value < 2.0:
        raise argparse.ArgumentTypeError(
            f"--handover-renew-s {value} must be at least 2 seconds: the decode worker claims a lease with 1 s to spare"
        )
    return value


def check_event_plane_binds_loopback(event_plane: str) -> None:
    """Dynamo 1.6.1's direct-mode ZMQ event publishers bind 0.0.0.0 whatever DYN_EVENT_PLANE_HOST
    says; only a broker (DYN_ZMQ_BROKER_URL) keeps them off other interfaces."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return  # in a pod, listening on the pod network is the point (render --k8s)
    if event_plane == "zmq" and not os.environ.get("DYN_ZMQ_BROKER_URL"):
        sys.exit(
            "python -m dynamo_flexkv.integrations.dynamo_worker: --event-plane zmq without DYN_ZMQ_BROKER_URL "
            "would make Dynamo's event publishers listen on every interface (0.0.0.0). Start the graph with "
            "`dynamo-flexkv serve` (it runs a loopback broker), or run `python -m "
            "dynamo_flexkv.serve.zmq_broker tcp://127.0.0.1:P1 tcp://127.0.0.1:P2` and set "
            "DYN_ZMQ_BROKER_URL='xsub=tcp://127.0.0.1:P1 , xpub=tcp://127.0.0.1:P2' for the frontend "
            "and every worker, or use --event-plane nats."
        )
