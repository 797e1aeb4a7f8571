"""`SamplingParams`: how one request is sampled and when it stops."""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from models.batch import SamplingOptions

__all__ = ["SamplingParams"]


def is_int(value: Any) -> bool:
    """An integer, Python's or numpy's; not a bool (an int subclass: True as max_tokens is a bug, not a 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@functools.lru_cache(maxsize=4096)
def _options(temperature: float, top_k: int, top_p: float, seed: Optional[int], logprobs: bool) -> SamplingOptions:
    # One shared object per distinct setting: pickle memoizes it, so a batch of
    # requests with the same params sends the options once, not once per chunk.
    return SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, logprobs=logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    Args:
        max_tokens: most tokens to generate (>= 1); reaching it finishes with "length".
        temperature: 0 is greedy; > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0: off).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: off).
        seed: seeds this request's draws, so that a run is reproducible (and a
            request recomputed after preemption draws the same tokens).
        stop_token_ids: generating any of these finishes the request with "stop";
            the stop token is kept as the last output token.
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: return the logprob of each generated token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        stop = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        # Normalised forms: a tuple keeps the params hashable and immutable.
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def sampling_options(self) -> SamplingOptions:
        """The worker-side part of these params (shared between equal params)."""
        return _options(self.temperature, self.top_k, self.top_p, self.seed, self.logprobs)
