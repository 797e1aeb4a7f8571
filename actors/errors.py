"""The exceptions of the actor runtime, and how a remote exception travels home.

A failure in an actor reaches the caller as a `RemoteError` that is also an
instance of the original exception's type where Python allows it, so both
`except RemoteError` and `except ValueError` catch a remote `ValueError`. The
remote traceback travels with tblib and becomes the `__cause__`'s traceback.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any, Optional, Sequence

import tblib

Coords = tuple[int, int]


def format_rank(rank: Optional[Coords]) -> str:
    return "supervisor" if rank is None else f"rank (pp={rank[0]}, tp={rank[1]})"


class ActorError(Exception):
    """Base class of every error the actor runtime raises."""


class BackendUnavailable(ActorError, ImportError):
    """The chosen backend cannot run here (its package is missing); the message says how to install it."""


class ConfigError(ActorError, ValueError):
    """A gang or call was configured with values that cannot work."""


class SupervisorClosed(ActorError, RuntimeError):
    """The supervisor was closed (or its gang shut down) before or during the call."""


class SerializationError(ActorError, TypeError):
    """An argument or result could not be pickled or unpickled."""

    def __init__(self, message: str, rank: Optional[Coords] = None) -> None:
        super().__init__(message)
        self.rank = rank


class ActorDied(ActorError):
    """An actor process ended while the gang was running.

    `rank` is (pp, tp); `exitcode` is the process exit status (negative for a
    signal, as multiprocessing reports it); `signal` is the signal's name or None;
    `cause` is the backend's account when it has one (Ray's, say) instead of a status.
    """

    def __init__(
        self,
        rank: Coords,
        exitcode: Optional[int],
        signal: Optional[str] = None,
        pid: Optional[int] = None,
        during: str = "",
        cause: str = "",
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.signal = signal
        self.pid = pid
        self.during = during
        self.cause = cause
        how = cause or (f"killed by {signal}" if signal else f"exited with code {exitcode}")
        where = f" during {during}" if during else ""
        super().__init__(f"actor {format_rank(rank)} pid {pid} died{where}: {how}")

    def __reduce__(self) -> Any:
        return (type(self), (self.rank, self.exitcode, self.signal, self.pid, self.during, self.cause))


class ActorTimeout(ActorError, TimeoutError):
    """A call passed its deadline; `ranks` are the (pp, tp) ranks that had not answered.

    `stacks` maps a rank to the Python stacks of its threads when they could be
    collected (faulthandler), else is empty.
    """

    def __init__(
        self,
        method: str,
        call_id: int,
        timeout: float,
        ranks: Sequence[Coords],
        stacks: Optional[dict[Coords, str]] = None,
    ) -> None:
        self.method = method
        self.call_id = call_id
        self.timeout = timeout
        self.ranks = list(ranks)
        self.stacks = dict(stacks or {})
        names = ", ".join(format_rank(r) for r in self.ranks) or "none"
        message = f"call {call_id} {method!r} timed out after {timeout:g}s; not answered by {names}"
        for rank, text in self.stacks.items():
            message += f"\n--- Python stacks of {format_rank(rank)} ---\n{text.rstrip()}"
        super().__init__(message)

    def __reduce__(self) -> Any:
        return (type(self), (self.method, self.call_id, self.timeout, self.ranks, self.stacks))


class GangRestarted(ActorError):
    """The gang broke and is being replaced (policy "restart"): the call did not complete; retry it.

    `epoch` is the epoch that broke; `cause` (also `__cause__`) what broke it.
    """

    retryable = True

    def __init__(self, epoch: int, cause: Optional[BaseException] = None) -> None:
        self.epoch = epoch
        self.cause = cause
        super().__init__(f"gang epoch {epoch} is being restarted after: {cause}")
        self.__cause__ = cause

    def __reduce__(self) -> Any:
        return (type(self), (self.epoch, self.cause))


class RestartBudgetExhausted(ActorError):
    """Policy "restart" gave up: the gang broke more than `max_restarts` times within `period_s`.

    `cause` (also `__cause__`) is what broke the gang last. Built by
    `restart_budget_exhausted`, it is also an instance of the cause's type where
    Python allows (as RemoteError is), so `except ActorDied` still catches a death
    that spent the budget, and the cause's attributes (`rank`, `ranks`, ...) are there.
    """

    cause: Optional[BaseException]

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause

    def __str__(self) -> str:
        return self.__dict__.get("message", "")

    def __reduce__(self) -> Any:
        return (restart_budget_exhausted, (self.message, self.cause))


def restart_budget_exhausted(message: str, cause: Optional[BaseException]) -> RestartBudgetExhausted:
    """A RestartBudgetExhausted that is also of `cause`'s type where Python allows."""
    if cause is None:
        return RestartBudgetExhausted(message)
    cls = _combined_class(RestartBudgetExhausted, type(cause), "RestartBudgetExhausted")
    err = cls.__new__(cls)
    err.__dict__.update(getattr(cause, "__dict__", {}))
    err.args = (message,)
    err.message = message
    err.cause = cause
    err.__cause__ = cause
    return err


