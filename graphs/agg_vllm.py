"""Aggregated serving with vLLM: one frontend, one vLLM worker (``python -m dynamo.vllm``) whose KV
cache offloads to host memory and local SSD through dynamo_flexkv's FlexKVConnector
(``offload: false``: vLLM alone, the baseline).

    dynamo-flexkv serve graphs/agg_vllm.py -f configs/agg_vllm.yaml
"""

from dynamo_flexkv.serve import Frontend, Graph, VllmWorker

graph = Graph("agg_vllm", (Frontend(router_mode="round-robin"), VllmWorker(replicas=1)), description=__doc__)
