"""Hidden states from one pipeline stage to the next through shared memory, for ranks on one host on CPU.

With gloo, a stage's `isend` and the next stage's `recv` meet through gloo's I/O
threads in both processes, and with two batches in flight both cores are busy
computing when that has to happen. In a PP2 bf16 decode step of 32 rows on this
project's 2-core machine, the last stage waited a median 0.64 ms (mean 1.57 ms,
tails of 5 ms) for hidden states that the first stage had finished sending: about
a tenth of every step.

Here the sending rank copies the tensor into a byte ring in a shared file and
rings a doorbell (writes one byte into a FIFO); the receiving rank copies out the
bytes it needs, and only when they are not there yet does it block in `select`
on the FIFO. No helper thread, no spinning: the kernel wakes the receiver.

Layout of the shared file: one 64-byte line holding the bytes written so far (W,
stored by the sender), one holding the bytes read so far (R, stored by the
receiver), then the ring of `capacity` bytes. A message goes in at W mod capacity;
one larger than the free room goes in pieces, the sender waiting (polling R) for
the receiver to take earlier bytes. Both sides know each message's size from the
step (models/worker.py), so the ring carries bytes only.

Ordering: W is stored after the bytes it covers are written, and loaded before
they are read; R is stored after the bytes are read. x86-64 keeps stores in order,
loads in order, and no store ahead of an earlier load, which is all this needs; on
other machines `offer` declines and the worker keeps gloo.

Lifetime: the sender creates the file and the FIFO in /dev/shm and sends their
names to the receiver (gloo), which maps and opens them and answers; the sender
opens the FIFO's write end and removes both names. From then on they live in the
two processes only and go with them however they exit. A receiver whose sender is
gone reads end-of-file on the FIFO and raises `ConnectionError`; a sender whose
receiver is gone gets EPIPE and raises `ConnectionError`; a peer that is alive but
does not keep up raises `TimeoutError` after `timeout_s`. Each names the peer rank.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import select
import time
from typing import Optional

import torch
import torch.distributed as dist

from models.shm_file import create_shm_file, map_shm_file

__all__ = ["DEFAULT_CAPACITY", "ShmHandoffReceiver", "ShmHandoffSender"]

DEFAULT_CAPACITY = 4 * 2**20  # ring bytes: 8 prompt chunks of 512 tokens x 512 bf16
_LINE = 64
_W, _R = 0, _LINE // 8  # indices of the two counters in the "q" view
_NAME_BYTES = 512
_PREFIX = "pipeactors-handoff-"
_ROOM_POLL_S = (50e-6, 1e-3)  # a sender waiting for room polls R, backing off to the second


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


class _Ring:
    def __init__(self, mm: mmap.mmap, capacity: int, fifo: int, peer: int, timeout_s: float, path: str) -> None:
        self.capacity, self.peer, self.timeout_s = capacity, peer, timeout_s
        self._mm: Optional[mmap.mmap] = mm
        self._fifo = fifo
        self._counters = memoryview(mm).cast("q")
        self._data = torch.frombuffer(mm, dtype=torch.uint8)[2 * _LINE : 2 * _LINE + capacity]
        self.path = path  # the name the file had before it was removed
        self.bytes = 0  # this end's count: written (sender, W) or read (receiver, R)
        self.wait_seconds = 0.0  # waiting for the peer (bytes to read / room to write)

    @staticmethod
    def nbytes(capacity: int) -> int:
        return 2 * _LINE + capacity

    def _span(self, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's k bytes from stream offset `count`: the piece up to the ring's end, then the wrapped rest."""
        pos = count % self.capacity
        first = min(k, self.capacity - pos)
        return self._data[pos : pos + first], self._data[: k - first]

    def close(self) -> None:
        """Closes this end of the FIFO (a receiver then reads end-of-file, a sender gets EPIPE) and unmaps the
        ring; safe to call twice."""
        if self._fifo >= 0:
            os.close(self._fifo)
            self._fifo = -1
        if self._mm is None:
            return
        self._counters.release()
        del self._data
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        self._mm = None


