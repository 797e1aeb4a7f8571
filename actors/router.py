"""Resolves call futures from actor replies, by call id, and watches for deaths and deadlines.

Replies are read by one thread at a time, the *reader*. The reply-router thread
takes that role whenever calls are outstanding and nobody else reads. A caller
that blocks on its own call (`collective_rpc`) and finds no reader reads the
replies itself: on this 2-core VM every hand-over between threads costs a
cross-core wake-up of 50 us or more, which would double the round trip of a
small call. Whoever reads resolves every reply it sees, not only its own.

Both the reader and the idle router wait on every actor's process sentinel, so a
death fails every pending call at once, without waiting for a deadline. An error
reply is checked against the sentinels first: a peer of a dead rank often reports
its own failure ("rank gone") before or with the death, and the death is what the
caller must see.

Deadlines: a call's clock starts when it becomes the oldest outstanding call,
i.e. when the call ahead of it finishes, so pipelined batches are not charged
for waiting in line.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import os
import pickle
import select
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from actors.errors import ActorError, ActorTimeout, SupervisorClosed, format_rank, unpack_exception
from actors.gang import BaseGang
from actors.mailbox import ReplyReader

logger = logging.getLogger(__name__)

# How long a critical error waits for a peer's death to show before it is blamed on the
# rank that reported it: a rank that dies resets its collective connections while it
# exits, so its peers' "connection reset" errors can arrive before its sentinel fires.
DEATH_SETTLE_S = 0.2

# What a peer raises when the rank it exchanges data with is gone (models' shared-memory
# channels raise ConnectionError; a pipe's end, EOFError).
PEER_LOSS_ERRORS = (ConnectionError, EOFError)


@dataclass(eq=False)
class PendingCall:
    """A call sent to every actor, waiting for the replies of `reply_ranks`."""

    call_id: int
    method: str
    reply_ranks: tuple[int, ...]
    single: bool
    timeout: Optional[float]
    future: Future = field(default_factory=Future)
    values: dict[int, Any] = field(default_factory=dict)
    started: Optional[float] = None
    # An error reply breaks the gang (the policy acts), e.g. a failed execute_model
    # leaves peers waiting inside a collective.
    critical: bool = False


class GangBroken(Exception):
    """Internal: the router's gang broke before the call could be registered."""


def _poller(*fds: int) -> select.poll:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller


def _wake_pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except (BlockingIOError, OSError):  # already poked, or closed
        pass


