"""The state behind a `Supervisor` handle: its gangs, its control plane, and the policy in action.

Kept apart from the handle so that `weakref.finalize` can release everything
when the handle is dropped without `close()`. The one place that acts on the
supervision policy: when a router reports its gang broken, `_classify` decides
(restart within budget, or fail) and `_on_fatal` carries it out.

Gangs are started from one long-lived lifecycle thread: the kernel's parent-death
signal fires when the thread that started a process ends, so that thread must
live as long as the supervisor.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

from actors.control import ControlServer, Registry
from actors.errors import (
    ActorDied,
    ActorError,
    ActorTimeout,
    GangRestarted,
    SupervisorClosed,
    restart_budget_exhausted,
)
from actors.gang import BaseGang, GangSpec, ProcessBackend
from actors.policy import RestartBudget, SupervisionPolicy
from actors.messages import encode_body, encode_call, method_name
from actors.router import PendingCall, Router

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SetupCall:
    """A collective call a restarted gang replays before it takes new work."""

    method: Any
    args: tuple
    kwargs: dict
    reply_ranks: tuple[int, ...]
    timeout: Optional[float]


WORKDIR_PREFIX = "pipeactors-"


def _sweep_orphaned_workdirs() -> None:
    """Remove the private dirs (control socket, stack dumps) of supervisors that were
    SIGKILLed: their names carry the owner's pid, and a dead owner cannot clean up."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(WORKDIR_PREFIX):
            continue
        pid = name[len(WORKDIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


class _Lifecycle:
    """One daemon thread that runs start and restart tasks in order."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pipeactors-lifecycle", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, args, future = task
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def run(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._tasks.put((fn, args, future))
        return future

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until the tasks queued so far have run; the thread lives on."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        try:
            self.run(lambda: None).result(timeout)
        except Exception:  # noqa: BLE001 - a start still running past the timeout: stop its gang anyway
            logger.warning("a gang start was still running at shutdown")

    def stop(self, timeout: float) -> None:
        self._tasks.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class Runtime:
    """Gangs, routers, control plane and policy state of one supervisor."""

    def __init__(
        self,
        spec: GangSpec,
        policy: SupervisionPolicy,
        max_inflight: int,
        start_timeout: float,
        shutdown_grace: float,
        backend: Any = None,
        driver_cpus: Optional[list[int]] = None,
    ) -> None:
        self.spec = spec
        self.driver_cpus = driver_cpus
        self.backend = backend if backend is not None else ProcessBackend()
        self.policy = policy
        self.start_timeout = start_timeout
        self.shutdown_grace = shutdown_grace
        self._ids = itertools.count(1)
        self.cond = threading.Condition()
        self.dispatch_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_inflight)
        _sweep_orphaned_workdirs()
        self.workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
        self.control: Optional[ControlServer] = None
        self.registry: Optional[Registry] = None
        self.authkey = b""
        self.gang: Optional[BaseGang] = None
        self.router: Optional[Router] = None
        self.state = "starting"  # starting | running | restarting | failed | closed
        self.failure: Optional[ActorError] = None
        self.epoch = 0
        self.closed = False
        self.budget = RestartBudget(policy)
        self.last_break: Optional[tuple[int, ActorError]] = None  # (epoch, what broke it), for status()
        self.setup_calls: list[SetupCall] = []
        self._gangs: list[BaseGang] = []
        self._routers: list[Router] = []  # their wake pipes are closed only at shutdown
        self._restart_of: Optional[Router] = None
        self._lifecycle = _Lifecycle()

    # ----- start and restart -----

    def start(self) -> None:
        self._lifecycle.run(self._start_gang, 0).result()
        with self.cond:
            self.state = "running"

    def _start_gang(self, epoch: int) -> Router:
        assert self.registry is not None and self.control is not None
        gang = self.backend.new_gang(self.spec, epoch, self.control.address, self.authkey, self.workdir)
        with self.cond:
            if self.closed:
                raise SupervisorClosed("the supervisor was closed during a start")
            self._gangs.append(gang)
        gang.start(self.start_timeout, self.registry)
        router = Router(gang, self._classify, self._on_fatal, cpus=self.driver_cpus)
        with self.cond:
            self.gang, self.router, self.epoch = gang, router, epoch
            self._routers.append(router)
        ranks = self.spec.ranks
        logger.info(
            "epoch %d: %s on %d actors (tp=%d, pp=%d), pids %s",
            epoch, self.spec.worker, ranks.world_size, ranks.tp_size, ranks.pp_size, gang.pids,
        )
        return router

    def _restart(self, broken_epoch: int) -> None:
        started = time.monotonic()
        epoch = broken_epoch
        while True:
            epoch += 1
            try:
                router = self._start_gang(epoch)
                for call in list(self.setup_calls):
                    body = (call.method, call.args, call.kwargs)
                    router.wait(self.post(router, body, call.reply_ranks, False, call.timeout))
                with self.cond:
                    if router.failure is not None:
                        raise router.failure
                    self.state = "running"
                    self.cond.notify_all()
                logger.warning("gang restarted as epoch %d in %.2f s", epoch, time.monotonic() - started)
                return
            except BaseException as exc:
                with self.cond:
                    gang = self.gang if self.gang is not None and self.gang.epoch == epoch else None
                if gang is not None:
                    gang.stop(grace=0.0)
                with self.cond:
                    if self.closed:
                        return
                    if isinstance(exc, ActorError):
                        self.last_break = (epoch, exc)
                    if self.budget.allow():
                        logger.error("restart as epoch %d failed (%s); trying again", epoch, exc)
                        continue
                    self.state = "failed"
                    self.failure = restart_budget_exhausted(
                        f"{self._budget_text()}; the last restart failed: {exc}", exc
                    )
                    self.cond.notify_all()
                logger.error("%s", self.failure)
                return

    # ----- the policy -----

    def _classify(self, router: Router, error: ActorError) -> BaseException:
        """What the pending calls of a broken gang fail with; decides restart or fail."""
        with self.cond:
            try:
                if self.closed:
                    return SupervisorClosed("the supervisor was closed")
                self.last_break = (router.gang.epoch, error)
                if router is not self.router or self.state != "running":
                    return error  # a gang that was being started or replaced: the restart loop decides
                if self.budget.allow():
                    self.state = "restarting"
                    self._restart_of = router
                    return GangRestarted(router.gang.epoch, error)
                self.state = "failed"
                if self.policy.strategy == "restart":
                    error = restart_budget_exhausted(f"{self._budget_text()}; the gang stays down after: {error}", error)
                    logger.error("%s", error)
                self.failure = error
                return error
            finally:
                self.cond.notify_all()

    def _budget_text(self) -> str:
        return f"restart budget exhausted ({self.policy.max_restarts} restarts within {self.policy.period_s:g}s)"

    def _on_fatal(self, router: Router, error: ActorError) -> None:
        """Runs in the broken gang's router thread: stop that gang; restart if so decided."""
        router.quiesce()
        router.gang.stop(grace=0.5)
        with self.cond:
            restart = self._restart_of is router and not self.closed
            if restart:
                self._restart_of = None
        if restart:
            self._lifecycle.run(self._restart, router.gang.epoch)

    # ----- used by the handle -----

    def post(
        self,
        router: Router,
        body: tuple[Any, tuple, dict],
        reply_ranks: tuple[int, ...],
        single: bool,
        timeout: Optional[float],
        critical: bool = False,
    ) -> PendingCall:
        """Register a call with `router` and post one frame, encoded once, to every mailbox."""
        method, args, kwargs = body
        everyone = len(reply_ranks) == self.spec.ranks.world_size
        payload = encode_body(method, args, kwargs)
        with self.dispatch_lock:
            call_id = next(self._ids)
            frame = encode_call(call_id, None if everyone else frozenset(reply_ranks), payload)
            call = PendingCall(call_id, method_name(method), reply_ranks, single, timeout, critical=critical)
            call.future.set_running_or_notify_cancel()
            router.register(call)
            for box in router.gang.mailboxes:
                box.post(frame)
        return call

    def raise_if_unusable(self) -> None:
        with self.cond:
            if self.closed:
                raise SupervisorClosed("the supervisor is closed")
            if self.state == "failed" and self.failure is not None:
                raise copy.copy(self.failure)

    def current_router(self, wait_s: float) -> Router:
        """The router of the running gang, waiting out a restart."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if self.closed:
                    raise SupervisorClosed("the supervisor is closed")
                if self.state == "failed" and self.failure is not None:
                    raise copy.copy(self.failure)
                router = self.router
                if self.state == "running" and router is not None and router.failure is None:
                    return router
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ActorError(f"the gang was not running again within {wait_s:g}s (state {self.state})")
                self.cond.wait(left)

    def record_setup(self, call: SetupCall) -> None:
        with self.cond:
            self.setup_calls.append(call)

    def check_health(self, timeout: float) -> dict[tuple[int, int], dict[str, Any]]:
        self.raise_if_unusable()
        gang = self.gang
        assert gang is not None
        answers = gang.ping(timeout)
        coords = self.spec.ranks.coords
        for rank, answer in answers.items():
            if isinstance(answer, ActorDied):
                raise answer
        silent = [coords(r) for r, a in answers.items() if a is None]
        if silent:
            raise ActorTimeout("check_health", 0, timeout, silent)
        return {coords(r): a for r, a in sorted(answers.items())}

    def status(self) -> dict[str, Any]:
        with self.cond:
            gang, router = self.gang, self.router
            status = {
                "state": self.state,
                "epoch": self.epoch,
                "restarts": self.budget.total,
                "policy": self.policy.strategy,
                "world_size": self.spec.ranks.world_size,
                "in_flight": router.in_flight if router is not None else 0,
                "failure": str(self.failure) if self.failure is not None else None,
                "last_break": _describe_break(self.last_break),
            }
        status["ranks_alive"] = gang.num_alive() if gang else 0
        status["pids"] = gang.pids if gang else []
        return status

    # ----- shutdown -----

    def shutdown(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.state = "closed"
            self.cond.notify_all()
            router = self.router
        reason = SupervisorClosed("the supervisor was closed while the call was pending")
        if router is not None:
            router.close(reason)  # also frees a restart waiting on a replayed call
        # Let a start or restart in progress see `closed` and end. The thread itself must
        # outlive the gangs: its end fires the actors' parent-death signal (SIGKILL),
        # which would cut their graceful stop (worker.shutdown()) short.
        self._lifecycle.drain(timeout=self.start_timeout + 10.0)
        with self.cond:
            router, gangs, routers = self.router, list(self._gangs), list(self._routers)
        for each in routers:
            each.close(reason)
        if router is not None:
            router.quiesce()
        for gang in gangs:
            # A graceful stop only for a gang that works: a broken one has hung or dead ranks
            # (as when its router thread stops it, see _on_fatal).
            healthy = gang is self.gang and router is not None and router.failure is None
            gang.stop(grace=self.shutdown_grace if healthy else min(self.shutdown_grace, 0.5) if gang is self.gang else 0.0)
        self._lifecycle.stop(timeout=5.0)
        for each in routers:
            each.release_fds()
        if self.control is not None:
            self.control.close()
        self.backend.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _describe_break(last: Optional[tuple[int, ActorError]]) -> Optional[dict[str, Any]]:
    """What broke a gang last, for status(): its epoch, the error's type, the ranks it names, its first line."""
    if last is None:
        return None
    epoch, error = last
    ranks = getattr(error, "ranks", None)
    if ranks is None:
        rank = getattr(error, "rank", None)
        ranks = [] if rank is None else [rank]
    lines = str(error).splitlines()
    return {"epoch": epoch, "error": type(error).__name__, "ranks": list(ranks), "message": lines[0] if lines else ""}
