"""A sum all-reduce through shared memory, for the tensor-parallel ranks of one host on CPU.

gloo takes 0.4-0.5 ms for a small all-reduce on this machine and a TP-sharded
layer makes two per step; here a rank copies its tensor into its own slot of a
shared buffer, bumps its counter, waits until every rank's counter has reached
the same call, and sums the slots itself. Every rank adds the same bytes in rank
order (slot 0 + slot 1, then + slot 2, ...), so all ranks get bit-identical results.

Layout of the shared file: one 64-byte line per rank holding its call counter,
then per rank two slots of `capacity` bytes. Calls alternate between the two
slots, so a rank may start call n+1 while a slower one still reads call n: it
only writes call n+2's slot after every rank has posted n+1, which each does
after it finished reading n. A tensor larger than a slot goes through in pieces.

Waiting: a short busy spin when every process has a core of its own, then
`sched_yield`, then short sleeps, so that more ranks than cores never livelock;
a peer that does not arrive within `timeout_s` raises TimeoutError naming it.

Lifetime: group rank 0 creates the file in /dev/shm, the others open it, and
once all have mapped it (a gloo barrier) rank 0 unlinks it. From then on the
memory belongs only to the mappings and vanishes when the last rank exits, however
it exits. Only a rank 0 killed inside that barrier leaves a file behind (named
pipeactors-allreduce-*).

Ordering: a counter is stored after the slot it covers is written and loaded
before the slots are read; x86-64 keeps stores in order and loads in order, which
is all this needs. On other machines `create` declines and the caller keeps gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from typing import Optional

import torch
import torch.distributed as dist

from models.shm_file import create_shm_file, map_shm_file

__all__ = ["DEFAULT_CAPACITY", "ShmAllReduce"]

DEFAULT_CAPACITY = 4 * 2**20  # bytes per rank per slot
_LINE = 64
_YIELD_S = 2e-3
_SLEEP_S = 50e-6
_PREFIX = "pipeactors-allreduce-"


class ShmAllReduce:
    """Sum all-reduce among `size` processes that map one shared file; build it with `create`."""

    def __init__(
        self, mm: mmap.mmap, rank: int, size: int, capacity: int, spin_s: float, timeout_s: float
    ) -> None:
        self.rank, self.size, self.capacity = rank, size, capacity
        self.spin_s, self.timeout_s = spin_s, timeout_s
        self._mm = mm
        self._counters = memoryview(mm).cast("q")
        self._stride = _LINE // 8
        self._peers = [r * self._stride for r in range(size) if r != rank]
        self._mine = rank * self._stride
        data = torch.frombuffer(mm, dtype=torch.uint8)
        base = size * _LINE
        self._slots = [
            [data[base + (2 * r + s) * capacity : base + (2 * r + s + 1) * capacity] for s in (0, 1)]
            for r in range(size)
        ]
        self._seq = 0
        self.seconds = 0.0  # inside all_reduce, in total
        self.wait_seconds = 0.0  # of those, waiting for a peer to post its part
        self.path = ""  # the name the file had before it was unlinked

    @staticmethod
    def nbytes(size: int, capacity: int) -> int:
        return size * _LINE + 2 * size * capacity

    @classmethod
    def create(
        cls,
        group: Optional[dist.ProcessGroup],
        rank: int,
        size: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        spin_s: float = 0.0,
        timeout_s: float = 600.0,
        directory: str = "/dev/shm",
    ) -> Optional["ShmAllReduce"]:
        """Collective over `group` (rank = group rank): the shared all-reduce, or None on every rank
        when some rank cannot map the file (another host, no /dev/shm, not x86-64)."""
        capacity = -(-capacity // _LINE) * _LINE
        nbytes = cls.nbytes(size, capacity)
        path: Optional[str] = None
        if rank == 0 and platform.machine() in ("x86_64", "AMD64"):
            path = create_shm_file(directory, _PREFIX, nbytes)
        mm: Optional[mmap.mmap] = None
        try:
            box = [path]
            root = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast_object_list(box, src=root, group=group)
            if box[0] is not None:
                mm = map_shm_file(box[0], nbytes)
            ok = torch.tensor([1 if mm is not None else 0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped it
        finally:
            if path is not None:
                os.unlink(path)
        if not ok.item():
            if mm is not None:
                mm.close()
            return None
        assert mm is not None
        shm = cls(mm, rank, size, capacity, spin_s, timeout_s)
        shm.path = box[0]
        return shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (every rank calls it with the same shape and dtype); returns x."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        try:
            return self._all_reduce(x)
        finally:
            self.seconds += time.perf_counter() - start

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            flat = x.contiguous()
            self._all_reduce(flat)
            return x.copy_(flat)
        flat = x.view(-1)
        per = self.capacity // x.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce(flat[start : start + per])
        return x

    def _reduce(self, chunk: torch.Tensor) -> None:
        self._seq += 1
        seq, slot = self._seq, self._seq & 1
        nbytes = chunk.numel() * chunk.element_size()
        mine = self._slots[self.rank][slot][:nbytes].view(chunk.dtype)
        mine.copy_(chunk)
        self._counters[self._mine] = seq
        self._wait(seq)
        parts = [self._slots[r][slot][:nbytes].view(chunk.dtype) for r in range(self.size)]
        torch.add(parts[0], parts[1], out=chunk)
        for part in parts[2:]:
            chunk.add_(part)

    def _wait(self, seq: int) -> None:
        counters, peers = self._counters, self._peers
        if all(counters[i] >= seq for i in peers):
            return
        now = started = time.perf_counter()
        try:
            self._wait_until(seq, now)
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _wait_until(self, seq: int, now: float) -> None:
        counters, peers = self._counters, self._peers
        spin_end, yield_end, deadline = now + self.spin_s, now + self.spin_s + _YIELD_S, now + self.timeout_s
        while True:
            if all(counters[i] >= seq for i in peers):
                return
            now = time.perf_counter()
            if now < spin_end:
                continue
            if now < yield_end:
                os.sched_yield()
            elif now < deadline:
                time.sleep(_SLEEP_S)
            else:
                late = [i // self._stride for i in peers if counters[i] < seq]
                raise TimeoutError(
                    f"shared-memory all-reduce: tp ranks {late} did not reach call {seq} within {self.timeout_s}s"
                )

    def close(self) -> None:
        """Unmaps the buffer (the memory goes when every rank has closed or exited); safe to call twice."""
        if self._mm is None:
            return
        self._slots = []
        self._counters.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        self._mm = None
