"""Aggregated serving behind Dynamo's KV-aware router: one frontend (``--router-mode kv``) and N
FlexKV workers. Each worker publishes device, host and disk KV events, so the router sends a
request to the worker that holds the longest prefix of it in any tier.

    dynamo-flexkv serve graphs/agg_router.py -f configs/agg_router.yaml
"""

from dynamo_flexkv.serve import FlexKVWorker, Frontend, Graph

graph = Graph("agg_router", (Frontend(router_mode="kv"), FlexKVWorker(replicas=2)), description=__doc__)
