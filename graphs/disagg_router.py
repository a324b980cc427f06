"""Disaggregated prefill/decode behind Dynamo's KV-aware router: one frontend (``--router-mode kv``),
N prefill workers and M decode workers. The prefill leg goes to the prefill worker holding the
longest prefix of the prompt in any tier (their device, host and disk KV events); the decode leg
is placed by load, and the decode worker pulls only the blocks its own tiers lack over NIXL.

    dynamo-flexkv serve graphs/disagg_router.py -f configs/disagg_router.yaml
"""

from dynamo_flexkv.serve import FlexKVWorker, Frontend, Graph

graph = Graph(
    "disagg_router",
    (
        Frontend(router_mode="kv"),
        FlexKVWorker("PrefillWorker", disaggregation_mode="prefill", replicas=2),
        FlexKVWorker("DecodeWorker", disaggregation_mode="decode", replicas=1),
    ),
    description=__doc__,
)
