"""Helpers for tests of router hints in a served vLLM graph (not a test module): the graph's two
workers by name, their hint and pin counters, a prompt computed on one worker (booked on it by
instance id) and stored in its host tier. test_vllm_router_hints.py serves the graph on loopback,
test_vllm_hints_nodes.py over two ``dynamo-flexkv nodes``."""

from __future__ import annotations

import json

import exactness
import vllm_graph as vg
from served import scrape, total, wait_until
from vllm_graph import VllmServe

BS = 64
NAMES = ("VllmWorker-0", "VllmWorker-1")
MAX_TOKENS = 6


def sets() -> list[str]:
    """--set values of the graphs with and without offload (float32: the exactness oracle)."""
    return [
        "Frontend.http-port=0",
        *exactness.serve_sets(),
        "VllmWorker.restart-backoff-s=2",
        "VllmWorker.max-restarts=6",
    ]


def m(text: str, name: str, **labels) -> float:
    return total(text, f"vllm:flexkv_{name}", **labels)


class HintGraph:
    """A served agg_router_vllm graph with ``VllmWorker.router-hints: true``."""

    def __init__(self, serve: VllmServe) -> None:
        self.serve = serve
        self.nudges = 0

    def text(self, name: str) -> str:
        return scrape(self.serve.metrics[name])

    def ids(self) -> dict[str, int]:
        def read(n: str):
            try:
                return vg.worker_id(self.text(n))
            except (AssertionError, RuntimeError, OSError):  # not yet, or a restarting worker
                return None

        return {n: wait_until(f"{n}'s instance id", lambda n=n: read(n), timeout=120) for n in NAMES}

    def endpoint(self, name: str) -> tuple[str, int]:
        """The worker's control endpoint, from the command line serve started it with."""
        argv = open(f"/proc/{self.serve.worker_pid(name)}/cmdline", "rb").read().decode().split("\0")
        tier = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        t = tier["secondary_tiers"][0]
        return t["control_advertise_host"], t["control_ports"][0]

    def stored(self, name: str, prompt: list[int], before: float) -> None:
        """Waits until ``name`` copied the prompt's full blocks into its host tier (what it serves peers)."""
        full = (len(prompt) - 1) // BS * BS
        wait_until(
            f"{name} stored the prompt in its host tier",
            lambda: m(self.text(name), "stored_tokens_total") >= before + full,
            timeout=60,
        )

    def stepped(self, name: str) -> str:
        """``name``'s metrics after one more engine step: vLLM reports a connector's counters and
        gauges with each step's output, so what its control endpoint did while the engine was idle
        (pins, refusals) shows only after its next request."""
        self.nudges += 1
        vg.complete(self.serve.base_url, vg.tokens(7900 + self.nudges, 8), 1, worker=self.ids()[name])
        return self.text(name)

    def pinned(self, name: str) -> float:
        return m(self.stepped(name), "peer_pinned_blocks")


def compute_on(graph: HintGraph, name: str, prompt: list[int], ids: dict[str, int]) -> dict:
    """``prompt`` computed on worker ``name`` (nothing cached), once its host tier holds it."""
    before = m(graph.text(name), "stored_tokens_total")
    r = vg.complete(graph.serve.base_url, prompt, MAX_TOKENS, worker=ids[name])
    assert r["worker"] == ids[name] and r["cached"] == 0
    graph.stored(name, prompt, before)
    return r


def by_reason(text: str, counter: str) -> dict[str, float]:
    """A counter family's totals by its reason label (vllm:flexkv_<counter>_total{reason=...})."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"vllm:flexkv_{counter}_total{{") and 'reason="' in line:
            why = line.split('reason="', 1)[1].split('"', 1)[0]
            out[why] = out.get(why, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def failed(text: str) -> dict[str, float]:
    return by_reason(text, "hints_failed")


def refused(text: str) -> dict[str, float]:
    return by_reason(text, "peer_refused")


def failed_since(before: str, after: str) -> dict[str, float]:
    """Hint failures by reason between two scrapes of one worker."""
    was = failed(before)
    return {k: v - was.get(k, 0) for k, v in failed(after).items() if v - was.get(k, 0)}
