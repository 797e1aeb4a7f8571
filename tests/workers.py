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


def allreduce_inputs(numel: int, dtype: Any, seed: int, rank: int) -> Any:
    """The tensor rank `rank` contributes to all-reduce number `seed` (any rank can rebuild any rank's)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


class AllReduceWorker:
    """Every rank of the gang in one gloo group, summing through models.shm_allreduce."""

    def __init__(self, ctx: ActorContext, capacity: int = 4096, spin_s: float = 0.0,
                 directory: str = "/dev/shm", timeout_s: float = 60.0):
        import torch
        import torch.distributed as dist

        from models.shm_allreduce import ShmAllReduce

        torch.set_num_threads(1)
        self.rank, self.size = ctx.global_rank, ctx.world_size
        dist.init_process_group("gloo", init_method=ctx.init_method, rank=self.rank, world_size=self.size)
        self.shm = ShmAllReduce.create(
            None, self.rank, self.size, capacity=capacity, spin_s=spin_s, timeout_s=timeout_s, directory=directory
        )

    def attached(self) -> bool:
        return self.shm is not None

    def shm_path(self) -> str:
        assert self.shm is not None
        return self.shm.path

    def pid(self) -> int:
        return os.getpid()

    def reduce(self, numel: int, dtype: Any, seed: int, strided: bool = False) -> Any:
        x = allreduce_inputs(numel, dtype, seed, self.rank)
        if strided:  # a non-contiguous view: every other element of a wider tensor
            wide = x.new_zeros(2 * numel)
            wide[::2] = x
            x = wide[::2]
        assert self.shm is not None
        out = self.shm.all_reduce(x)
        assert out is x
        return x.clone()

    def reduce_many(self, sizes: list[int], dtype: Any, seed: int) -> tuple[int, str]:
        """All-reduces one tensor per size; returns how many differed from the rank-order sum, and a digest of all."""
        import hashlib

        import torch

        assert self.shm is not None
        wrong, digest = 0, hashlib.sha256()
        for i, n in enumerate(sizes):
            x = allreduce_inputs(n, dtype, seed + i, self.rank)
            self.shm.all_reduce(x)
            parts = [allreduce_inputs(n, dtype, seed + i, r) for r in range(self.size)]
            expected = parts[0] + parts[1]
            for p in parts[2:]:
                expected += p
            wrong += not torch.equal(x, expected)
            digest.update(x.view(torch.uint8).numpy().tobytes())
        return wrong, digest.hexdigest()

    def reduce_unless(self, absent: int) -> str:
        """Rank `absent` stays out; the others' all-reduce must time out naming it."""
        import torch

        if self.rank == absent:
            return "absent"
        assert self.shm is not None
        try:
            self.shm.all_reduce(torch.ones(4))
        except TimeoutError as exc:
            return str(exc)
        return "no timeout"

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.shm is not None:
            self.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def handoff_message(i: int, seed: int, sizes: list[int]) -> Any:
    """Message number i of a handoff stream: a seeded tensor, its dtype alternating float32 / bfloat16."""
    import torch

    g = torch.Generator().manual_seed(seed * 7919 + i)
    dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
    return torch.randn(sizes[i % len(sizes)], generator=g).to(dtype)


class HandoffWorker:
    """Two ranks (pp 0 -> pp 1) joined by a models.shm_handoff ring; rank 0 sends, rank 1 receives."""

    def __init__(self, ctx: ActorContext, capacity: int = 4096, directory: str = "/dev/shm",
                 timeout_s: float = 60.0):
        import torch
        import torch.distributed as dist

        from models.shm_handoff import ShmHandoffReceiver, ShmHandoffSender

        torch.set_num_threads(1)
        self.rank = ctx.global_rank
        dist.init_process_group("gloo", init_method=ctx.init_method, rank=self.rank, world_size=ctx.world_size)
        if self.rank == 0:
            self.end: Any = ShmHandoffSender.offer(1, capacity=capacity, timeout_s=timeout_s, directory=directory)
        else:
            self.end = ShmHandoffReceiver.accept(0, capacity=capacity, timeout_s=timeout_s)

    def attached(self) -> bool:
        return self.end is not None

    def path(self) -> str:
        return self.end.path

    def pid(self) -> int:
        return os.getpid()

    def stream(
        self, count: int, seed: int, sizes: list[int], delay_s: float = 0.0, group: tuple[int, int] = (1, 1)
    ) -> tuple[int, str, float]:
        """Sends (rank 0) or receives (rank 1) `count` messages; returns (mismatches, digest, this rank's CPU seconds).

        The sender first sleeps delay_s, so the receiver waits for the first message.
        group: how many messages the sender passes to one send call, and the receiver to
        one recv_into call (the ring carries bytes: the two need not agree).
        """
        import hashlib

        import torch

        cpu = time.process_time()
        wrong, digest = 0, hashlib.sha256()
        if self.rank == 0:
            time.sleep(delay_s)
        per_call = group[self.rank]
        for first in range(0, count, per_call):
            expected = [handoff_message(i, seed, sizes) for i in range(first, min(first + per_call, count))]
            if self.rank == 0:
                self.end.send(*expected)
                got = expected
            else:
                got = [torch.empty_like(e) for e in expected]
                self.end.recv_into(*got)
                wrong += sum(not torch.equal(g.view(torch.uint8), e.view(torch.uint8)) for g, e in zip(got, expected))
            for g in got:
                digest.update(g.view(torch.uint8).numpy().tobytes())
        return wrong, digest.hexdigest(), time.process_time() - cpu

    def send_then_close(self, numel: int) -> str:
        """Rank 0 sends one float32 tensor of numel and closes its end; rank 1 reads twice that."""
        import torch

        if self.rank == 0:
            try:
                self.end.send(torch.ones(numel))
            except ConnectionError as exc:
                return str(exc)
            finally:
                self.end.close()
            return "sent"
        try:
            self.end.recv_into(torch.empty(2 * numel))
        except ConnectionError as exc:
            return str(exc)
        return "no error"

    def recv_alone(self) -> str:
        """Rank 1 waits for a message rank 0 never sends (its end's timeout_s)."""
        import torch

        if self.rank == 0:
            return "absent"
        try:
            self.end.recv_into(torch.empty(4))
        except TimeoutError as exc:
            return str(exc)
        return "no timeout"

    def close_receiver(self) -> bool:
        if self.rank == 1:
            self.end.close()
        return True

    def send_past_a_closed_receiver(self, numel: int) -> str:
        """Rank 0 sends more than the ring holds to a receiver that closed its end."""
        import torch

        if self.rank == 1:
            return "closed"
        try:
            self.end.send(torch.ones(numel))
        except ConnectionError as exc:
            return str(exc)
        return "no error"

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.end is not None:
            self.end.close()
        if dist.is_initialized():
            dist.destroy_process_group()
