"""The Ray backend: each (pp, tp) rank is a Ray actor, placed through placement groups.

Ray places, starts and watches the processes; everything above the gang is
unchanged. Calls and replies still travel on our own framed connections (TCP
here, authkey-checked, one per rank plus one for health), the control plane is
the same authkey-protected registry, and torch.distributed rendezvous on the
node of rank 0. Ray never restarts an actor (`max_restarts=0`): a restart is the
supervisor's decision, made for the whole gang, and each epoch listens on a new
port with a new token, so an actor of an earlier epoch cannot join a later one.

`ray` is imported only when this backend is chosen; `RayOptions` needs no Ray.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from typing import Any, Mapping, Optional, Sequence

from actors.actor import run_actor
from actors.context import RankMap
from actors.control import Address, Registry
from actors.errors import ActorDied, ActorStartupError, BackendUnavailable, ConfigError, format_rank
from actors.gang import BaseGang, GangSpec, free_port, spin_us
from actors.mailbox import Mailbox
from actors.messages import encode_stop

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install 'pipeactors[ray]'"

# How long death_of waits for Ray's own account of a death the connection saw first.
_RAY_VERDICT_S = 2.0


@dataclass(frozen=True)
class RayOptions:
    """How the Ray backend places and sizes the ranks.

    Args:
        num_cpus: logical CPUs each rank reserves in its bundle.
        num_gpus: GPUs each rank reserves (Ray then sets CUDA_VISIBLE_DEVICES per actor).
        stage_resources: per pipeline stage, extra resources each of its ranks reserves,
            e.g. `[{"node_a": 0.01}, {"node_b": 0.01}]` with nodes started with those
            custom resources: how stages are put on chosen nodes.
        spread_stages: put every pipeline stage on a different node (a STRICT_SPREAD
            group with one bundle per stage, sized for its TP ranks); by default each
            stage is its own STRICT_PACK group of one bundle per rank, so a TP group
            always shares a node and stages go where Ray finds room.
        address: given to `ray.init()` when Ray is not initialised yet; None connects to
            the cluster Ray finds (RAY_ADDRESS, or one started with `ray start`) or else
            starts a local one (without the dashboard). Call `ray.init()` yourself for more.
        runtime_env: the actors' Ray runtime_env.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    stage_resources: Optional[Sequence[Mapping[str, float]]] = None
    spread_stages: bool = False
    address: Optional[str] = None
    runtime_env: Optional[Mapping[str, Any]] = None

    def validate(self, ranks: RankMap) -> None:
        if not self.num_cpus >= 0 or not self.num_gpus >= 0:
            raise ConfigError(f"RayOptions num_cpus and num_gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}")
        if self.num_cpus == 0 and self.num_gpus == 0 and not self.stage_resources:
            raise ConfigError("RayOptions must reserve something per rank (num_cpus, num_gpus or stage_resources)")
        if self.stage_resources is not None and len(self.stage_resources) != ranks.pp_size:
            raise ConfigError(
                f"RayOptions.stage_resources gives {len(self.stage_resources)} stages, pp_size is {ranks.pp_size}"
            )

    def rank_resources(self, stage: int) -> dict[str, float]:
        """What one rank of `stage` reserves, as a placement-group bundle."""
        bundle: dict[str, float] = {}
        if self.num_cpus:
            bundle["CPU"] = float(self.num_cpus)
        if self.num_gpus:
            bundle["GPU"] = float(self.num_gpus)
        if self.stage_resources is not None:
            bundle.update({str(k): float(v) for k, v in self.stage_resources[stage].items()})
        return bundle


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailable(f"backend='ray' needs Ray, which is not installed here: {RAY_INSTALL_HINT}") from exc
    return ray


