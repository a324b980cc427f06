"""vLLM workers behind Dynamo's KV-aware router: one frontend (``--router-mode kv``, its block size
the workers' ``block-size``) and N vLLM workers, each offloading through FlexKVConnector. vLLM
publishes its device blocks and the connector its host and disk blocks as KV events, so the router
sends a request to the worker that holds the longest prefix of it in any tier.

    dynamo-flexkv serve graphs/agg_router_vllm.py -f configs/agg_router_vllm.yaml
"""

from dynamo_flexkv.serve import Frontend, Graph, VllmWorker

graph = Graph("agg_router_vllm", (Frontend(router_mode="kv"), VllmWorker(replicas=2)), description=__doc__)
