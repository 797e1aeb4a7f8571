"""The reply router on its own, over a stand-in gang made of real pipes.

The stand-in lets a test decide exactly when a rank "dies" (its sentinel pipe closes)
and what it replies, which a gang of processes cannot: there the order in which the
driver sees a death and a peer's reply depends on scheduling.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from concurrent.futures import Future
from multiprocessing import Pipe
from typing import Optional

import pytest

from actors.context import RankMap
from actors.errors import ActorDied, ActorError, RemoteError, pack_exception
from actors.gang import BaseGang
from actors.mailbox import Mailbox
from actors.router import DEATH_SETTLE_S, PendingCall, Router


class PipeGang(BaseGang):
    """Two ranks whose replies and deaths the test writes by hand."""

    def __init__(self, world_size: int = 2) -> None:
        self.epoch = 0
        self.ranks = RankMap(tp_size=1, pp_size=world_size)
        self.hosts = [""] * world_size
        self.spin_us = 0.0
        self.rank_ends = []  # the actor's end of each reply pipe
        self.mailboxes = []
        self._dead: list[Optional[int]] = [None] * world_size
        self._sentinel_pipes = [os.pipe() for _ in range(world_size)]
        for rank in range(world_size):
            ours, theirs = Pipe()
            self.mailboxes.append(Mailbox(ours, f"rank{rank}"))
            self.rank_ends.append(theirs)

    @property
    def sentinels(self) -> list[int]:
        return [read for read, _ in self._sentinel_pipes]

    @property
    def pids(self) -> list[Optional[int]]:
        return [1000 + rank for rank in range(self.ranks.world_size)]

    def kill(self, rank: int) -> None:
        self._dead[rank] = -9
        os.close(self._sentinel_pipes[rank][1])

    def reply(self, call_id: int, rank: int, ok: bool, payload: object) -> None:
        self.rank_ends[rank].send_bytes(pickle.dumps((call_id, rank, ok, payload)))

    def death_of(self, rank: int, during: str = "") -> ActorDied:
        return ActorDied(self.ranks.coords(rank), self._dead[rank], "SIGKILL", self.pids[rank], during)

    def unfinished(self, call_id: int) -> list[int]:
        return []

    def collect_stacks(self, ranks: list[int], settle: float = 0.3) -> dict[int, str]:
        return {}

    def close(self) -> None:
        for rank, (read, write) in enumerate(self._sentinel_pipes):
            os.close(read)
            if self._dead[rank] is None:
                os.close(write)
        for box, end in zip(self.mailboxes, self.rank_ends):
            box.close()
            end.close()


@pytest.fixture
def gang_and_router():
    gang = PipeGang()
    broken: list[ActorError] = []
    router = Router(gang, classify=lambda _router, error: error, on_fatal=lambda _router, error: broken.append(error))
    try:
        yield gang, router, broken
    finally:
        router.close(ActorError("test over"))
        router.release_fds()
        gang.close()


def _call(router: Router, call_id: int, critical: bool = False) -> PendingCall:
    call = PendingCall(call_id, "stream", (0, 1), single=False, timeout=30.0, critical=critical)
    router.register(call)
    router.wake()  # as submit does: somebody must read the replies
    return call


def _wait_for(condition, timeout: float = 10.0) -> None:  # noqa: ANN001 - a no-argument callable
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _result(future: Future) -> object:
    try:
        return future.result(timeout=10)
    except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
        return exc


@pytest.mark.parametrize("critical", [False, True])
def test_a_peer_error_behind_a_death_already_visible_fails_the_call_with_the_death(gang_and_router, critical):
    # What CI once saw: rank 0 was killed, rank 1 then failed waiting for its data,
    # and the driver read rank 1's error before it looked at rank 0's sentinel.
    gang, router, broken = gang_and_router
    call = _call(router, 7, critical=critical)
    gang.kill(0)
    router._deliver(7, 1, False, pack_exception(ConnectionError("the sending rank 0 is gone")))
    error = _result(call.future)
    assert isinstance(error, ActorDied), repr(error)
    assert error.rank == (0, 0) and error.during == "call 7 'stream'"
    assert router.failure is not None
    _wait_for(lambda: broken)  # the router thread hands the broken gang to the policy
    assert isinstance(broken[0], ActorDied) and broken[0].rank == (0, 0)


@pytest.mark.parametrize("cause", [ValueError, ConnectionError])
def test_an_error_with_every_rank_alive_fails_only_its_call(gang_and_router, cause):
    # A lost connection first waits out the settle for a death that does not come; any
    # other error does not wait at all.
    gang, router, broken = gang_and_router
    call = _call(router, 3)
    start = time.monotonic()
    gang.reply(3, 1, False, pack_exception(cause("bad input")))
    error = _result(call.future)
    elapsed = time.monotonic() - start
    assert isinstance(error, RemoteError) and isinstance(error.cause, cause), repr(error)
    assert error.rank == (1, 0)
    if cause is ConnectionError:
        assert elapsed >= 0.9 * DEATH_SETTLE_S, elapsed  # the settle, give or take the timer
    else:
        assert elapsed < DEATH_SETTLE_S / 2, elapsed
    assert router.failure is None and not broken  # the gang goes on serving
    later = _call(router, 4)
    gang.reply(4, 0, True, "a")
    gang.reply(4, 1, True, "b")
    assert _result(later.future) == ["a", "b"]


def test_a_death_alone_fails_every_pending_call(gang_and_router):
    gang, router, broken = gang_and_router
    first, second = _call(router, 1), _call(router, 2)
    gang.kill(1)
    for call in (first, second):
        error = _result(call.future)
        assert isinstance(error, ActorDied) and error.rank == (1, 0), repr(error)


def test_a_lost_connection_waits_for_a_death_that_shows_late(gang_and_router):
    # A forkserver child's sentinel fires once the fork server has reaped it: on a loaded
    # machine the peer's "sender gone" came first (CI, under a CPU hog 9 runs in 25).
    gang, router, broken = gang_and_router
    call = _call(router, 5)
    death = threading.Timer(DEATH_SETTLE_S / 4, gang.kill, args=(0,))
    death.start()
    router._deliver(5, 1, False, pack_exception(ConnectionError("the sending rank 0 is gone")))
    error = _result(call.future)
    death.join()
    assert isinstance(error, ActorDied) and error.rank == (0, 0), repr(error)
