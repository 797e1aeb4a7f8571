"""`Supervisor`: the handle of a gang of (pp, tp) actors.

It starts the gang, dispatches collective calls (every rank runs the method; the
ranks named reply, and every rank replies on failure), keeps up to
`max_inflight` asynchronous calls outstanding, and shuts everything down on
`close()`, on garbage collection and at interpreter exit.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from typing_extensions import Self

from actors.context import RankMap
from actors.control import Address, ControlServer, Registry
from actors.errors import ActorError, ActorTimeout, ConfigError, SupervisorClosed
from actors.gang import Gang, GangSpec, free_port
from actors.messages import Method, encode_call, method_name
from actors.router import PendingCall, Router

logger = logging.getLogger(__name__)

Rank = Union[int, tuple[int, int]]


def _worker_path(worker: Union[str, type]) -> str:
    if isinstance(worker, str):
        return worker
    if isinstance(worker, type):
        return f"{worker.__module__}:{worker.__qualname__}"
    raise ConfigError(f"worker must be 'package.module:ClassName' or a class, got {worker!r}")


class _Runtime:
    """The parts of a supervisor that must be released even if the handle is never closed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.workdir = tempfile.mkdtemp(prefix="pipeactors-")
        self.control: Optional[ControlServer] = None
        self.gang: Optional[Gang] = None
        self.router: Optional[Router] = None
        self.closed = False

    def on_fatal(self, error: ActorError) -> None:
        """Runs in the router thread once the gang is broken: shut the rest of it down."""
        gang, router = self.gang, self.router
        if router is not None:
            router.quiesce()
        if gang is not None:
            gang.stop(grace=0.5)

    def on_timeout(self, error: ActorTimeout) -> None:
        logger.warning("deadline missed: %s", error)

    def shutdown(self, grace: float) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            router, gang, control = self.router, self.gang, self.control
        if router is not None:
            router.close(SupervisorClosed("the supervisor was closed while the call was pending"))
            router.quiesce()
        if gang is not None:
            gang.stop(grace=grace)
        if router is not None:
            router.release_fds()
        if control is not None:
            control.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Supervisor:
    """A gang of `tp_size * pp_size` long-lived actor processes, one per (pp, tp) rank.

    Each actor builds `worker(ctx, **worker_kwargs)` from an importable class
    ('package.module:ClassName'); `ctx` is an `actors.ActorContext`.

    Args:
        worker: the worker class or its import path.
        worker_kwargs: keyword arguments of the worker's constructor (picklable).
        tp_size, pp_size: the gang's shape; `global_rank = pp * tp_size + tp`.
        max_inflight: how many `submit` calls may be outstanding (default pp_size).
        start_timeout: seconds for every actor to import and build its worker.
        call_timeout: default deadline of every call in seconds (None: no deadline).
        env: environment variables set in every actor before the worker is imported.
        cpus: a function of the global rank giving the CPUs that actor may run on.
        control_address: where the control plane listens; default a Unix socket in
            a private directory; ("127.0.0.1", 0) for loopback TCP.
        shutdown_grace: seconds actors get to leave on close before SIGTERM/SIGKILL.
    """

    def __init__(
        self,
        worker: Union[str, type],
        worker_kwargs: Optional[Mapping[str, Any]] = None,
        *,
        tp_size: int = 1,
        pp_size: int = 1,
        max_inflight: Optional[int] = None,
        start_timeout: float = 60.0,
        call_timeout: Optional[float] = 300.0,
        env: Optional[Mapping[str, str]] = None,
        cpus: Optional[Callable[[int], Optional[list[int]]]] = None,
        control_address: Optional[Address] = None,
        shutdown_grace: float = 5.0,
        fault_plan: Any = None,
    ) -> None:
        self._ranks = RankMap(tp_size, pp_size)
        if max_inflight is None:
            max_inflight = pp_size
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ConfigError(f"max_inflight must be an integer >= 1, got {max_inflight!r}")
        for name, value in (("start_timeout", start_timeout), ("shutdown_grace", shutdown_grace)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if call_timeout is not None and not call_timeout > 0:
            raise ConfigError(f"call_timeout must be > 0 or None, got {call_timeout!r}")
        self._spec = GangSpec(
            worker=_worker_path(worker),
            worker_kwargs=dict(worker_kwargs or {}),
            ranks=self._ranks,
            env={str(k): str(v) for k, v in (env or {}).items()},
            cpus=cpus,
            fault_plan=fault_plan,
        )
        self.max_inflight = max_inflight
        self.call_timeout = call_timeout
        self.shutdown_grace = shutdown_grace
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._ids = itertools.count(1)
        self._dispatch_lock = threading.Lock()
        self._rt = _Runtime()
        self._finalizer = weakref.finalize(self, self._rt.shutdown, shutdown_grace)
        try:
            self._authkey = os.urandom(32)
            address = control_address or os.path.join(self._rt.workdir, "control.sock")
            self._registry = Registry({"epoch": 0})
            self._rt.control = ControlServer(self._registry, address, self._authkey)
            self._start_gang(epoch=0, timeout=start_timeout)
        except BaseException:
            self._finalizer()
            raise

    # ----- shape -----

    @property
    def tp_size(self) -> int:
        return self._ranks.tp_size

    @property
    def pp_size(self) -> int:
        return self._ranks.pp_size

    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    @property
    def output_rank(self) -> int:
        """tp 0 of the last stage: `world_size - tp_size`."""
        return self._ranks.output_rank

    def rank_of(self, pp: int, tp: int) -> int:
        return self._ranks.rank_of(pp, tp)

    def coords(self, global_rank: int) -> tuple[int, int]:
        return self._ranks.coords(global_rank)

    @property
    def control_address(self) -> Address:
        assert self._rt.control is not None
        return self._rt.control.address

    @property
    def pids(self) -> list[Optional[int]]:
        """Process ids of the actors, in global-rank order."""
        gang = self._rt.gang
        return gang.pids if gang is not None else []

    @property
    def epoch(self) -> int:
        gang = self._rt.gang
        return gang.epoch if gang is not None else -1

    @property
    def closed(self) -> bool:
        return self._rt.closed

    # ----- calls -----

    def collective_rpc(
        self,
        method: Method,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        reply_ranks: Optional[Iterable[Rank]] = None,
        timeout: Optional[float] = None,
    ) -> list[Any]:
        """Run `worker.method(*args, **kwargs)` on every rank and wait for the replies.

        A callable `method` runs as `method(worker, *args, **kwargs)`. Returns the
        values of `reply_ranks` (default: all ranks) in global-rank order. Raises
        RemoteError if any rank raised, ActorDied if an actor died, ActorTimeout
        past `timeout` (default: the supervisor's call_timeout; math.inf: none).
        """
        ranks = self._reply_ranks(reply_ranks)
        router, call = self._dispatch(method, args, kwargs, ranks, single=False, timeout=timeout)
        return router.wait(call)

    def submit(
        self,
        method: Method,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        reply_rank: Optional[Rank] = None,
        timeout: Optional[float] = None,
    ) -> Future:
        """Start `method` on every rank without waiting; the Future resolves to `reply_rank`'s value.

        `reply_rank` defaults to the output rank. At most `max_inflight` submitted
        calls are outstanding; a further submit waits for room.
        """
        rank = self.output_rank if reply_rank is None else self._check_rank(reply_rank)
        self._raise_if_closed()
        self._slots.acquire()
        try:
            router, call = self._dispatch(method, args, kwargs, (rank,), single=True, timeout=timeout)
        except BaseException:
            self._slots.release()
            raise
        slots = self._slots  # the callback must not keep the handle alive
        call.future.add_done_callback(lambda _: slots.release())
        router.wake()
        return call.future

    def _check_rank(self, rank: Rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, tuple)):
            raise ConfigError(f"a rank is a global rank or a (pp, tp) pair, got {rank!r}")
        return self._ranks.check_rank(rank)

    def _reply_ranks(self, reply_ranks: Optional[Iterable[Rank]]) -> tuple[int, ...]:
        if reply_ranks is None:
            return tuple(range(self.world_size))
        ranks = tuple(sorted({self._check_rank(r) for r in reply_ranks}))
        if not ranks:
            raise ConfigError("reply_ranks must name at least one rank")
        return ranks

    def _raise_if_closed(self) -> None:
        if self._rt.closed:
            raise SupervisorClosed("the supervisor is closed")
        router = self._rt.router
        if router is not None and router.failure is not None:
            raise copy.copy(router.failure)

    def _dispatch(
        self,
        method: Method,
        args: Sequence[Any],
        kwargs: Optional[Mapping[str, Any]],
        reply_ranks: tuple[int, ...],
        single: bool,
        timeout: Optional[float],
    ) -> tuple[Router, PendingCall]:
        if not (isinstance(method, str) or callable(method)):
            raise ConfigError(f"method must be a method name or a callable, got {method!r}")
        if timeout is None:
            timeout = self.call_timeout
        elif not timeout > 0:
            raise ConfigError(f"timeout must be > 0, got {timeout!r}")
        if timeout is not None and math.isinf(timeout):
            timeout = None
        self._raise_if_closed()
        everyone = len(reply_ranks) == self.world_size
        with self._dispatch_lock:
            router, gang = self._rt.router, self._rt.gang
            if router is None or gang is None or self._rt.closed:
                raise SupervisorClosed("the supervisor is closed")
            call_id = next(self._ids)
            frame = encode_call(call_id, method, tuple(args), dict(kwargs or {}), None if everyone else frozenset(reply_ranks))
            call = PendingCall(call_id, method_name(method), reply_ranks, single, timeout)
            call.future.set_running_or_notify_cancel()
            router.register(call)
            for box in gang.mailboxes:
                box.post(frame)
        return router, call

    # ----- lifecycle -----

    def _start_gang(self, epoch: int, timeout: float) -> None:
        rendezvous = {"epoch": epoch, "master_addr": "127.0.0.1", "master_port": free_port()}
        self._registry.set_rendezvous(rendezvous)
        gang = Gang(self._spec, epoch, self.control_address, self._authkey, self._rt.workdir)
        gang.start(timeout)
        with self._rt.lock:
            self._rt.gang = gang
            self._rt.router = Router(gang, self._rt.on_fatal, self._rt.on_timeout)
        logger.info(
            "started %s on %d actors (tp=%d, pp=%d), pids %s",
            self._spec.worker,
            self.world_size,
            self.tp_size,
            self.pp_size,
            gang.pids,
        )

    def close(self) -> None:
        """Stop every actor and release every resource. Idempotent; pending calls fail with SupervisorClosed."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"epoch {self.epoch}"
        return f"Supervisor({self._spec.worker!r}, tp_size={self.tp_size}, pp_size={self.pp_size}, {state})"
