"""pipeactors' scheduling layer: requests, KV block accounting, batching, the engine loop and `LLM`.

`LLM(...).generate(prompts, SamplingParams(...))` is the entry point for people
who just want outputs; `Scheduler` and `Engine` are the parts a custom driver uses.
"""

from scheduling.block_manager import BlockManager
from scheduling.engine import Engine
from scheduling.llm import LLM
from scheduling.request import Request, RequestOutput, RequestStatus
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler import Scheduler

__all__ = [
    "LLM",
    "BlockManager",
    "Engine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
]
