"""Supervision policy as data, after Erlang/OTP: a strategy plus a restart intensity.

The only strategy that makes sense for a TP/PP gang is OTP's `one_for_all`: its
ranks share communicators, so one death poisons them all. `fail` shuts the gang
down; `restart` tears it down and starts a fresh one, at most `max_restarts`
times within any `period_s` window, after which it escalates to `fail`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Literal, Union

from actors.errors import ConfigError

Strategy = Literal["fail", "restart"]


@dataclass(frozen=True)
class SupervisionPolicy:
    """What the supervisor does when its gang breaks (a death, a missed deadline, a critical error)."""

    strategy: Strategy = "fail"
    max_restarts: int = 3
    period_s: float = 60.0

    def __post_init__(self) -> None:
        if self.strategy not in ("fail", "restart"):
            raise ConfigError(f"policy must be 'fail' or 'restart', got {self.strategy!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.period_s > 0:
            raise ConfigError(f"period_s must be > 0, got {self.period_s!r}")

    @classmethod
    def of(cls, policy: Union[str, "SupervisionPolicy", None]) -> "SupervisionPolicy":
        if policy is None:
            return cls()
        if isinstance(policy, SupervisionPolicy):
            return policy
        return cls(strategy=policy)  # type: ignore[arg-type]


class RestartBudget:
    """Counts restarts in a sliding window; `allow()` says whether one more fits."""

    def __init__(self, policy: SupervisionPolicy) -> None:
        self.policy = policy
        self.total = 0
        self._times: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        if self.policy.strategy != "restart":
            return False
        now = time.monotonic()
        while self._times and now - self._times[0] > self.policy.period_s:
            self._times.popleft()
        if len(self._times) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        self.total += 1
        return True
