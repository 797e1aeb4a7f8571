"""The supervisor's end of one actor's mailbox.

The hot path is a `multiprocessing` Pipe (a Unix socket pair): measured here it is
the fastest blocking local transport (round trip 14-47 us, against 100+ us for
queues and managers). A small frame is written inline by the caller. A large one
goes to a writer thread, so that `submit` never blocks on a full socket while the
actor is busy with an earlier call; once anything is queued there, later frames
queue behind it to keep the order.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
from multiprocessing.connection import Connection
from typing import Optional

logger = logging.getLogger(__name__)

# Well under the default Unix socket buffer (about 200 KiB), so a few queued
# inline frames never fill it.
INLINE_LIMIT = 16 * 1024

_LEN = struct.Struct("!i")
_BIG_LEN = struct.Struct("!Q")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Mailbox:
    """Ordered, non-blocking delivery of frames to one actor.

    `post` takes a frame already in wire form (see actors.messages.encode_call), so a broadcast is
    framed once and written to each actor's pipe with one system call.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self.name = name
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._backlog: collections.deque[bytes] = collections.deque()
        self._writing = False
        self._closed = False
        self._writer: threading.Thread | None = None

    def post(self, data: bytes) -> None:
        """Deliver a wire frame; a dead actor's frames are dropped (its death is reported elsewhere)."""
        with self._lock:
            if self._closed:
                return
            if not self._backlog and not self._writing and len(data) <= INLINE_LIMIT:
                self._send(data)
                return
            self._backlog.append(data)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=f"mailbox-{self.name}", daemon=True)
                self._writer.start()
            self._ready.notify()

    def _send(self, data: bytes) -> None:
        try:
            _write_all(self.fd, data)
        except OSError as exc:
            logger.debug("mailbox %s: dropped a frame, actor gone (%s)", self.name, exc)
            self._closed = True

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                data = self._backlog.popleft()
                self._writing = True
            try:
                _write_all(self.fd, data)
            except OSError:
                with self._lock:
                    self._closed = True
                return
            finally:
                with self._lock:
                    self._writing = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._backlog.clear()
            self._ready.notify_all()
        self.conn.close()


class ReplyReader:
    """Reads the reply frames of one actor's pipe with as few system calls as it can.

    `Connection.recv_bytes` costs two reads per frame (length, then body); with four
    actors answering each call that was a measurable share of a round trip here.
    This reads whatever is there in one go and splits it into frames, using the
    framing `Connection.send_bytes` writes (a 4-byte big-endian length, or -1 and an
    8-byte length for huge frames).
    """

    CHUNK = 1 << 16

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self._buf = bytearray()

    def read(self) -> Optional[list[bytes]]:
        """The complete frames now readable (blocking only to finish a frame begun); None at EOF."""
        data = os.read(self.fd, self.CHUNK)
        if not data:
            return None
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        while len(buf) >= 4:
            (size,) = _LEN.unpack_from(buf)
            start = 4
            if size == -1:
                if len(buf) < 12:
                    self._fill(12)
                (size,) = _BIG_LEN.unpack_from(buf, 4)
                start = 12
            if len(buf) < start + size:
                if frames:
                    break  # hand over what is complete; the rest stays buffered
                self._fill(start + size)
            frames.append(bytes(buf[start : start + size]))
            del buf[: start + size]
        return frames

    def _fill(self, needed: int) -> None:
        # The actor is writing this frame now: finish it with blocking reads.
        while len(self._buf) < needed:
            data = os.read(self.fd, max(self.CHUNK, needed - len(self._buf)))
            if not data:
                raise EOFError("pipe closed in the middle of a frame")
            self._buf += data
