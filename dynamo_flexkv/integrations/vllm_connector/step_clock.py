"""How long vLLM's forward took in the steps that only prefilled: cost-aware loading's measure of
recompute (core/cost.py), taken where the connector sees each step begin and end.

vLLM binds the step's connector metadata before the forward and calls ``wait_for_save`` after
it, so those two hooks bracket it. On the CPU the forward runs in this thread: wall time. On a
GPU the forward is only queued by then, so two CUDA events on the current stream bracket it and
are read at a later step, once the GPU passed the second one (no synchronisation is added).

Only steps that load nothing are timed: a step that waits for a tier's or a prefill worker's
bytes measures the wait too, and what the cost model needs is what computing costs."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

MAX_PENDING = 64  # CUDA steps awaiting their end event; older ones are dropped unread


@dataclass(frozen=True)
class PrefillStep:
    tokens: int  # prompt tokens computed in the step
    prompt_tokens: int  # the longest prompt among them
    seconds: float


class StepClock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda and torch.cuda.is_available()
        self._began: Any | None = None  # perf_counter or a recorded CUDA event
        self._pending: deque[tuple[Any, Any, tuple[int, int]]] = deque(maxlen=MAX_PENDING)
        self._done: list[PrefillStep] = []

    def begin(self) -> None:
        """The step's forward is about to start."""
        if self.cuda:
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def end(self, work: tuple[int, int] | None) -> None:
        """The forward ended (CPU) or was queued (GPU). ``work``: (prompt tokens, longest prompt)
        of a step that only prefilled and loaded nothing; None for any other step."""
        began, self._began = self._began, None
        if began is None or work is None:
            return
        if self.cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._pending.append((began, ended, work))
        else:
            self._done.append(PrefillStep(work[0], work[1], time.perf_counter() - began))

    def take(self) -> list[PrefillStep]:
        """The timed steps not taken yet (on a GPU, those the GPU finished)."""
        while self._pending and self._pending[0][1].query():
            began, ended, work = self._pending.popleft()
            self._done.append(PrefillStep(work[0], work[1], began.elapsed_time(ended) / 1000.0))
        out, self._done = self._done, []
        return out
