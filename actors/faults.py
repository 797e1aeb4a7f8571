"""Deterministic fault injection: on rank (pp, tp), at the n-th call of a method, misbehave.

A `FaultPlan` travels to every actor at startup; each actor keeps only its own
faults and counts each method's calls from 1 in the current epoch. Off unless a
plan is given. Besides worker methods, `method` may be "__init__" (while the
worker is being built, i.e. startup) or "shutdown" (when the actor is told to stop).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Literal, Optional

from actors.errors import ConfigError

Action = Literal["crash", "exit", "raise", "hang", "delay"]
_ACTIONS = ("crash", "exit", "raise", "hang", "delay")


class InjectedFault(RuntimeError):
    """What a `raise` fault raises inside the worker."""


@dataclass(frozen=True)
class Fault:
    """One fault: `action` on `rank` at the `at_call`-th call of `method`.

    crash: SIGKILL itself. exit: os._exit(code) (code = int(seconds) or 1).
    raise: InjectedFault. hang: block until killed. delay: sleep `seconds`, then
    run the call normally. `epoch` limits the fault to one epoch of the gang
    (default 0, the first); None means every epoch.
    """

    rank: tuple[int, int]
    method: str
    at_call: int = 1
    action: Action = "crash"
    seconds: Optional[float] = None
    epoch: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ConfigError(f"fault action must be one of {_ACTIONS}, got {self.action!r}")
        if not isinstance(self.at_call, int) or self.at_call < 1:
            raise ConfigError(f"at_call counts from 1, got {self.at_call!r}")
        if self.action == "delay" and not (self.seconds and self.seconds > 0):
            raise ConfigError("a delay fault needs seconds > 0")
        object.__setattr__(self, "rank", tuple(self.rank))

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """From 'pp,tp:method:at_call:action[:seconds][@epoch]', e.g. '0,1:execute_model:3:crash'."""
        try:
            body, _, epoch = spec.partition("@")
            rank, method, at_call, action, *rest = body.split(":")
            pp, tp = (int(x) for x in rank.split(","))
            seconds = float(rest[0]) if rest else None
            return cls(
                (pp, tp),
                method,
                int(at_call),
                action,  # type: ignore[arg-type]
                seconds,
                None if epoch == "*" else int(epoch) if epoch else 0,
            )
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"bad fault spec {spec!r}: expected 'pp,tp:method:at_call:action[:seconds][@epoch]'"
            ) from exc


class FaultPlan:
    """A list of faults for a gang; pass it as `Supervisor(..., fault_plan=plan)`."""

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.faults = tuple(faults)

    def for_rank(self, rank: tuple[int, int], epoch: int) -> Optional["RankFaults"]:
        mine = [f for f in self.faults if f.rank == tuple(rank) and f.epoch in (None, epoch)]
        return RankFaults(mine) if mine else None

    def __repr__(self) -> str:
        return f"FaultPlan({list(self.faults)!r})"


class RankFaults:
    """The faults of one actor, with its per-method call counts (lives in the actor)."""

    def __init__(self, faults: list[Fault]) -> None:
        self._faults = faults
        self._calls: Counter[str] = Counter()

    def before(self, method: str) -> None:
        self._calls[method] += 1
        for fault in self._faults:
            if fault.method == method and fault.at_call == self._calls[method]:
                _act(fault)


def _act(fault: Fault) -> None:
    if fault.action == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "exit":
        os._exit(int(fault.seconds) if fault.seconds else 1)
    elif fault.action == "raise":
        raise InjectedFault(f"injected fault in {fault.method!r} call {fault.at_call} on rank {fault.rank}")
    elif fault.action == "hang":
        threading.Event().wait()
    elif fault.action == "delay":
        time.sleep(fault.seconds or 0.0)
