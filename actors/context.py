"""Rank arithmetic of a gang and the context each worker object is built with."""

from __future__ import annotations

from dataclasses import dataclass

from actors.errors import ConfigError


@dataclass(frozen=True)
class RankMap:
    """Maps (pp, tp) coordinates to global ranks: `global_rank = pp * tp_size + tp`.

    TP groups are consecutive global ranks; pipeline neighbours differ by tp_size.
    The output rank (tp 0 of the last stage) is `world_size - tp_size`.
    """

    tp_size: int
    pp_size: int

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def output_rank(self) -> int:
        return self.world_size - self.tp_size

    def rank_of(self, pp: int, tp: int) -> int:
        if not (0 <= pp < self.pp_size and 0 <= tp < self.tp_size):
            raise ConfigError(
                f"(pp={pp}, tp={tp}) is outside a gang of pp_size={self.pp_size}, tp_size={self.tp_size}"
            )
        return pp * self.tp_size + tp

    def coords(self, global_rank: int) -> tuple[int, int]:
        if not 0 <= global_rank < self.world_size:
            raise ConfigError(f"rank {global_rank} is outside a gang of world_size={self.world_size}")
        return divmod(global_rank, self.tp_size)

    def check_rank(self, rank: int | tuple[int, int]) -> int:
        """A global rank from either a global rank or a (pp, tp) pair."""
        if isinstance(rank, tuple):
            return self.rank_of(*rank)
        self.coords(rank)
        return rank


@dataclass(frozen=True)
class ActorContext:
    """Handed to the worker class as `WorkerClass(ctx, **worker_kwargs)` in its actor process.

    `master_addr` and `master_port` are the rendezvous for
    `torch.distributed.init_process_group(init_method=ctx.init_method, ...)`; the
    supervisor picks a free port for every epoch of the gang.
    """

    pp: int
    tp: int
    tp_size: int
    pp_size: int
    master_addr: str
    master_port: int
    epoch: int = 0

    @property
    def global_rank(self) -> int:
        return self.pp * self.tp_size + self.tp

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> tuple[int, int]:
        return (self.pp, self.tp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.is_last_stage and self.tp == 0

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def __str__(self) -> str:
        return f"(pp={self.pp}, tp={self.tp})"
