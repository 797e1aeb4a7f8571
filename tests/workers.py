"""Worker classes the actor tests host; importable by the spawned actors."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

from actors import ActorContext


class EchoWorker:
    """Answers with its rank; can fail, sleep or die on request."""

    def __init__(self, ctx: ActorContext, tag: str = "echo", fail_in_init: bool = False, init_sleep: float = 0.0):
        if fail_in_init:
            raise ValueError(f"constructor refused on {ctx}")
        time.sleep(init_sleep)
        self.ctx = ctx
        self.tag = tag

    def noop(self) -> None:
        return None

    def whoami(self) -> tuple[int, int, int]:
        return (self.ctx.pp, self.ctx.tp, self.ctx.global_rank)

    def context(self) -> ActorContext:
        return self.ctx

    def echo(self, value: Any) -> Any:
        return value

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float, on: tuple[int, int] | None = None) -> tuple[int, int]:
        if on is None or tuple(on) == self.ctx.rank:
            time.sleep(seconds)
        return self.ctx.rank

    def fail(self, on: tuple[int, int] | None = None, exc_type: type = ValueError, others_sleep: float = 0.0) -> str:
        if on is None or tuple(on) == self.ctx.rank:
            raise exc_type(f"boom on {self.ctx}")
        time.sleep(others_sleep)
        return "fine"

    def die(self, how: str, on: tuple[int, int], delay: float = 0.0) -> None:
        if tuple(on) != self.ctx.rank:
            time.sleep(30)  # the others wait as if inside a collective
            return
        time.sleep(delay)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            os._exit(7)
        elif how == "segfault":
            ctypes.string_at(0)
        raise AssertionError(how)

    def unpicklable_result(self) -> Any:
        return threading.Lock()  # neither pickle nor cloudpickle can


class PipeStageWorker:
    """A toy pipeline stage: sleeps `stage_seconds` per call and passes a token to the next stage over gloo."""

    def __init__(self, ctx: ActorContext, stage_seconds: float = 0.1):
        self.ctx = ctx
        self.stage_seconds = stage_seconds

    def init_distributed(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=self.ctx.init_method, rank=self.ctx.global_rank,
                                world_size=self.ctx.world_size)

    def step(self, token: int) -> int:
        import torch
        import torch.distributed as dist

        value = torch.tensor([token])
        if not self.ctx.is_first_stage:
            dist.recv(value, src=self.ctx.global_rank - self.ctx.tp_size)
        time.sleep(self.stage_seconds)
        value += 1
        if not self.ctx.is_last_stage:
            dist.send(value, dst=self.ctx.global_rank + self.ctx.tp_size)
        return int(value.item())

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
