"""pipeactors' actor runtime: a gang of long-lived (pp, tp) worker processes behind one handle.

Model-agnostic: it hosts any worker class and knows nothing of models or schedulers.
"""

from actors.context import ActorContext, RankMap
from actors.errors import (
    ActorDied,
    ActorError,
    ActorStartupError,
    ActorTimeout,
    ConfigError,
    RemoteError,
    SerializationError,
    SupervisorClosed,
)
from actors.supervisor import Supervisor

__all__ = [
    "ActorContext",
    "ActorDied",
    "ActorError",
    "ActorStartupError",
    "ActorTimeout",
    "ConfigError",
    "RankMap",
    "RemoteError",
    "SerializationError",
    "Supervisor",
    "SupervisorClosed",
]
