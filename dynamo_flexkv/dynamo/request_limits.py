"""What the worker checks every request against before it reaches the engine, and the messages a
client gets back: each refusal names what is wrong and the limit, so the fix is obvious.

The reference engine computes one greedy or seeded-temperature choice per request; options it
would otherwise silently ignore (n, best_of, beam search, top_p, penalties, logprobs, ...) are
refused, not dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from dynamo_flexkv.engine import SamplingParams


class RequestRefused(ValueError):
    """A request this worker cannot serve as asked; the message is meant for the client."""


# Options the engine does not implement, with the value(s) that mean "off" (sent by default).
_UNSUPPORTED_SAMPLING: Dict[str, Tuple[Any, ...]] = {
    "top_p": (None, 1, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "guided_decoding": (None,),
}
_UNSUPPORTED_STOP: Dict[str, Tuple[Any, ...]] = {"min_tokens": (None, 0)}
_UNSUPPORTED_OUTPUT: Dict[str, Tuple[Any, ...]] = {"logprobs": (None, 0, False), "prompt_logprobs": (None, 0, False)}


@dataclass(frozen=True)
class RequestLimits:
    context_window: int  # prompt + generated tokens one request may hold (the engine's device KV)
    vocab_size: int
    default_max_tokens: int = 16  # OpenAI completions' default when max_tokens is not given

    def check(self, request: Mapping[str, Any]) -> Tuple[List[int], SamplingParams]:
        """The prompt and sampling parameters of a request, or RequestRefused naming the limit."""
        tokens = self._prompt(request.get("token_ids"))
        so = request.get("sampling_options") or {}
        sc = request.get("stop_conditions") or {}
        oo = request.get("output_options") or {}
        for name in ("n", "best_of"):
            value = so.get(name)
            if value is not None and int(value) != 1:
                raise RequestRefused(f"{name}={value} is not supported: this worker returns exactly one choice "
                                     f"per request; send {name}=1 or leave it out")
        for group, table in (("sampling", _UNSUPPORTED_SAMPLING), ("stop", _UNSUPPORTED_STOP),
                             ("output", _UNSUPPORTED_OUTPUT)):
            opts = {"sampling": so, "stop": sc, "output": oo}[group]
            for name, off in table.items():
                if opts.get(name) not in off:
                    # The frontend turns /v1/completions' echo=true into prompt_logprobs: name what was sent.
                    hint = " (echo=true asks for it: leave echo out)" if name == "prompt_logprobs" else ""
                    raise RequestRefused(f"{name}={opts[name]!r} is not supported by this worker (greedy or "
                                         f"temperature/seed sampling only){hint}; leave {name} out")
        temperature = so.get("temperature")
        temperature = 0.0 if temperature is None else float(temperature)
        if temperature < 0:
            raise RequestRefused(f"temperature={temperature} must be >= 0")
        max_tokens = self._max_tokens(len(tokens), sc.get("max_tokens"))
        stop = () if sc.get("ignore_eos") else tuple(int(t) for t in sc.get("stop_token_ids_hidden") or ())
        seed = so.get("seed")
        return tokens, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                      seed=None if seed is None else int(seed), stop_token_ids=stop)

    def _prompt(self, token_ids: Optional[Sequence[int]]) -> List[int]:
        tokens = [int(t) for t in token_ids or ()]
        if not tokens:
            raise RequestRefused("the prompt is empty: send at least one token")
        for i, t in enumerate(tokens):
            if not 0 <= t < self.vocab_size:
                raise RequestRefused(f"token id {t} at position {i} is outside this model's vocabulary "
                                     f"(ids 0 to {self.vocab_size - 1})")
        if len(tokens) >= self.context_window:
            raise RequestRefused(f"prompt has {len(tokens):,} tokens; this model's context window is "
                                 f"{self.context_window:,} (prompt plus at least one generated token)")
        return tokens

    def _max_tokens(self, prompt_len: int, requested: Any) -> int:
        room = self.context_window - prompt_len
        if requested is None:  # not given: the default, as far as the window allows
            return min(self.default_max_tokens, room)
        n = int(requested)
        if n < 1:
            raise RequestRefused(f"max_tokens={n} must be at least 1")
        if n > room:
            raise RequestRefused(f"prompt has {prompt_len:,} tokens and max_tokens is {n:,}: "
                                 f"{prompt_len + n:,} exceeds this model's context window of "
                                 f"{self.context_window:,}; use max_tokens <= {room:,}")
        return n
