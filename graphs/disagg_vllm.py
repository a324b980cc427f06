"""Disaggregated prefill/decode on vLLM: one frontend, a vLLM prefill worker and a vLLM decode
worker (``python -m dynamo.vllm --disaggregation-mode prefill|decode``). Each runs vLLM's
NixlConnector for the handover (decode pulls the prompt's KV blocks from prefill over NIXL) beside
FlexKVConnector for its own host/disk tiers, under vLLM's MultiConnector.

    dynamo-flexkv serve graphs/disagg_vllm.py -f configs/disagg_vllm.yaml
"""

from dynamo_flexkv.serve import Frontend, Graph, VllmWorker

graph = Graph(
    "disagg_vllm",
    (
        Frontend(router_mode="round-robin"),
        VllmWorker("PrefillWorker", disaggregation_mode="prefill"),
        VllmWorker("DecodeWorker", disaggregation_mode="decode"),
    ),
    description=__doc__,
)
