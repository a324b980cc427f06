"""Serve graphs of Dynamo components on this machine (``dynamo-flexkv serve``) or render them for
Kubernetes (``dynamo-flexkv render --k8s``)."""

from dynamo_flexkv.serve.graph import Component, FlexKVWorker, Frontend, Graph, GraphError, Kind, VllmWorker, load_graph

__all__ = ["Component", "FlexKVWorker", "Frontend", "Graph", "GraphError", "Kind", "VllmWorker", "load_graph"]
