"""`Request`: one prompt's life in the scheduler, and `RequestOutput`, what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from models.batch import SamplingOptions
from scheduling.sampling_params import SamplingParams

__all__ = ["FinishReason", "Request", "RequestOutput", "RequestStatus"]

FinishReason = str  # "stop" (a stop or end-of-sequence token) or "length" (max_tokens / max_model_len)


class RequestStatus(enum.Enum):
    """WAITING (no KV blocks) -> RUNNING (holds blocks) -> FINISHED; PREEMPTED is WAITING after losing its blocks."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A prompt, its sampling params and the tokens generated so far.

    `token_ids` holds prompt and output end to end; `num_computed_tokens` counts
    the leading positions whose keys and values are in the KV cache or being
    computed by an in-flight batch (it advances when a batch is scheduled, so a
    request is never scheduled twice for the same tokens). Preemption sets it back
    to 0: the request then recomputes prompt plus output from scratch.
    """

    __slots__ = (
        "request_id",
        "seq_id",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "status",
        "finish_reason",
        "num_computed_tokens",
        "block_table",
        "in_flight",
        "num_preemptions",
        "logprobs",
        "stop_ids",
        "options",
        "arrival",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: Optional[SamplingParams] = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        params = params if params is not None else SamplingParams()
        self.request_id = request_id
        # Both set by the scheduler when the request is added.
        self.seq_id = -1
        self.arrival = -1
        self.params = params
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.in_flight = False
        self.num_preemptions = 0
        self.logprobs: Optional[list[float]] = [] if params.logprobs else None
        # One set per request (the scheduler adds the model's eos): one membership test per token.
        self.stop_ids = frozenset(params.stop_token_ids)
        self.options: SamplingOptions = params.sampling_options()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, seq {self.seq_id}, {self.status.value}, "
            f"{self.num_prompt_tokens}+{self.num_output_tokens} tokens, computed {self.num_computed_tokens})"
        )


@dataclass
class RequestOutput:
    """The result of one prompt.

    `token_ids` are the generated ids (a stop or end-of-sequence token that ended
    the request is included); `text` is their decoding without special tokens
    ("" when the model has no tokenizer).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    logprobs: Optional[list[float]] = None
    num_preemptions: int = 0