class ActorStartupError(ActorError):
    """The gang could not start: a worker failed to import or construct, or did not get ready in time."""

    def __init__(self, message: str, rank: Optional[Coords] = None) -> None:
        super().__init__(message)
        self.rank = rank


class RemoteError(ActorError):
    """An exception raised by a worker method in an actor.

    `cause` is the original exception (with its remote traceback attached),
    `rank` the (pp, tp) where it happened, `remote_traceback` the formatted text.
    """

    rank: Optional[Coords]
    method: str
    cause: Optional[BaseException]
    remote_traceback: str
    pid: Optional[int]
    host: str

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return self.__dict__.get("message", "")

    def __getattr__(self, name: str) -> Any:
        # Attributes of the original exception (errno, filename, ...) stay reachable.
        cause = self.__dict__.get("cause")
        if cause is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(cause, name)

    def __reduce__(self) -> Any:
        return (
            _rebuild_remote_error,
            (self.cause, self.rank, self.method, self.remote_traceback, self.pid, self.host, self.type_name),
        )


_COMBINED: dict[tuple[type, type], type] = {}


def _combined_class(base: type, cause_type: type, name: str) -> type:
    """A class that is both `base` and the cause's type (so `except ValueError` still
    catches a remote ValueError), cached per pair; `base` alone where Python refuses."""
    key = (base, cause_type)
    cls = _COMBINED.get(key)
    if cls is None:
        cls = base
        if issubclass(cause_type, Exception) and not issubclass(cause_type, base):
            try:
                cls = type(name, (base, cause_type), {"__module__": __name__})
            except TypeError:  # incompatible layouts (some C types): keep the plain class
                cls = base
        _COMBINED[key] = cls
    return cls


def _rebuild_remote_error(
    cause: Optional[BaseException],
    rank: Optional[Coords],
    method: str,
    remote_tb: str,
    pid: Optional[int],
    host: str,
    type_name: str,
) -> RemoteError:
    cls = _combined_class(RemoteError, type(cause), f"Remote{type(cause).__name__}") if cause is not None else RemoteError
    err = cls.__new__(cls)
    where = f"{format_rank(rank)} (pid {pid} on {host})"
    summary = type_name + (f": {cause}" if cause is not None and str(cause) else "")
    if cause is not None:
        # The original's own state: args, instance attributes, and OSError's C-level fields.
        err.args = cause.args
        err.__dict__.update(getattr(cause, "__dict__", {}))
        if isinstance(cause, OSError) and isinstance(err, OSError):
            for name in ("errno", "strerror", "filename", "filename2"):
                setattr(err, name, getattr(cause, name))
    err.message = f"{summary}\n  raised in {method!r} on {where}\n{remote_tb.rstrip()}"
    err.rank = rank
    err.method = method
    err.cause = cause
    err.remote_traceback = remote_tb
    err.pid = pid
    err.host = host
    err.type_name = type_name
    if cause is not None:
        err.__cause__ = cause
    return err


def pack_exception(exc: BaseException) -> bytes:
    """Everything needed to rebuild `exc` in another process, as bytes that always unpickle."""
    original_tb = exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, original_tb))
    tb_dict = tblib.Traceback(original_tb).as_dict() if original_tb else None
    try:
        blob: Optional[bytes] = pickle.dumps(exc.with_traceback(None))
        pickle.loads(blob)  # some exceptions pickle but fail to unpickle
    except Exception:
        blob = None
    finally:
        exc.with_traceback(original_tb)  # leave the caller's exception as it was
    name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    return pickle.dumps((blob, tb_dict, text, name, str(exc)))


def unpack_exception(
    packed: bytes, rank: Optional[Coords], method: str, pid: Optional[int], host: str
) -> RemoteError:
    """The RemoteError for an exception packed by `pack_exception` on `rank`."""
    blob, tb_dict, text, name, message = pickle.loads(packed)
    cause: Optional[BaseException] = None
    if blob is not None:
        try:
            cause = pickle.loads(blob)
        except Exception:
            cause = None
    if cause is None:
        cause = Exception(f"{name}: {message}")
    elif tb_dict is not None:
        try:
            cause = cause.with_traceback(tblib.Traceback.from_dict(tb_dict).as_traceback())
        except Exception:  # a traceback that cannot be rebuilt must not hide the error
            pass
    return _rebuild_remote_error(cause, rank, method, text, pid, host, name)
