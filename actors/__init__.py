"""pipeactors' actor runtime: a gang of long-lived (pp, tp) worker processes behind one handle.

Model-agnostic: it hosts any worker class and knows nothing of models or schedulers.
"""

from actors.context import ActorContext, RankMap
from actors.errors import (
    ActorDied,
    ActorError,
    ActorStartupError,
    ActorTimeout,
    BackendUnavailable,
    ConfigError,
    GangRestarted,
    RemoteError,
    RestartBudgetExhausted,
    SerializationError,
    SupervisorClosed,
)
from actors.faults import Fault, FaultPlan, InjectedFault
from actors.gang import prestart
from actors.policy import SupervisionPolicy
from actors.ray_gang import RayOptions
from actors.supervisor import Supervisor

__all__ = [
    "ActorContext",
    "ActorDied",
    "ActorError",
    "ActorStartupError",
    "ActorTimeout",
    "BackendUnavailable",
    "ConfigError",
    "Fault",
    "FaultPlan",
    "GangRestarted",
    "InjectedFault",
    "RankMap",
    "RayOptions",
    "RemoteError",
    "RestartBudgetExhausted",
    "SerializationError",
    "SupervisionPolicy",
    "Supervisor",
    "SupervisorClosed",
    "prestart",
]
