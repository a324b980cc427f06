"""Disaggregated prefill/decode on vLLM behind Dynamo's KV-aware router: the prefill leg goes to
the prefill worker holding the longest prefix of the prompt in any tier (vLLM's device events and
FlexKVConnector's host/disk events), the decode leg by load; decode pulls the KV over NIXL
(vLLM's NixlConnector beside FlexKVConnector under MultiConnector).

    dynamo-flexkv serve graphs/disagg_router_vllm.py -f configs/disagg_router_vllm.yaml
"""

from dynamo_flexkv.serve import Frontend, Graph, VllmWorker

graph = Graph(
    "disagg_router_vllm",
    (
        Frontend(router_mode="kv"),
        VllmWorker("PrefillWorker", disaggregation_mode="prefill", replicas=2),
        VllmWorker("DecodeWorker", disaggregation_mode="decode", replicas=1),
    ),
    description=__doc__,
)
