"""The actor process: builds the worker object, then serves its mailbox until told to stop.

Runs in a process started by multiprocessing's `forkserver` (the default: a fork of
a server that imported the heavy modules once) or `spawn` method. It dies with the
process that started the gang even when that one is SIGKILLed: a watcher thread
ends the actor when its lifeline pipe, whose only write end the parent holds,
reports EOF, and the kernel's parent-death signal covers an actor stuck in C code
(under forkserver it fires when the fork server ends, which it does once the
parent and every actor are gone).
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import logging
import os
import pickle
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

from actors.context import ActorContext
from actors.control import Address, connect_registry
from actors.errors import SerializationError, format_rank, pack_exception
from actors.messages import READY_ID, STOP, decode_header, dumps

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass
class ActorSpec:
    """Everything an actor process needs; pickled into the spawned child."""

    worker: str
    worker_kwargs: dict[str, Any]
    global_rank: int
    tp_size: int
    pp_size: int
    epoch: int
    control_address: Address
    authkey: bytes
    conn: Connection
    health_conn: Connection
    progress: Any  # multiprocessing RawArray('q'): last call id each rank finished
    stack_file: str
    lifeline: Connection  # read end; EOF once the parent process is gone
    pdeathsig: bool
    env: dict[str, str] = field(default_factory=dict)
    cpus: Optional[list[int]] = None
    fault_plan: Any = None
    spin_us: float = 0.0

    @property
    def coords(self) -> tuple[int, int]:
        return divmod(self.global_rank, self.tp_size)


def import_worker(path: str) -> type:
    """The class named by 'package.module:ClassName'."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ImportError(f"worker must be given as 'package.module:ClassName', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {qualname!r}") from None
    return obj


def _arm_parent_death(spec: ActorSpec) -> None:
    if spec.pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    lifeline = spec.lifeline

    def watch() -> None:  # also ends at once when the parent died before this started
        wait([lifeline])
        os._exit(1)

    threading.Thread(target=watch, name="pipeactors-parent-watch", daemon=True).start()


def _build_worker(spec: ActorSpec, faults: Any) -> Any:
    if faults is not None:
        faults.before("__init__")
    registry = connect_registry(spec.control_address, spec.authkey)
    rendezvous = registry.rendezvous()
    registry.register(spec.global_rank, spec.epoch, os.getpid(), socket.gethostname())
    pp, tp = spec.coords
    ctx = ActorContext(
        pp=pp,
        tp=tp,
        tp_size=spec.tp_size,
        pp_size=spec.pp_size,
        master_addr=rendezvous["master_addr"],
        master_port=rendezvous["master_port"],
        epoch=spec.epoch,
    )
    cls = import_worker(spec.worker)
    return cls(ctx, **spec.worker_kwargs)


def _resolve(worker: Any, method: Any) -> Any:
    if not isinstance(method, str):
        return partial(method, worker)
    if method.startswith("_"):
        raise AttributeError(f"{type(worker).__name__} method {method!r} is private")
    fn = getattr(worker, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{type(worker).__name__} has no method {method!r}")
    return fn


def actor_main(spec: ActorSpec) -> None:
    """Entry point of an actor process."""
    _arm_parent_death(spec)
    # Stacks on demand (SIGUSR1) for hang reports; tracebacks on a crash. The file's
    # existence also tells the parent that this process got past multiprocessing's
    # bootstrap (Gang.startup_death_hint), so it is created before anything that can fail.
    stack_out = open(spec.stack_file, "a")
    os.environ.update(spec.env)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    faulthandler.enable(file=sys.stderr)
    run_actor(spec, spec.conn, spec.health_conn, spec.progress)


def run_actor(spec: Any, conn: Connection, health_conn: Connection, progress: Any) -> None:
    """Build the worker, report readiness on `conn`, serve calls until told to stop, shut down.

    Shared by every backend: `spec` needs the fields of `ActorSpec` that name the worker,
    the rank, the epoch, the control plane and the fault plan; `progress[global_rank]`
    is set to the id of each call as it finishes.
    """
    rank = spec.global_rank
    threading.Thread(
        target=_answer_health, args=(health_conn, rank, progress), name="pipeactors-health", daemon=True
    ).start()
    faults = spec.fault_plan.for_rank(spec.coords, spec.epoch) if spec.fault_plan is not None else None
    try:
        worker = _build_worker(spec, faults)
    except BaseException as exc:  # report any failure, even SystemExit from a constructor
        conn.send_bytes(pickle.dumps((READY_ID, rank, False, pack_exception(exc))))
        return
    conn.send_bytes(pickle.dumps((READY_ID, rank, True, (os.getpid(), socket.gethostname()))))
    _serve(conn, worker, rank, progress, faults, spec.spin_us)
    try:
        if faults is not None:
            faults.before("shutdown")
        shutdown = getattr(worker, "shutdown", None)
        if callable(shutdown):
            shutdown()
    except Exception:
        logger.exception("shutdown of the worker on %s failed", format_rank(spec.coords))


def _answer_health(conn: Connection, rank: int, progress: Any) -> None:
    """Answers pings (b"?") and stack requests (b"s") on its own pipe and thread, so a
    health check never waits behind a call."""
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if request == b"s":
            answer: Any = _thread_stacks()
        else:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            answer = {"pid": os.getpid(), "max_rss_kb": usage.ru_maxrss, "last_call": progress[rank]}
        try:
            conn.send_bytes(pickle.dumps(answer))
        except OSError:
            return


def _thread_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints them (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        return out.read()


def _serve(conn: Connection, worker: Any, rank: int, progress: Any, faults: Any, spin_us: float) -> None:
    spin_s = spin_us * 1e-6
    while True:
        try:
            if spin_s:
                # Spin briefly before blocking: an idle vCPU here is halted at once and
                # waking it costs 50-100 us; a call often follows a call.
                end = time.perf_counter() + spin_s
                while not conn.poll(0) and time.perf_counter() < end:
                    pass
            frame = conn.recv_bytes()
        except (EOFError, OSError):  # the supervisor is gone
            return
        (kind, call_id, reply_ranks), body = decode_header(frame)
        if kind == STOP:
            return
        replies = reply_ranks is None or rank in reply_ranks
        reply: Optional[bytes] = None
        name = "?"
        try:
            method, args, kwargs = pickle.loads(body)
            name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
            fn = _resolve(worker, method)
            if faults is not None:
                faults.before(name)
            value = fn(*args, **kwargs)
            if replies:
                try:
                    reply = dumps((call_id, rank, True, value))
                except Exception as exc:
                    raise SerializationError(
                        f"cannot pickle the result of {name!r}: {type(exc).__name__}: {exc}"
                    ) from exc
        except Exception as exc:
            reply = dumps((call_id, rank, False, pack_exception(exc)))
        progress[rank] = call_id
        if reply is not None:
            conn.send_bytes(reply)