class Router:
    """The reply router of one gang (one epoch)."""

    def __init__(
        self,
        gang: BaseGang,
        classify: Callable[["Router", ActorError], BaseException],
        on_fatal: Callable[["Router", ActorError], None],
        cpus: Optional[list[int]] = None,
    ) -> None:
        """`classify(router, error)` gives what pending calls fail with when the gang
        breaks (it runs in the thread that saw the break); `on_fatal(router, error)`
        then runs once in the router thread, which ends after it. `cpus`: where the
        router thread runs (default: anywhere)."""
        self.gang = gang
        self._cpus = cpus
        self._classify = classify
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._reader = threading.Lock()
        self._pending: collections.OrderedDict[int, PendingCall] = collections.OrderedDict()
        self._conn_rank: dict[Connection, int] = {c: r for r, c in enumerate(gang.conns)}
        self._sentinel_rank: dict[int, int] = {s: r for r, s in enumerate(gang.sentinels)}
        self._router_wake = _wake_pipe()
        self._reader_wake = _wake_pipe()
        self._fd_conn: dict[int, Connection] = {c.fileno(): c for c in gang.conns}
        self._readers = {c: ReplyReader(c) for c in gang.conns}
        # Poll sets built once: a selector built per wait costs more than the round trip.
        conns, sentinels = list(self._fd_conn), list(self._sentinel_rank)
        self._caller_poll = _poller(*conns, *sentinels, self._reader_wake[0])
        self._router_poll = _poller(*conns, *sentinels, self._reader_wake[0], self._router_wake[0])
        self._idle_poll = _poller(*sentinels, self._router_wake[0])
        self._failure: Optional[ActorError] = None
        self._closed = False
        self._fds_released = False
        # Whether the router thread sleeps without reading replies (see wake()).
        self._idle = True
        self._spin_s = gang.spin_us * 1e-6
        self._thread = threading.Thread(target=self._run, name=f"pipeactors-router-e{gang.epoch}", daemon=True)
        self._thread.start()

    # ----- called by the supervisor -----

    @property
    def failure(self) -> Optional[ActorError]:
        return self._failure

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def register(self, call: PendingCall) -> None:
        """Track a call before its frames are posted, so no reply can beat it."""
        with self._lock:
            self._raise_if_unusable()
            if not self._pending:
                call.started = time.monotonic()
                if call.timeout is not None and self._reader.locked():
                    _poke(self._reader_wake[1])  # the current reader must learn the new deadline
            self._pending[call.call_id] = call

    def wake(self) -> None:
        """Make sure somebody reads replies (after an asynchronous submit).

        Only an idle router thread is poked: one already reading replies reads the new
        call's too, and a poke would only cost it a wake-up (a context switch on a core
        that a rank is computing on).
        """
        with self._lock:
            if not self._idle:
                return
        _poke(self._router_wake[1])

    def wait(self, call: PendingCall) -> Any:
        """Block until `call` resolves, reading replies in this thread when nobody else does."""
        if not call.future.done() and self._reader.acquire(blocking=False):
            try:
                self._pump(call.future.done, as_router=False)
            finally:
                self._reader.release()
                if self._pending or self._failure is not None:
                    self.wake()
        return call.future.result()

    def close(self, reason: ActorError) -> None:
        """Fail what is pending with `reason` and stop the router thread."""
        with self._lock:
            self._closed = True
            calls = list(self._pending.values())
            self._pending.clear()
        for call in calls:
            call.future.set_exception(copy.copy(reason))
        _poke(self._router_wake[1])
        _poke(self._reader_wake[1])
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    def quiesce(self, timeout: float = 5.0) -> bool:
        """Wait until nobody is reading; the caller may then close the gang's pipes."""
        if self._reader.acquire(timeout=timeout):
            self._reader.release()
            return True
        return False

    def release_fds(self) -> None:
        """Close the wake pipes once the router thread has ended."""
        with self._lock:
            if self._fds_released or self._thread.is_alive():
                return
            self._fds_released = True
        for fd in (*self._router_wake, *self._reader_wake):
            try:
                os.close(fd)
            except OSError:
                pass

    # ----- internals -----

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise GangBroken()
        if self._closed:
            raise SupervisorClosed("the supervisor is closed")

    def _pop(self, call: PendingCall) -> None:
        was_head = next(iter(self._pending), None) == call.call_id
        if self._pending.pop(call.call_id, None) is not None and was_head and self._pending:
            head = next(iter(self._pending.values()))
            head.started = time.monotonic()

    def _run(self) -> None:
        if self._cpus:
            try:
                os.sched_setaffinity(0, self._cpus)  # this thread only (Linux: 0 is the calling thread)
            except OSError as exc:
                logger.warning("reply router not pinned to CPUs %s: %s", self._cpus, exc)
        while True:
            # Drain before looking at the state: a poke that lands after the look is then
            # still in the pipe when we wait, so no wake-up is lost.
            _drain(self._router_wake[0])
            with self._lock:
                if self._closed:
                    return
                failure = self._failure
            if failure is not None:
                try:
                    self._on_fatal(self, failure)
                except Exception:
                    logger.exception("handling the failure of the gang failed")
                return
            if self._pending and self._reader.acquire(blocking=False):
                try:
                    self._pump(lambda: not self._pending or self._closed, as_router=True)
                finally:
                    self._reader.release()
                continue
            with self._lock:
                # Look again under the lock: a call registered since the look above found
                # this thread not idle, so its wake() did not poke.
                if self._closed or self._failure is not None or (self._pending and not self._reader.locked()):
                    continue
                self._idle = True
            try:
                for fd, _ in self._idle_poll.poll():
                    if fd in self._sentinel_rank:
                        self._actor_gone(self._sentinel_rank[fd])
            finally:
                with self._lock:
                    self._idle = False

    def _pump(self, until: Callable[[], bool], as_router: bool) -> None:
        poller = self._router_poll if as_router else self._caller_poll
        while not until():
            with self._lock:
                if self._failure is not None or self._closed:
                    return
                timeout_ms = None
                if self._pending:
                    head = next(iter(self._pending.values()))
                    if head.timeout is not None and head.started is not None:
                        left = head.started + head.timeout - time.monotonic()
                        timeout_ms = max(0, math.ceil(left * 1000))
            events = poller.poll(0) if self._spin_s else None
            if not events and self._spin_s:
                # Spin briefly before blocking (see actors.actor): the reply of a small
                # call usually arrives within tens of microseconds.
                end = time.perf_counter() + self._spin_s
                while not events and time.perf_counter() < end:
                    events = poller.poll(0)
            if not events:
                events = poller.poll(timeout_ms)
            if not events:
                self._check_deadline()
                continue
            gone: list[int] = []
            poked = False
            for fd, _ in events:
                conn = self._fd_conn.get(fd)
                if conn is not None:
                    self._read(conn, gone)
                elif fd in self._sentinel_rank:
                    gone.append(self._sentinel_rank[fd])
                elif fd == self._reader_wake[0]:
                    _drain(fd)
                else:
                    poked = True
            for rank in gone:
                conn = self.gang.conns[rank]
                while not conn.closed and conn.poll(0):  # replies sent just before dying still count
                    if not self._read(conn, []):
                        break
                self._actor_gone(rank)
            if poked:
                return  # the router was poked (close or failure): _run looks at the state
            self._check_deadline()

    def _read(self, conn: Connection, gone: list[int]) -> bool:
        try:
            frames = self._readers[conn].read()
        except (EOFError, OSError):
            frames = None
        if frames is None:
            gone.append(self._conn_rank[conn])
            return False
        for frame in frames:
            call_id, rank, ok, payload = pickle.loads(frame)
            self._deliver(call_id, rank, ok, payload)
        return True

    def _deliver(self, call_id: int, rank: int, ok: bool, payload: Any) -> None:
        with self._lock:
            call = self._pending.get(call_id)
            if call is None:  # a late reply to a call that already resolved, failed or timed out
                if not ok:
                    err = unpack_exception(payload, self.gang.ranks.coords(rank), "?", None, "")
                    logger.error("call %d failed on %s after it had resolved: %s", call_id, err.rank, err)
                return
            if ok:
                call.values[rank] = payload
                if len(call.values) < len(call.reply_ranks):
                    return
            self._pop(call)
        if ok:
            if call.single:
                call.future.set_result(call.values[call.reply_ranks[0]])
            else:
                call.future.set_result([call.values[r] for r in call.reply_ranks])
            return
        coords = self.gang.ranks.coords(rank)
        error = unpack_exception(payload, coords, call.method, self.gang.pids[rank], self.gang.hosts[rank])
        # A rank that has died is the cause even of a plain call's error: a peer that waited
        # on it reports "rank gone", often before the driver sees the death (the dying rank's
        # pipes close at once, but a forkserver child's sentinel fires only once the fork
        # server has reaped it, which on a loaded machine came later than the peer's reply).
        # A lost connection is worth the settle; any other error only looks.
        peer_lost = isinstance(getattr(error, "cause", None), PEER_LOSS_ERRORS)
        death = self._death_behind(call, DEATH_SETTLE_S if call.critical or peer_lost else 0.0)
        if death is not None:
            logger.info("call %d failed on %s behind a death: %s", call.call_id, format_rank(error.rank), error)
            self._break(death, first=call)
        elif call.critical:
            self._break(error, first=call)
        else:
            call.future.set_exception(error)

    def _death_behind(self, call: PendingCall, settle_s: float) -> Optional[ActorError]:
        """The death of a rank, if one has died or dies within `settle_s`: the real cause of
        an error on a peer (e.g. gloo's 'Connection reset by peer')."""
        for sentinel in wait(list(self._sentinel_rank), timeout=settle_s):
            return self.gang.death_of(self._sentinel_rank[sentinel], during=f"call {call.call_id} {call.method!r}")
        return None

    def _actor_gone(self, rank: int) -> None:
        with self._lock:
            if self._failure is not None or self._closed:
                return
            head = next(iter(self._pending.values()), None)
        during = f"call {head.call_id} {head.method!r}" if head else "idle"
        self._break(self.gang.death_of(rank, during=during))

    def _break(self, error: ActorError, first: Optional[PendingCall] = None) -> None:
        """The gang is broken: fail every pending call (and `first`, already popped) and
        let the router thread hand the gang to the policy."""
        with self._lock:
            if self._failure is not None or self._closed:
                if first is not None:
                    first.future.set_exception(error)
                return
            self._failure = error
            calls = ([first] if first is not None else []) + list(self._pending.values())
            self._pending.clear()
        logger.error("gang epoch %d broke: %s", self.gang.epoch, error)
        outcome = self._classify(self, error)
        for call in calls:
            call.future.set_exception(error if outcome is error and call is first else copy.copy(outcome))
        _poke(self._router_wake[1])
        _poke(self._reader_wake[1])

    def _check_deadline(self) -> None:
        with self._lock:
            head = next(iter(self._pending.values()), None)
            if head is None or head.timeout is None or head.started is None:
                return
            if time.monotonic() < head.started + head.timeout:
                return
            self._pop(head)
            silent = {r for r in head.reply_ranks if r not in head.values}
        ranks = sorted(silent | set(self.gang.unfinished(head.call_id)))
        stacks = self.gang.collect_stacks(ranks)
        coords = self.gang.ranks.coords
        error = ActorTimeout(
            head.method, head.call_id, head.timeout, [coords(r) for r in ranks], {coords(r): s for r, s in stacks.items()}
        )
        # A missed deadline means a hung or lost rank: the gang cannot be trusted.
        self._break(error, first=head)
