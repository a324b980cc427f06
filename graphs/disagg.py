"""Disaggregated prefill/decode: one frontend, one prefill worker, one decode worker. The frontend's
prefill router sends each request to the prefill worker (max_tokens=1), then to the decode worker
with the prefill worker's ``disaggregated_params``; the decode worker pulls the prompt's KV blocks
its own tiers lack over NIXL and generates. Same tokens as graphs/agg.py.

    dynamo-flexkv serve graphs/disagg.py -f configs/disagg.yaml
"""

from dynamo_flexkv.serve import FlexKVWorker, Frontend, Graph

graph = Graph(
    "disagg",
    (
        Frontend(router_mode="round-robin"),
        FlexKVWorker("PrefillWorker", disaggregation_mode="prefill"),
        FlexKVWorker("DecodeWorker", disaggregation_mode="decode"),
    ),
    description=__doc__,
)
