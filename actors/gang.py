"""The actor processes of one epoch: start with a readiness barrier, describe deaths, stop.

A gang starts all its actors at once and waits for each one's first message
(ready, or the traceback that stopped it) or its death, within a deadline. It
stops by asking every actor to leave, then after a grace period SIGTERM, then
SIGKILL, and joins each process, so nothing outlives it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

from actors.actor import ActorSpec, actor_main
from actors.context import RankMap
from actors.control import Address, Registry
from actors.errors import (
    ActorDied,
    ActorStartupError,
    SerializationError,
    format_rank,
    unpack_exception,
)
from actors.mailbox import Mailbox
from actors.messages import READY_ID, encode_stop

logger = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")


def start_context(start_method: str, preload: tuple[str, ...] = ()) -> Any:
    """The multiprocessing context that starts actors; for forkserver, with `preload` set.

    The fork server is one per process and imports its preload list once, when it
    starts: every actor forked from it then begins with those modules loaded instead
    of importing them itself (torch alone takes about 2.5 s of CPU). A list set after
    the server started has no effect.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    return ctx


def prestart(preload: Sequence[str] = ()) -> None:
    """Start the fork server now, so that it imports `preload` while the caller does other work."""
    start_context("forkserver", tuple(preload))
    forkserver.ensure_running()


def signal_name(exitcode: Optional[int]) -> Optional[str]:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def spin_us(world_size: int) -> float:
    """How long readers spin before blocking: only when every process has a core of its
    own (actors plus the caller); with more processes than cores a spinner steals the
    core its peer needs. PIPEACTORS_SPIN_US overrides."""
    if "PIPEACTORS_SPIN_US" in os.environ:
        return float(os.environ["PIPEACTORS_SPIN_US"])
    return 100.0 if world_size + 1 <= len(os.sched_getaffinity(0)) else 0.0


