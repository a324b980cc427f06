"""Serve graphs: which Dynamo components run, declared in a small Python file (``graphs/*.py``)
that binds ``graph = Graph(...)``. A config file (``configs/*.yaml``) then sets each component's
options; see dynamo_flexkv.serve.plan."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from dynamo_flexkv.core.errors import FlexKVError


class GraphError(ValueError, FlexKVError):
    """A graph or its config is wrong; the message names what and how to fix it."""


class Kind(Enum):
    FRONTEND = "frontend"  # python -m dynamo.frontend: OpenAI HTTP, preprocessing, router
    WORKER = "worker"  # a backend: our reference engine (dynamo_flexkv.integrations.dynamo_worker) or dynamo.vllm
    CACHE = "cache"  # the node's KV cache service (dynamo-flexkv cache-server; serve/node_cache.py)


@dataclass(frozen=True)
class Component:
    name: str  # its section in the config file
    kind: Kind
    defaults: Mapping[str, Any] = field(default_factory=dict)  # options the config may override
    # workers: "flexkv" (python -m dynamo_flexkv.integrations.dynamo_worker) or "vllm" (python -m dynamo.vllm)
    engine: str = "flexkv"


def Frontend(name: str = "Frontend", **defaults: Any) -> Component:
    return Component(name, Kind.FRONTEND, _keys(defaults))


def FlexKVWorker(name: str = "FlexKVWorker", **defaults: Any) -> Component:
    return Component(name, Kind.WORKER, _keys(defaults))


def VllmWorker(name: str = "VllmWorker", **defaults: Any) -> Component:
    """vLLM under Dynamo (``python -m dynamo.vllm``), offloading through dynamo_flexkv's
    FlexKVConnector (``offload: false``: vLLM alone, the baseline)."""
    return Component(name, Kind.WORKER, _keys(defaults), engine="vllm")


def _keys(options: Mapping[str, Any]) -> dict[str, Any]:
    """Python keyword names (router_mode) as config keys (router-mode)."""
    return {k.replace("_", "-"): v for k, v in options.items()}


@dataclass(frozen=True)
class Graph:
    name: str
    components: tuple[Component, ...]
    description: str = ""

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise GraphError(f"graph {self.name}: component names repeat: {names}")
        if [c.kind for c in self.components].count(Kind.FRONTEND) != 1:
            raise GraphError(f"graph {self.name}: needs exactly one Frontend")
        if not any(c.kind is Kind.WORKER for c in self.components):
            raise GraphError(f"graph {self.name}: needs at least one worker component")

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


def load_graph(path: str) -> Graph:
    """Imports a graph file and returns its ``graph``."""
    p = Path(path)
    if not p.is_file():
        raise GraphError(f"graph file {path} does not exist: pass one of graphs/*.py (e.g. graphs/agg_router.py)")
    spec = importlib.util.spec_from_file_location(f"flexkv_graph_{p.stem}", p)
    if spec is None or spec.loader is None:
        raise GraphError(f"graph file {path} cannot be imported as Python: pass a .py file (e.g. graphs/agg_router.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file may raise anything: one GraphError naming it
        raise GraphError(f"graph file {path} failed to load: {type(e).__name__}: {e}") from None
    graph = getattr(module, "graph", None)
    if not isinstance(graph, Graph):
        raise GraphError(f"graph file {path} must bind `graph = Graph(...)` (dynamo_flexkv.serve.Graph)")
    return graph
