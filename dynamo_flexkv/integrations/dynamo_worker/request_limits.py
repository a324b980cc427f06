"""What the worker checks every request against before it reaches the engine, and the messages a
client gets back: each refusal names what is wrong and the limit, so the fix is obvious.

The reference engine computes one greedy or seeded-temperature choice per request; options it
would otherwise silently ignore (n, best_of, beam search, top_p, penalties, logprobs, ...) are
refused, not dropped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.integrations.reference_engine import SamplingParams


class RequestRefused(ValueError, FlexKVError):
    """A request this worker cannot serve as asked; the message is meant for the client."""


class _Unsupported(NamedTuple):
    """An option the engine does not implement, as Dynamo's frontend hands it to the worker."""

    section: str  # where in the request: sampling_options, stop_conditions, output_options
    name: str
    off: tuple[Any, ...]  # the values that mean "not asked for" (the frontend sends None by default)
    asked_by: str = ""  # what the client sent to ask for it, when that is not the option itself
    leave: str = ""  # the client's field to leave out (default: name)


_UNSUPPORTED: tuple[_Unsupported, ...] = (
    _Unsupported("sampling_options", "top_p", (None, 1, 1.0)),
    _Unsupported("sampling_options", "top_k", (None, 0, -1)),
    _Unsupported("sampling_options", "min_p", (None, 0, 0.0)),
    _Unsupported("sampling_options", "frequency_penalty", (None, 0, 0.0)),
    _Unsupported("sampling_options", "presence_penalty", (None, 0, 0.0)),
    _Unsupported("sampling_options", "repetition_penalty", (None, 1, 1.0)),
    _Unsupported("sampling_options", "use_beam_search", (None, False)),
    _Unsupported("sampling_options", "length_penalty", (None, 1, 1.0)),
    _Unsupported("sampling_options", "guided_decoding", (None,)),
    _Unsupported("stop_conditions", "min_tokens", (None, 0)),
    # Any number asks for log probabilities, 0 too (OpenAI: the sampled token's own). The frontend
    # passes completions' logprobs=N as it is, and chat's logprobs=true as top_logprobs (0 included,
    # 1 when absent); chat's top_logprobs without logprobs=true never reaches the worker.
    _Unsupported(
        "output_options",
        "logprobs",
        (None,),
        "logprobs (completions: any number, 0 too; chat: logprobs=true)",
        "logprobs",
    ),
    _Unsupported("output_options", "prompt_logprobs", (None,), "echo=true", "echo"),
)


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """Compared by type too: in Python 0 == False and True == 1, but logprobs=0 asks for something
    and use_beam_search=True is not top_p=1."""
    return any(value is o or (type(value) in (int, float) and type(o) in (int, float) and value == o) for o in off)


@dataclass(frozen=True)
class RequestLimits:
    context_window: int  # prompt + generated tokens one request may hold (the engine's device KV)
    vocab_size: int
    default_max_tokens: int = 16  # OpenAI completions' default when max_tokens is not given

    def check(self, request: Mapping[str, Any]) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling parameters of a request, or RequestRefused naming the limit."""
        tokens = self._prompt(request.get("token_ids"))
        so = request.get("sampling_options") or {}
        sc = request.get("stop_conditions") or {}
        for name in ("n", "best_of"):
            value = so.get(name)
            if value is not None and int(value) != 1:
                raise RequestRefused(
                    f"{name}={value} is not supported: this worker returns exactly one choice "
                    f"per request; send {name}=1 or leave it out"
                )
        for opt in _UNSUPPORTED:
            value = (request.get(opt.section) or {}).get(opt.name)
            if not _is_off(value, opt.off):
                asked = f"; the request's {opt.asked_by} asks for it" if opt.asked_by else ""
                raise RequestRefused(
                    f"{opt.name}={value!r} is not supported by this worker (greedy or "
                    f"temperature/seed sampling only){asked}; leave {opt.leave or opt.name} out"
                )
        temperature = so.get("temperature")
        temperature = 0.0 if temperature is None else float(temperature)
        if temperature < 0:
            raise RequestRefused(f"temperature={temperature} must be >= 0")
        max_tokens = self._max_tokens(len(tokens), sc.get("max_tokens"))
        stop = () if sc.get("ignore_eos") else tuple(int(t) for t in sc.get("stop_token_ids_hidden") or ())
        seed = so.get("seed")
        return tokens, SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=None if seed is None else int(seed),
            stop_token_ids=stop,
        )

    def _prompt(self, token_ids: Sequence[int] | None) -> list[int]:
        tokens = [int(t) for t in token_ids or ()]
        if not tokens:
            raise RequestRefused("the prompt is empty: send at least one token")
        for i, t in enumerate(tokens):
            if not 0 <= t < self.vocab_size:
                raise RequestRefused(
                    f"token id {t} at position {i} is outside this model's vocabulary (ids 0 to {self.vocab_size - 1})"
                )
        if len(tokens) >= self.context_window:
            raise RequestRefused(
                f"prompt has {len(tokens):,} tokens; this model's context window is "
                f"{self.context_window:,} (prompt plus at least one generated token)"
            )
        return tokens

    def _max_tokens(self, prompt_len: int, requested: Any) -> int:
        room = self.context_window - prompt_len
        if requested is None:  # not given: the default, as far as the window allows
            return min(self.default_max_tokens, room)
        n = int(requested)
        if n < 1:
            raise RequestRefused(f"max_tokens={n} must be at least 1")
        if n > room:
            raise RequestRefused(
                f"prompt has {prompt_len:,} tokens and max_tokens is {n:,}: "
                f"{prompt_len + n:,} exceeds this model's context window of "
                f"{self.context_window:,}; use max_tokens <= {room:,}"
            )
        return n
