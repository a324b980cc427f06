"""Aggregated serving: one frontend, one FlexKV worker (prefill and decode on the same worker),
KV offload to host memory and local SSD.

    dynamo-flexkv serve graphs/agg.py -f configs/agg.yaml
"""

from dynamo_flexkv.serve import FlexKVWorker, Frontend, Graph

graph = Graph("agg", (Frontend(router_mode="round-robin"), FlexKVWorker(replicas=1)), description=__doc__)