def local_ray_cpus(options: RayOptions, ranks: RankMap) -> int:
    """Logical CPUs for a local Ray instance started for this gang.

    Ray's default is the core count, and each rank reserves `options.num_cpus`: a
    TP2xPP2 gang on 2 cores would never be placed. Like the "mp" backend, which
    starts world_size processes whatever the core count, a local instance gets
    enough logical CPUs for the whole gang.
    """
    return max(os.cpu_count() or 1, math.ceil(ranks.world_size * options.num_cpus))


def _init_ray(ray: Any, options: RayOptions, ranks: RankMap) -> None:
    """`ray.init()` as Ray would do it: the cluster named or found, else a local instance that fits the gang."""
    if options.address is not None:
        ray.init(address=options.address, include_dashboard=False)
        return
    cpus = local_ray_cpus(options, ranks)
    try:
        ray.init(num_cpus=cpus, include_dashboard=False)
    except ValueError as exc:
        # Ray found a running cluster (RAY_ADDRESS, or `ray start` on this host), whose
        # size is its own: connect to it as it is.
        if "existing cluster" not in str(exc):
            raise
        ray.init(include_dashboard=False)
    else:
        logger.info("started a local Ray with %d logical CPUs for %d ranks on %s cores", cpus, ranks.world_size, os.cpu_count())


def _scheduling_resources(resources: Mapping[str, float]) -> dict[str, float]:
    """A resource dict for a message: without Ray's per-placement-group and per-node-address entries."""
    return {k: v for k, v in resources.items() if "_group_" not in k and not k.startswith("node:")}


