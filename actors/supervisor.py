"""`Supervisor`: the handle of a gang of (pp, tp) actors.

It starts the gang, dispatches collective calls (every rank runs the method; the
ranks named reply, and every rank replies on failure), keeps up to
`max_inflight` asynchronous calls outstanding, applies the supervision policy
when the gang breaks, and shuts everything down on `close()`, on garbage
collection and at interpreter exit.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from typing_extensions import Self

from actors.context import RankMap
from actors.control import Address, ControlServer, Registry
from actors.errors import ConfigError
from actors.gang import START_METHODS, GangSpec, ProcessBackend
from actors.messages import Method
from actors.policy import SupervisionPolicy
from actors.ray_gang import RayBackend, RayOptions
from actors.router import GangBroken, PendingCall, Router
from actors.runtime import Runtime, SetupCall

logger = logging.getLogger(__name__)

Rank = Union[int, tuple[int, int]]


def _worker_path(worker: Union[str, type]) -> str:
    if isinstance(worker, str):
        return worker
    if isinstance(worker, type):
        return f"{worker.__module__}:{worker.__qualname__}"
    raise ConfigError(f"worker must be 'package.module:ClassName' or a class, got {worker!r}")


def _cpu_list(cpus: Sequence[int]) -> list[int]:
    """`cpus` as a sorted list of CPUs this process may run on; ConfigError naming what is wrong."""
    if isinstance(cpus, (str, bytes)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cpus):
        raise ConfigError(f"driver_cpus must be a sequence of CPU numbers, got {cpus!r}")
    allowed = os.sched_getaffinity(0)
    if not cpus or not set(cpus) <= allowed:
        raise ConfigError(f"driver_cpus must be some of this process's CPUs {sorted(allowed)}, got {list(cpus)!r}")
    return sorted(set(cpus))


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
        policy: "fail" (default), "restart", or a `SupervisionPolicy` with a restart
            budget. It acts when an actor dies, a deadline passes, or a critical
            call fails.
        fault_plan: an `actors.FaultPlan` for deterministic fault injection.
        env: environment variables set in every actor before the worker is imported
            (after the `preload` modules, which the fork server imported without them:
            variables those read at import time need start_method="spawn").
        cpus: a function of the global rank giving the CPUs that actor may run on.
        driver_cpus: CPUs the reply router's thread runs on (default: wherever the OS puts
            it). A pipeline's first stage waits for the round trip through this process
            between its steps, so its CPUs are free exactly when the router has work.
        control_address: where the control plane listens; default a Unix socket in
            a private directory ("mp") or TCP on this node's address ("ray");
            ("127.0.0.1", 0) for loopback TCP.
        shutdown_grace: seconds actors get to leave on close before SIGTERM/SIGKILL.
        backend: "mp" (default): actors are child processes of this one; "ray": each rank
            is a Ray actor placed through placement groups (needs `pipeactors[ray]`;
            see `actors.RayOptions`). Everything else behaves the same.
        ray_options: an `actors.RayOptions` (placement, resources per rank) for "ray".
        start_method: how "mp" starts actors: "forkserver" (default) forks each one from
            multiprocessing's fork server, a process started once per parent that imports
            `preload` once, so a gang, and a restarted gang, skip those imports; "spawn"
            starts each actor as a fresh interpreter.
        preload: modules the fork server imports before forking actors (e.g. "torch"). The
            server is shared by every gang of this process and keeps the list of the first.
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
        policy: Union[str, SupervisionPolicy, None] = None,
        fault_plan: Any = None,
        env: Optional[Mapping[str, str]] = None,
        cpus: Optional[Callable[[int], Optional[list[int]]]] = None,
        driver_cpus: Optional[Sequence[int]] = None,
        control_address: Optional[Address] = None,
        shutdown_grace: float = 5.0,
        backend: str = "mp",
        ray_options: Optional[RayOptions] = None,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
    ) -> None:
        self._ranks = RankMap(tp_size, pp_size)
        if backend not in ("mp", "ray"):
            raise ConfigError(f"backend must be 'mp' or 'ray', got {backend!r}")
        if start_method not in START_METHODS:
            raise ConfigError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        if isinstance(preload, str) or not all(isinstance(m, str) and m for m in preload):
            raise ConfigError(f"preload must be a sequence of module names, got {preload!r}")
        if ray_options is not None and not isinstance(ray_options, RayOptions):
            raise ConfigError(f"ray_options must be an actors.RayOptions, got {type(ray_options).__name__}")
        if max_inflight is None:
            max_inflight = pp_size
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ConfigError(f"max_inflight must be an integer >= 1, got {max_inflight!r}")
        for name, value in (("start_timeout", start_timeout), ("shutdown_grace", shutdown_grace)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if call_timeout is not None and not call_timeout > 0:
            raise ConfigError(f"call_timeout must be > 0 or None, got {call_timeout!r}")
        if driver_cpus is not None:
            driver_cpus = _cpu_list(driver_cpus)
        spec = GangSpec(
            worker=_worker_path(worker),
            worker_kwargs=dict(worker_kwargs or {}),
            ranks=self._ranks,
            env={str(k): str(v) for k, v in (env or {}).items()},
            cpus=cpus,
            fault_plan=fault_plan,
            start_method=start_method,
            preload=tuple(preload),
        )
        self.policy = SupervisionPolicy.of(policy)
        self.max_inflight = max_inflight
        self.call_timeout = call_timeout
        self.start_timeout = start_timeout
        self.backend = backend
        runner = RayBackend(ray_options, self._ranks) if backend == "ray" else ProcessBackend()
        self._rt = Runtime(spec, self.policy, max_inflight, start_timeout, shutdown_grace, runner, driver_cpus)
        try:
            self._authkey = os.urandom(32)
            address = control_address or runner.default_control_address(self._rt.workdir)
            self._rt.registry = Registry({"epoch": 0})
            self._rt.control = ControlServer(self._rt.registry, address, self._authkey)
            self._rt.authkey = self._authkey
            self._rt.start()
        except BaseException:
            self._rt.shutdown()
            raise
        self._finalizer = weakref.finalize(self, self._rt.shutdown)

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
    def driver_cpus(self) -> Optional[list[int]]:
        """The CPUs the reply router's thread runs on (None: wherever the OS puts it)."""
        return self._rt.driver_cpus

    @property
    def control_address(self) -> Address:
        assert self._rt.control is not None
        return self._rt.control.address

    @property
    def pids(self) -> list[Optional[int]]:
        """Process ids of the current gang's actors, in global-rank order."""
        gang = self._rt.gang
        return gang.pids if gang is not None else []

    @property
    def epoch(self) -> int:
        """Starts at 0; each restart of the gang adds one."""
        return self._rt.epoch

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
        setup: bool = False,
    ) -> list[Any]:
        """Run `worker.method(*args, **kwargs)` on every rank and wait for the replies.

        A callable `method` runs as `method(worker, *args, **kwargs)`. Returns the
        values of `reply_ranks` (default: all ranks) in global-rank order. Raises
        RemoteError if any rank raised, ActorDied if an actor died, ActorTimeout
        past `timeout` (default: the supervisor's call_timeout; math.inf: none),
        GangRestarted if the gang broke and is being restarted.

        `setup=True` records the call (after it succeeds) so that a restarted gang
        replays it, in order, before taking new calls: e.g. init_distributed, load_model.
        """
        ranks = self._reply_ranks(reply_ranks)
        router, call = self._dispatch(method, args, kwargs, ranks, single=False, timeout=timeout)
        result = router.wait(call)
        if setup:
            self._rt.record_setup(SetupCall(method, tuple(args), dict(kwargs or {}), ranks, call.timeout))
        return result

    def submit(
        self,
        method: Method,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        reply_rank: Optional[Rank] = None,
        timeout: Optional[float] = None,
        critical: bool = False,
    ) -> Future:
        """Start `method` on every rank without waiting; the Future resolves to `reply_rank`'s value.

        `reply_rank` defaults to the output rank. At most `max_inflight` submitted
        calls are outstanding; a further submit waits for room. `critical=True`
        means an exception on any rank breaks the gang (the policy acts), for calls
        like execute_model that leave peers inside a collective when one rank fails.
        """
        rank = self.output_rank if reply_rank is None else self._check_rank(reply_rank)
        self._rt.raise_if_unusable()
        slots = self._rt.slots  # the callback must not keep the handle alive
        slots.acquire()
        try:
            router, call = self._dispatch(method, args, kwargs, (rank,), single=True, timeout=timeout, critical=critical)
        except BaseException:
            slots.release()
            raise
        call.future.add_done_callback(lambda _: slots.release())
        router.wake()
        return call.future

    def check_health(self, timeout: float = 5.0) -> dict[tuple[int, int], dict[str, Any]]:
        """Ping every actor on its health pipe; answered by a separate thread, so it
        never waits behind in-flight batches. Raises ActorDied or ActorTimeout."""
        return self._rt.check_health(timeout)

    def status(self) -> dict[str, Any]:
        """A snapshot: state, epoch, restarts, policy, ranks alive, calls in flight, pids."""
        return self._rt.status()

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

    def _dispatch(
        self,
        method: Method,
        args: Sequence[Any],
        kwargs: Optional[Mapping[str, Any]],
        reply_ranks: tuple[int, ...],
        single: bool,
        timeout: Optional[float],
        critical: bool = False,
    ) -> tuple[Router, PendingCall]:
        if not (isinstance(method, str) or callable(method)):
            raise ConfigError(f"method must be a method name or a callable, got {method!r}")
        if timeout is None:
            timeout = self.call_timeout
        elif not timeout > 0:
            raise ConfigError(f"timeout must be > 0, got {timeout!r}")
        if timeout is not None and math.isinf(timeout):
            timeout = None
        body = (method, tuple(args), dict(kwargs or {}))
        while True:
            router = self._rt.current_router(wait_s=self.start_timeout + 60.0)
            try:
                return router, self._rt.post(router, body, reply_ranks, single, timeout, critical)
            except GangBroken:
                continue  # broke between the look and the post: wait for the policy's outcome

    # ----- lifecycle -----

    def close(self) -> None:
        """Stop every actor and release every resource. Idempotent; pending calls fail with SupervisorClosed."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Supervisor({self._rt.spec.worker!r}, tp_size={self.tp_size}, pp_size={self.pp_size}, "
            f"{self._rt.state}, epoch {self.epoch})"
        )