# Where rendezvous ports are looked for: below the kernel's ephemeral range.
_RENDEZVOUS_PORTS = (10000, 32768)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _RENDEZVOUS_PORTS[1]


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port free on `host` now, for a rendezvous that binds it a little later.

    A port the kernel hands out for bind(0) comes from its ephemeral range, which every
    outgoing connection and every other bind(0) on the host (Ray starts dozens) draws from
    too, so between this check and the rendezvous binding it, another socket could take it
    (EADDRINUSE). A port below that range is only ever taken by a process asking for that
    very number: a random one of those that binds now is returned, else a bind(0) port.
    """
    high = min(_RENDEZVOUS_PORTS[1], _ephemeral_low())
    rng = random.SystemRandom()
    for _ in range(tries if high > _RENDEZVOUS_PORTS[0] else 0):
        port = rng.randrange(_RENDEZVOUS_PORTS[0], high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class GangSpec:
    """What every epoch of a gang is built from."""

    worker: str
    worker_kwargs: dict[str, Any]
    ranks: RankMap
    env: dict[str, str] = field(default_factory=dict)
    cpus: Optional[Callable[[int], Optional[list[int]]]] = None
    fault_plan: Any = None
    start_method: str = "forkserver"
    preload: tuple[str, ...] = ()


class BaseGang:
    """What the runtime and the router need of one epoch's actors, whatever starts them.

    A backend's gang gives each rank a mailbox (`mailboxes`, whose `conn` also carries
    the replies), a health connection (`health`), and a sentinel: a file descriptor
    that becomes readable once the rank is gone. Subclasses start and stop the actors
    and describe their deaths.
    """

    spec: GangSpec
    epoch: int
    ranks: RankMap
    mailboxes: list[Mailbox]
    health: list[Connection]
    hosts: list[str]
    spin_us: float

    def _init_base(self, spec: GangSpec, epoch: int) -> None:
        self.spec = spec
        self.epoch = epoch
        self.ranks = spec.ranks
        self.mailboxes = []
        self.health = []
        self.hosts = [""] * spec.ranks.world_size
        self._stopped = False
        self._stop_done = threading.Event()
        self._stop_grace = 0.0
        self._lock = threading.Lock()
        self._health_lock = threading.Lock()
        try:
            pickle.dumps(spec.worker_kwargs)
        except Exception as exc:
            raise SerializationError(f"cannot pickle worker_kwargs: {type(exc).__name__}: {exc}") from exc

    @property
    def conns(self) -> list[Connection]:
        return [box.conn for box in self.mailboxes]

    @property
    def sentinels(self) -> list[int]:
        raise NotImplementedError

    @property
    def pids(self) -> list[Optional[int]]:
        raise NotImplementedError

    def start(self, timeout: float, registry: Registry) -> None:
        """Start every actor (after setting the epoch's rendezvous in `registry`) and wait
        until all are ready; on any failure stop them all and raise."""
        raise NotImplementedError

    def num_alive(self) -> int:
        raise NotImplementedError

    def is_down(self, rank: int) -> bool:
        """Whether the rank's actor has ended (or this gang is stopped)."""
        raise NotImplementedError

    def death_of(self, rank: int, during: str = "") -> ActorDied:
        """The ActorDied for a rank whose actor ended (or whose connection closed)."""
        raise NotImplementedError

    def unfinished(self, call_id: int) -> list[int]:
        """Ranks whose last finished call is older than call_id."""
        raise NotImplementedError

    def startup_death_hint(self, rank: int) -> str:
        """What to add to the error of a rank that died before it reported ready ("" when nothing is known)."""
        return ""

    def collect_stacks(self, ranks: list[int], settle: float = 0.3) -> dict[int, str]:
        """Python stacks of the given live ranks."""
        raise NotImplementedError

    def _stop(self, grace: float) -> None:
        raise NotImplementedError

    def _raise_startup_death(self, rank: int) -> None:
        died = self.death_of(rank, during="startup")
        raise ActorStartupError(
            f"worker {self.spec.worker!r} failed to start: {died}{self.startup_death_hint(rank)}", rank=died.rank
        ) from died

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(self.conns))
        by_sentinel = {sentinel: rank for rank, sentinel in enumerate(self.sentinels)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(waiting)
                stacks = self.collect_stacks(ranks)
                names = ", ".join(format_rank(self.ranks.coords(r)) for r in ranks)
                detail = "".join(
                    f"\n--- Python stacks of {format_rank(self.ranks.coords(r))} ---\n{text}" for r, text in stacks.items()
                )
                raise ActorStartupError(
                    f"worker {self.spec.worker!r} not ready within {timeout:g}s on {names}{detail}",
                    rank=self.ranks.coords(ranks[0]),
                )
            ready = wait(list(waiting.values()) + [s for s, r in by_sentinel.items() if r in waiting], left)
            for obj in ready:
                if isinstance(obj, int):
                    rank = by_sentinel[obj]
                    if rank in waiting and not waiting[rank].poll():
                        self._raise_startup_death(rank)
                    continue
                rank = next(r for r, c in waiting.items() if c is obj)
                try:
                    call_id, _, ok, payload = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    self._raise_startup_death(rank)
                assert call_id == READY_ID
                coords = self.ranks.coords(rank)
                if not ok:
                    cause = unpack_exception(payload, coords, "startup", self.pids[rank], self.hosts[rank])
                    raise ActorStartupError(
                        f"worker {self.spec.worker!r} failed to start on {format_rank(coords)}: {cause}",
                        rank=coords,
                    ) from cause
                self.hosts[rank] = payload[1]
                del waiting[rank]

    def ask_health(self, request: bytes, timeout: float, ranks: Optional[list[int]] = None) -> dict[int, Any]:
        """Each live rank's answer to `request` on its health connection: for b"?" a dict
        (pid, max RSS, last call), for b"s" its stacks; ActorDied for a dead rank, None when
        no answer came in time."""
        with self._health_lock:
            answers: dict[int, Any] = {}
            asked = {}
            for rank in range(self.ranks.world_size) if ranks is None else ranks:
                conn = self.health[rank]
                if self._stopped or self.is_down(rank):
                    answers[rank] = self.death_of(rank)
                    continue
                try:
                    conn.send_bytes(request)
                    asked[conn] = rank
                except OSError:
                    answers[rank] = self.death_of(rank)
            deadline = time.monotonic() + timeout
            while asked:
                ready = wait(list(asked), max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                for conn in ready:
                    rank = asked.pop(conn)
                    try:
                        answers[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        answers[rank] = self.death_of(rank)
            for rank in asked.values():
                answers[rank] = None  # no answer in time
            return answers

    def ping(self, timeout: float) -> dict[int, Any]:
        """Each live actor's answer on its health connection (pid, max RSS, last call), or the error."""
        return self.ask_health(b"?", timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Ask each actor to leave, then force it; nothing outlives the gang. Idempotent: a
        second caller returns when the first one's stop is done (bounded)."""
        with self._lock:
            first = not self._stopped
            if first:
                self._stopped = True
                self._stop_grace = grace
        if not first:
            # The first stop takes at most its grace, then 1 s after SIGTERM and 5 s after SIGKILL.
            if not self._stop_done.wait(timeout=self._stop_grace + 7.0):
                logger.warning("epoch %d: the gang's stop in another thread is still running", self.epoch)
            return
        try:
            self._stop(grace)
        finally:
            self._stop_done.set()


class Gang(BaseGang):
    """One epoch's actor processes (multiprocessing forkserver or spawn), their pipes and the shared progress counters."""

    def __init__(
        self,
        spec: GangSpec,
        epoch: int,
        control_address: Address,
        authkey: bytes,
        workdir: str,
        pdeathsig: bool = True,
    ) -> None:
        """`pdeathsig`: arm the kernel's parent-death signal in the actors; only safe when
        the thread that starts them lives as long as they should (it fires when that
        thread ends, not the process)."""
        self._init_base(spec, epoch)
        world = self.ranks.world_size
        # One int64 per rank: the id of the last call it finished. Read only to
        # name the ranks behind a missed deadline, so it costs the hot path nothing.
        ctx = start_context(spec.start_method, spec.preload)
        self.progress = ctx.RawArray("q", world)
        self.stack_files = [os.path.join(workdir, f"stacks-e{epoch}-r{r}.txt") for r in range(world)]
        self.processes: list[mp.process.BaseProcess] = []
        self._child_ends: list[Connection] = []
        # The write ends of the actors' lifelines: never written, closed once the actors are gone.
        self._lifelines: list[Connection] = []
        self.spin_us = spin_us(world)
        for rank in range(world):
            ours, theirs = ctx.Pipe(duplex=True)
            health_ours, health_theirs = ctx.Pipe(duplex=True)
            lifeline, lifeline_w = ctx.Pipe(duplex=False)
            self._lifelines.append(lifeline_w)
            self.health.append(health_ours)
            pp, tp = self.ranks.coords(rank)
            actor = ActorSpec(
                worker=spec.worker,
                worker_kwargs=spec.worker_kwargs,
                global_rank=rank,
                tp_size=self.ranks.tp_size,
                pp_size=self.ranks.pp_size,
                epoch=epoch,
                control_address=control_address,
                authkey=authkey,
                conn=theirs,
                health_conn=health_theirs,
                progress=self.progress,
                stack_file=self.stack_files[rank],
                lifeline=lifeline,
                pdeathsig=pdeathsig,
                env=dict(spec.env),
                cpus=spec.cpus(rank) if spec.cpus else None,
                fault_plan=spec.fault_plan,
                spin_us=self.spin_us,
            )
            proc = ctx.Process(
                target=actor_main, args=(actor,), name=f"pipeactors-e{epoch}-pp{pp}-tp{tp}", daemon=True
            )
            self.processes.append(proc)
            self.mailboxes.append(Mailbox(ours, f"pp{pp}-tp{tp}"))
            self._child_ends += [theirs, health_theirs, lifeline]

    @property
    def sentinels(self) -> list[int]:
        return [proc.sentinel for proc in self.processes]

    @property
    def pids(self) -> list[Optional[int]]:
        return [proc.pid for proc in self.processes]

    def num_alive(self) -> int:
        return sum(p.pid is not None and p.exitcode is None for p in self.processes)

    def is_down(self, rank: int) -> bool:
        return self.processes[rank].exitcode is not None

    def start(self, timeout: float, registry: Registry) -> None:
        registry.set_rendezvous({"epoch": self.epoch, "master_addr": "127.0.0.1", "master_port": free_port()})
        try:
            for proc in self.processes:
                proc.start()
        except BaseException:
            self.stop(grace=0.0)
            raise
        for end in self._child_ends:  # the children hold their own copies now
            end.close()
        self._child_ends = []
        try:
            self._await_ready(timeout)
        except BaseException:
            self.stop(grace=0.5)
            raise

    def death_of(self, rank: int, during: str = "") -> ActorDied:
        proc = self.processes[rank]
        with self._lock:  # two threads may see the death at once; one reaps
            proc.join(timeout=1.0)
        return ActorDied(self.ranks.coords(rank), proc.exitcode, signal_name(proc.exitcode), proc.pid, during)

    def unfinished(self, call_id: int) -> list[int]:
        return [rank for rank in range(self.ranks.world_size) if self.progress[rank] < call_id]

    def startup_death_hint(self, rank: int) -> str:
        # actor_main creates the stack file first: without it the process died while
        # multiprocessing was still bootstrapping it, i.e. re-importing the parent's
        # main module or unpickling the actor's spec.
        if os.path.exists(self.stack_files[rank]):
            return ""
        return (
            "; it died before the actor started (its traceback is on stderr). Actors "
            "re-import the parent's main module: a script must start the Supervisor (or LLM) "
            "under `if __name__ == \"__main__\":`"
        )

    def collect_stacks(self, ranks: list[int], settle: float = 0.3) -> dict[int, str]:
        # Dumped by faulthandler on SIGUSR1: works even while the actor holds the GIL in C code.
        offsets: dict[int, int] = {}
        for rank in ranks:
            proc = self.processes[rank]
            if proc.pid is None or not proc.is_alive():
                continue
            try:
                offsets[rank] = os.path.getsize(self.stack_files[rank])
            except OSError:
                offsets[rank] = 0
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                offsets.pop(rank)
        if not offsets:
            return {}
        time.sleep(settle)
        stacks = {}
        for rank, offset in offsets.items():
            try:
                with open(self.stack_files[rank]) as f:
                    f.seek(offset)
                    stacks[rank] = f.read()
            except OSError:
                pass
        return stacks

    def _stop(self, grace: float) -> None:
        started = [p for p in self.processes if p.pid is not None]
        if grace > 0:
            stop = encode_stop()
            for proc, box in zip(self.processes, self.mailboxes):
                if proc.pid is not None and proc.exitcode is None:
                    box.post(stop)
        deadline = time.monotonic() + grace
        for proc in started:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for sig_name, wait_s in (("terminate", 1.0), ("kill", 5.0)):
            alive = [p for p in started if p.exitcode is None]
            if not alive:
                break
            for proc in alive:
                logger.debug("sending %s to actor pid %s", sig_name, proc.pid)
                getattr(proc, sig_name)()
            deadline = time.monotonic() + wait_s
            for proc in alive:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for box in self.mailboxes:
            box.close()
        for conn in self.health:
            conn.close()
        for end in self._child_ends:
            end.close()
        self._child_ends = []
        for end in self._lifelines:  # an actor somehow still alive leaves on this EOF
            end.close()
        self._lifelines = []
        for path in self.stack_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class ProcessBackend:
    """The default backend ("mp"): actors are `multiprocessing` children of this process
    (forked from its fork server by default, or spawned)."""

    name = "mp"

    def default_control_address(self, workdir: str) -> Address:
        return os.path.join(workdir, "control.sock")

    def new_gang(self, spec: GangSpec, epoch: int, control_address: Address, authkey: bytes, workdir: str) -> Gang:
        return Gang(spec, epoch, control_address, authkey, workdir, pdeathsig=True)

    def close(self) -> None:
        pass