def check_fits(
    nodes: Sequence[Mapping[str, float]], groups: Sequence[tuple[str, Sequence[Mapping[str, float]]]]
) -> Optional[str]:
    """Why `groups` (strategy, bundles) can never be placed on `nodes` (each node's total resources), or None.

    Judged on totals, not on what is free now: a gang that needs more than the cluster
    has fails at once instead of waiting out its start timeout.
    """

    def fits(node: Mapping[str, float], need: Mapping[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items())

    for strategy, bundles in groups:
        if strategy == "STRICT_PACK":
            need: dict[str, float] = {}
            for bundle in bundles:
                for k, v in bundle.items():
                    need[k] = need.get(k, 0.0) + v
            if not any(fits(node, need) for node in nodes):
                return f"no node has {need} for one stage (a TP group shares a node)"
        else:  # STRICT_SPREAD: each bundle on its own node (greedy: bundles are alike in practice)
            free = list(nodes)
            for bundle in sorted(bundles, key=lambda b: -sum(b.values())):
                host = next((n for n in free if fits(n, bundle)), None)
                if host is None:
                    return f"{len(bundles)} stages on distinct nodes need {list(bundles)}, and too few nodes can hold one"
                free.remove(host)
    return None


class RayBackend:
    """The "ray" backend: connects to (or starts) Ray once, then builds a `RayGang` per epoch."""

    name = "ray"

    def __init__(self, options: Optional[RayOptions], ranks: RankMap) -> None:
        self.options = options or RayOptions()
        self.options.validate(ranks)
        self.ray = import_ray()
        if not self.ray.is_initialized():
            _init_ray(self.ray, self.options, ranks)
        self.node_ip = self.ray.util.get_node_ip_address()

    def default_control_address(self, workdir: str) -> Address:
        # Actors on other nodes must reach it: TCP on this node's address.
        return (self.node_ip, 0)

    def new_gang(self, spec: GangSpec, epoch: int, control_address: Address, authkey: bytes, workdir: str) -> "RayGang":
        return RayGang(spec, epoch, control_address, authkey, self.node_ip, self.options, self.ray)

    def close(self) -> None:
        pass  # the Ray instance is the user's (a local one ends with this process)


@dataclass
class RayActorSpec:
    """What one rank's Ray actor needs to join its gang (pickled into the actor)."""

    worker: str
    worker_kwargs: dict[str, Any]
    global_rank: int
    tp_size: int
    pp_size: int
    epoch: int
    control_address: Address
    authkey: bytes
    gang_address: tuple[str, int]
    token: bytes
    env: dict[str, str] = field(default_factory=dict)
    cpus: Optional[list[int]] = None
    fault_plan: Any = None
    spin_us: float = 0.0
    sys_path: list[str] = field(default_factory=list)

    @property
    def coords(self) -> tuple[int, int]:
        return divmod(self.global_rank, self.tp_size)


def _no_delay(conn: Connection) -> None:
    # Small request/reply frames: Nagle's algorithm would hold the second of two back to back.
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


class RayActorHost:
    """The body of one rank's Ray actor: `describe` once placed, then `serve` until told to stop."""

    def describe(self, pick_port: bool) -> dict[str, Any]:
        import ray

        ip = ray.util.get_node_ip_address()
        return {
            "ip": ip,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "port": free_port(ip) if pick_port else None,
        }

    def serve(self, spec: RayActorSpec) -> str:
        os.environ.update(spec.env)
        for path in spec.sys_path:  # as multiprocessing's spawn does; missing paths are harmless
            if path not in sys.path:
                sys.path.append(path)
        if spec.cpus:
            allowed = set(spec.cpus) & os.sched_getaffinity(0)
            if allowed:
                os.sched_setaffinity(0, allowed)
        conn, health = (self._join(spec, channel) for channel in ("call", "health"))
        progress = [0] * (spec.tp_size * spec.pp_size)
        try:
            run_actor(spec, conn, health, progress)
        finally:
            conn.close()
            health.close()
        return "stopped"

    @staticmethod
    def _join(spec: RayActorSpec, channel: str) -> Connection:
        # Say who we are at once: the gang accepts one connection at a time.
        conn = Client(spec.gang_address, authkey=spec.authkey)
        _no_delay(conn)
        conn.send((channel, spec.epoch, spec.global_rank, spec.token))
        return conn


_remote_host: Any = None


def _host_class(ray: Any) -> Any:
    global _remote_host
    if _remote_host is None:
        _remote_host = ray.remote(RayActorHost)
    return _remote_host


def _ray_cause(outcome: Any) -> tuple[Optional[int], str]:
    """The exit code (when Ray names one) and a one-line account of how an actor ended."""
    if outcome is None:
        return None, "its connection closed (Ray has not reported the actor dead yet)"
    if not isinstance(outcome, BaseException):
        return 0, "it left"
    text = " ".join(str(outcome).split())
    code = re.search(r"exit code (-?\d+)", text)
    detail = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*?)(?: There are some potential| The actor| $)", text)
    summary = f"{detail.group(1)}: {detail.group(2)}" if detail else text[:300]
    return (int(code.group(1)) if code else None), f"Ray reports {type(outcome).__name__}: {summary}"


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class RayGang(BaseGang):
    """One epoch's ranks as Ray actors: placement groups, actors, our connections to them, and a
    watcher thread that turns each actor's end (as Ray reports it) into a readable sentinel."""

    def __init__(
        self,
        spec: GangSpec,
        epoch: int,
        control_address: Address,
        authkey: bytes,
        node_ip: str,
        options: RayOptions,
        ray: Any,
    ) -> None:
        self._init_base(spec, epoch)
        world = self.ranks.world_size
        self.spin_us = spin_us(world)
        self._ray = ray
        self._options = options
        self._control_address = control_address
        self._authkey = authkey
        self._node_ip = node_ip
        self._token = os.urandom(16)
        # Placement-group names are unique per Ray namespace, which many gangs may share.
        self._pg_name = f"pipeactors-{self._token[:4].hex()}-e{epoch}"
        self._pgs: list[Any] = []
        self._actors: list[Any] = [None] * world
        self._serve_refs: list[Any] = [None] * world
        self._pids: list[Optional[int]] = [None] * world
        self._outcome: list[Any] = [None] * world
        self._gone = [threading.Event() for _ in range(world)]
        self._sentinel_r: list[int] = []
        self._sentinel_w: list[Optional[int]] = []
        for _ in range(world):
            r, w = os.pipe()
            self._sentinel_r.append(r)
            self._sentinel_w.append(w)
        # Routers poll the read ends until they end: close them only with the gang object.
        weakref.finalize(self, _close_fds, list(self._sentinel_r))
        self._joined = threading.Condition()
        self._call_conns: dict[int, Connection] = {}
        self._health_conns: dict[int, Connection] = {}
        self._listener: Optional[Listener] = None
        self._threads: list[threading.Thread] = []
        self._watch_stop = threading.Event()

    # ----- what the runtime and the router read -----

    @property
    def sentinels(self) -> list[int]:
        return self._sentinel_r

    @property
    def pids(self) -> list[Optional[int]]:
        return list(self._pids)

    @property
    def node_ids(self) -> list[Optional[str]]:
        return list(getattr(self, "_node_ids", [None] * self.ranks.world_size))

    def num_alive(self) -> int:
        return sum(ref is not None and not gone.is_set() for ref, gone in zip(self._serve_refs, self._gone))

    def is_down(self, rank: int) -> bool:
        return self._serve_refs[rank] is None or self._gone[rank].is_set()

    # ----- start -----

    def start(self, timeout: float, registry: Registry) -> None:
        deadline = time.monotonic() + timeout
        try:
            infos = self._place(deadline)
            self._pids = [info["pid"] for info in infos]
            self._node_ids = [info["node_id"] for info in infos]
            self.hosts = [info["hostname"] for info in infos]
            registry.set_rendezvous({"epoch": self.epoch, "master_addr": infos[0]["ip"], "master_port": infos[0]["port"]})
            self._listener = Listener((self._node_ip, 0), family="AF_INET", authkey=self._authkey)
            self._spawn_thread(self._accept_loop, "accept")
            for rank, actor in enumerate(self._actors):
                self._serve_refs[rank] = actor.serve.remote(self._actor_spec(rank))
            self._spawn_thread(self._watch, "watch")
            self._await_connections(deadline)
            self._await_ready(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.stop(grace=0.5)
            raise

    def _spawn_thread(self, target: Any, what: str) -> None:
        thread = threading.Thread(target=target, name=f"pipeactors-ray-{what}-e{self.epoch}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _place(self, deadline: float) -> list[dict[str, Any]]:
        """Reserve the placement groups, create one actor per rank in them, and learn where each landed."""
        ray, options, ranks = self._ray, self._options, self.ranks
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Each rank's slot: (placement group, bundle index).
        if options.spread_stages:
            stage_bundles = []
            for stage in range(ranks.pp_size):
                per_rank = options.rank_resources(stage)
                stage_bundles.append({k: v * ranks.tp_size for k, v in per_rank.items()})
            groups = [("STRICT_SPREAD", stage_bundles)]
            slots = [(0, pp) for pp, _ in map(ranks.coords, range(ranks.world_size))]
        else:
            groups = [("STRICT_PACK", [options.rank_resources(stage)] * ranks.tp_size) for stage in range(ranks.pp_size)]
            slots = [ranks.coords(rank) for rank in range(ranks.world_size)]
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        why = check_fits(nodes, groups)
        if why is not None:
            raise ActorStartupError(
                f"the Ray cluster can never place this gang: {why}; it has "
                f"{_scheduling_resources(ray.cluster_resources())} in all over {len(nodes)} node(s). "
                "Reserve less per rank (RayOptions.num_cpus), or add nodes",
                rank=(0, 0),
            )
        self._pgs = [
            placement_group(bundles, strategy=strategy, name=f"{self._pg_name}-{index}")
            for index, (strategy, bundles) in enumerate(groups)
        ]
        where = [(self._pgs[group], bundle) for group, bundle in slots]
        for index, pg in enumerate(self._pgs):
            left = max(0.1, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                what = "stages on distinct nodes" if options.spread_stages else f"stage {index}"
                raise ActorStartupError(
                    f"Ray could not place {what} ({pg.bundle_specs}) within {left:.3g}s; the cluster has "
                    f"{_scheduling_resources(ray.cluster_resources())} in all, "
                    f"{_scheduling_resources(ray.available_resources())} free",
                    rank=(0 if options.spread_stages else index, 0),
                )
        host = _host_class(ray)
        for rank, (pg, bundle) in enumerate(where):
            pp, tp = ranks.coords(rank)
            actor_options: dict[str, Any] = dict(
                num_cpus=options.num_cpus,
                num_gpus=options.num_gpus,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle),
                name=None,
            )
            if options.runtime_env is not None:
                actor_options["runtime_env"] = dict(options.runtime_env)
            self._actors[rank] = host.options(**actor_options).remote()
        refs = [actor.describe.remote(rank == 0) for rank, actor in enumerate(self._actors)]
        infos: list[Optional[dict[str, Any]]] = [None] * ranks.world_size
        pending = dict(zip(refs, range(ranks.world_size)))
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not ready:
                names = ", ".join(format_rank(ranks.coords(r)) for r in sorted(pending.values()))
                raise ActorStartupError(f"Ray actors of {names} did not start in time", rank=ranks.coords(min(pending.values())))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    infos[rank] = ray.get(ref)
                except Exception as exc:
                    raise ActorStartupError(
                        f"the Ray actor of {format_rank(ranks.coords(rank))} failed to start: {_ray_cause(exc)[1]}",
                        rank=ranks.coords(rank),
                    ) from exc
        return [info for info in infos if info is not None]

    def _actor_spec(self, rank: int) -> RayActorSpec:
        spec = self.spec
        assert self._listener is not None
        return RayActorSpec(
            worker=spec.worker,
            worker_kwargs=spec.worker_kwargs,
            global_rank=rank,
            tp_size=self.ranks.tp_size,
            pp_size=self.ranks.pp_size,
            epoch=self.epoch,
            control_address=self._control_address,
            authkey=self._authkey,
            gang_address=self._listener.address,
            token=self._token,
            env=dict(spec.env),
            cpus=spec.cpus(rank) if spec.cpus else None,
            fault_plan=spec.fault_plan,
            spin_us=self.spin_us,
            sys_path=list(sys.path),
        )

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        world = self.ranks.world_size
        while not self._stopped:
            try:
                conn = listener.accept()
            except AuthenticationError:
                logger.warning("epoch %d: refused a connection with a wrong authkey", self.epoch)
                continue
            except OSError:
                return
            try:
                channel, epoch, rank, token = conn.recv()
            except Exception:  # noqa: BLE001 - a peer that does not speak our hello
                conn.close()
                continue
            if token != self._token or epoch != self.epoch or not 0 <= rank < world:
                logger.warning("epoch %d: refused an actor of epoch %s rank %s (not of this gang)", self.epoch, epoch, rank)
                conn.close()
                continue
            _no_delay(conn)
            with self._joined:
                (self._call_conns if channel == "call" else self._health_conns)[rank] = conn
                self._joined.notify_all()
                if len(self._call_conns) == world and len(self._health_conns) == world:
                    return

    def _await_connections(self, deadline: float) -> None:
        world = self.ranks.world_size
        with self._joined:
            while len(self._call_conns) < world or len(self._health_conns) < world:
                for rank in range(world):
                    if self._gone[rank].is_set() and rank not in self._call_conns:
                        died = self.death_of(rank, during="startup")
                        raise ActorStartupError(f"worker {self.spec.worker!r} failed to start: {died}", rank=died.rank) from died
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(self._call_conns) | set(range(world)) - set(self._health_conns))
                    names = ", ".join(format_rank(self.ranks.coords(r)) for r in missing)
                    raise ActorStartupError(
                        f"the Ray actors of {names} did not connect back to {self._node_ip} in time",
                        rank=self.ranks.coords(missing[0]),
                    )
                self._joined.wait(min(left, 0.1))
        self.mailboxes = [Mailbox(self._call_conns[r], "pp{}-tp{}".format(*self.ranks.coords(r))) for r in range(world)]
        self.health = [self._health_conns[r] for r in range(world)]

    def _watch(self) -> None:
        """Turn each serve task's end (return, error, actor or node death) into its rank's sentinel."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(self._serve_refs)}
        while pending and not self._watch_stop.is_set():
            try:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            except Exception:  # noqa: BLE001 - Ray itself went away: every rank is gone
                logger.warning("epoch %d: lost Ray while watching the actors", self.epoch, exc_info=True)
                ready = list(pending)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    self._outcome[rank] = ray.get(ref, timeout=1.0)
                except Exception as exc:  # noqa: BLE001 - the account of the death
                    self._outcome[rank] = exc
                self._mark_gone(rank)

    def _mark_gone(self, rank: int) -> None:
        with self._lock:
            if self._gone[rank].is_set():
                return
            self._gone[rank].set()
            w = self._sentinel_w[rank]
            self._sentinel_w[rank] = None
        if w is not None:
            os.close(w)  # the read end turns readable: the router sees the death

    # ----- deaths, progress, stacks -----

    def death_of(self, rank: int, during: str = "") -> ActorDied:
        if self._serve_refs[rank] is not None:
            self._gone[rank].wait(_RAY_VERDICT_S)
        code, cause = _ray_cause(self._outcome[rank])
        return ActorDied(self.ranks.coords(rank), code, None, self._pids[rank], during, cause=cause)

    def unfinished(self, call_id: int) -> list[int]:
        answers = self.ask_health(b"?", 1.0)
        return [r for r, a in sorted(answers.items()) if not isinstance(a, dict) or a["last_call"] < call_id]

    def collect_stacks(self, ranks: list[int], settle: float = 0.3) -> dict[int, str]:
        # Asked on the health connection: works across hosts (a signal would not).
        if len(self.health) < self.ranks.world_size:
            return {}
        answers = self.ask_health(b"s", max(settle, 1.0), ranks)
        return {rank: text for rank, text in answers.items() if isinstance(text, str)}

    # ----- stop -----

    def _stop(self, grace: float) -> None:
        ray = self._ray
        live = [r for r in range(self.ranks.world_size) if not self.is_down(r)]
        if grace > 0 and live and self.mailboxes:
            stop = encode_stop()
            for rank in live:
                self.mailboxes[rank].post(stop)
            refs = [self._serve_refs[r] for r in live]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace)
            except Exception:  # noqa: BLE001
                pass
        for actor in self._actors:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead, or Ray is gone
                    pass
        self._wait_actors_gone(timeout=10.0)
        self._watch_stop.set()
        for pg in self._pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        if self._listener is not None:
            try:
                self._listener._listener._socket.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._listener.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        for box in self.mailboxes:
            box.close()
        with self._joined:
            conns = list(self._call_conns.values()) + list(self._health_conns.values())
        for conn in conns:
            conn.close()
        for rank in range(self.ranks.world_size):
            self._mark_gone(rank)

    def _wait_actors_gone(self, timeout: float) -> None:
        """Until Ray reports every actor's end and, for actors on this host, their processes have exited."""
        deadline = time.monotonic() + timeout
        for rank, ref in enumerate(self._serve_refs):
            if ref is not None:
                self._gone[rank].wait(max(0.0, deadline - time.monotonic()))
        here = socket.gethostname()
        for rank, pid in enumerate(self._pids):
            if pid is None or self.hosts[rank] != here:
                continue
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
            else:
                logger.warning("epoch %d: the Ray actor of %s (pid %d) is still running", self.epoch, format_rank(self.ranks.coords(rank)), pid)