class ShmHandoffSender(_Ring):
    """The sending end: `send(*xs)` copies the tensors' bytes into the ring and wakes the receiver; build it with `offer`."""

    @classmethod
    def offer(
        cls,
        dst: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        timeout_s: float = 600.0,
        directory: str = "/dev/shm",
    ) -> Optional["ShmHandoffSender"]:
        """Paired with `ShmHandoffReceiver.accept(src)` on global rank `dst` (gloo messages between the two):
        the sender end, or None on both ranks when either cannot map the ring (another host, no /dev/shm,
        not x86-64)."""
        capacity = -(-int(capacity) // _LINE) * _LINE
        paths = _create(directory, cls.nbytes(capacity)) if platform.machine() in ("x86_64", "AMD64") else None
        mm: Optional[mmap.mmap] = None
        fifo = -1
        try:
            name = "\0".join(paths).encode() if paths else b""
            dist.send(_encode(name), dst=dst)
            answer = torch.zeros(1, dtype=torch.uint8)
            dist.recv(answer, src=dst)
            if paths and answer.item():
                mm = map_shm_file(paths[0], cls.nbytes(capacity))
                fifo = _open_fifo(paths[1], os.O_WRONLY)  # the receiver holds the read end open: no wait
            ok = mm is not None and fifo >= 0
            dist.send(torch.tensor([int(ok)], dtype=torch.uint8), dst=dst)
        finally:
            for path in paths or ():
                os.unlink(path)
        if not ok:
            _discard(mm, fifo)
            return None
        assert mm is not None and paths is not None
        return cls(mm, capacity, fifo, dst, timeout_s, paths[0])

    def send(self, *xs: torch.Tensor) -> None:
        """Copies each x (any shape and dtype; made contiguous) into the ring, in order; returns once every byte is in it.

        The receiver is woken once, after the last byte, unless the sender must first wait
        for room (then it wakes the receiver before waiting, to drain the ring).
        """
        written, capacity, counters = self.bytes, self.capacity, self._counters
        for x in xs:
            src = _bytes_of(x.contiguous())
            n, off = src.numel(), 0
            while off < n:
                free = capacity - (written - counters[_R])
                if free <= 0:
                    self._ring_doorbell()
                    self._wait_for_room(written)
                    continue
                k = min(free, n - off)
                head, tail = self._span(written, k)
                head.copy_(src[off : off + head.numel()])
                tail.copy_(src[off + head.numel() : off + k])
                written += k
                off += k
                counters[_W] = written
        self.bytes = written
        self._ring_doorbell()

    def _ring_doorbell(self) -> None:
        try:
            os.write(self._fifo, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full of unread doorbells: the receiver wakes anyway
        except BrokenPipeError:
            raise ConnectionError(f"shared-memory handoff: the receiving rank {self.peer} is gone") from None

    def _wait_for_room(self, written: int) -> None:
        started = time.perf_counter()
        deadline = started + self.timeout_s
        poller = select.poll()
        poller.register(self._fifo, 0)  # POLLERR / POLLHUP are always reported: the read end closed
        delay = _ROOM_POLL_S[0]
        try:
            while written - self._counters[_R] >= self.capacity:
                if poller.poll(0):
                    raise ConnectionError(f"shared-memory handoff: the receiving rank {self.peer} is gone")
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"shared-memory handoff: rank {self.peer} took no bytes for {self.timeout_s}s"
                    )
                time.sleep(delay)
                delay = min(2 * delay, _ROOM_POLL_S[1])
        finally:
            self.wait_seconds += time.perf_counter() - started



class ShmHandoffReceiver(_Ring):
    """The receiving end: `recv_into(*xs)` fills each x with the next x.nbytes bytes sent; build it with `accept`."""

    @classmethod
    def accept(
        cls, src: int, *, capacity: int = DEFAULT_CAPACITY, timeout_s: float = 600.0
    ) -> Optional["ShmHandoffReceiver"]:
        """The other half of `ShmHandoffSender.offer(dst)` on global rank `src`; `capacity` must match its."""
        capacity = -(-int(capacity) // _LINE) * _LINE
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        dist.recv(name, src=src)
        raw = bytes(name.tolist()).rstrip(b"\0")
        mm: Optional[mmap.mmap] = None
        fifo = -1
        paths = raw.decode().split("\0") if raw else []
        if len(paths) == 2:
            mm = map_shm_file(paths[0], cls.nbytes(capacity))
            if mm is not None:
                fifo = _open_fifo(paths[1], os.O_RDONLY)
        mine = mm is not None and fifo >= 0
        dist.send(torch.tensor([int(mine)], dtype=torch.uint8), dst=src)
        theirs = torch.zeros(1, dtype=torch.uint8)
        dist.recv(theirs, src=src)
        if not (mine and theirs.item()):
            _discard(mm, fifo)
            return None
        assert mm is not None
        return cls(mm, capacity, fifo, src, timeout_s, paths[0])

    def available(self) -> int:
        """Bytes sent and not yet read: a `recv_into` of at most this many does not wait."""
        return self._counters[_W] - self.bytes

    def recv_into(self, *xs: torch.Tensor) -> None:
        """Fills each contiguous tensor x, in order, with the next x's-size bytes the sender sent."""
        read, counters = self.bytes, self._counters
        for x in xs:
            if not x.is_contiguous():
                raise ValueError("shared-memory handoff: recv_into needs a contiguous tensor")
            dst = _bytes_of(x)
            n, off = dst.numel(), 0
            while off < n:
                avail = counters[_W] - read
                if avail <= 0:
                    self._wait_for_bytes(read)
                    continue
                k = min(avail, n - off)
                head, tail = self._span(read, k)
                dst[off : off + head.numel()].copy_(head)
                dst[off + head.numel() : off + k].copy_(tail)
                read += k
                off += k
                counters[_R] = read
        self.bytes = read

    def _wait_for_bytes(self, read: int) -> None:
        started = time.perf_counter()
        deadline = started + self.timeout_s
        try:
            while self._counters[_W] <= read:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"shared-memory handoff: rank {self.peer} sent nothing for {self.timeout_s}s")
                ready, _, _ = select.select([self._fifo], [], [], left)
                if not ready:
                    continue
                try:
                    # Doorbells are only wake-ups: drain them all, then look at W again.
                    if os.read(self._fifo, 4096) == b"" and self._counters[_W] <= read:
                        raise ConnectionError(f"shared-memory handoff: the sending rank {self.peer} is gone")
                except BlockingIOError:
                    pass
        finally:
            self.wait_seconds += time.perf_counter() - started



def _encode(name: bytes) -> torch.Tensor:
    if len(name) > _NAME_BYTES:
        name = b""  # a directory name this long: decline rather than truncate
    out = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if name:
        out[: len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    return out


def _create(directory: str, nbytes: int) -> Optional[tuple[str, str]]:
    """The ring's shared file and, beside it, the doorbell FIFO; None where either cannot be made."""
    path = create_shm_file(directory, _PREFIX, nbytes)
    if path is None:
        return None
    fifo = path + ".bell"
    try:
        os.mkfifo(fifo, 0o600)
    except OSError:
        os.unlink(path)
        return None
    return path, fifo


def _discard(mm: Optional[mmap.mmap], fifo: int) -> None:
    """Undoes a half-made end (the pair declined)."""
    if mm is not None:
        mm.close()
    if fifo >= 0:
        os.close(fifo)


def _open_fifo(path: str, mode: int) -> int:
    try:
        return os.open(path, mode | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.EACCES):
            raise
        return -1
