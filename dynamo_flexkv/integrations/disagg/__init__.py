"""Disaggregated prefill/decode: the prefill worker computes a prompt and holds its device blocks
under a lease; the decode worker pulls the blocks its own tiers lack over NIXL (UCX here; RDMA or
NVLink where present) and releases the lease. See README "Disaggregated prefill/decode"."""

from dynamo_flexkv.integrations.disagg.leases import Lease, LeaseTable
from dynamo_flexkv.integrations.disagg.params import HandoverParams, HandoverRefused

__all__ = ["HandoverParams", "HandoverRefused", "Lease", "LeaseTable"]
