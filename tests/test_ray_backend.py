"""The same gang on Ray (backend="ray"): a local two-node Ray cluster started by this module.

The cluster is two Ray nodes on this machine (ray.cluster_utils.Cluster starts
each node's raylet as `ray start` would): the head node carries the custom
resource "head_node", the second one "node_b", so tests can pin pipeline stages
to either. No dashboard; 4 + 2 logical CPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from actors import (
    ActorDied,
    ActorStartupError,
    ActorTimeout,
    BackendUnavailable,
    ConfigError,
    Fault,
    FaultPlan,
    RayOptions,
    RemoteError,
    Supervisor,
)
from actors.ray_gang import check_fits, local_ray_cpus
from scheduling import LLM, SamplingParams
from tests.conftest import wait_gone
from tests.model_checkpoints import build_checkpoint, reference_greedy
from tests.test_scheduling_llm import BLOCK, MANY_PROMPTS, NEW_TOKENS

pytestmark = pytest.mark.timeout(300)

S = 0.25  # seconds each pipeline stage spends per call
ON_HEAD = {"head_node": 0.01}
ON_B = {"node_b": 0.01}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"head_node": 1.0}, "include_dashboard": False},
    )
    try:
        node_b = cluster.add_node(num_cpus=2, resources={"node_b": 1.0})
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes()
        yield cluster, node_b
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def node_ids(cluster):
    """The Ray node id of the head node and of node_b."""
    by_resource = {}
    for node in ray.nodes():
        if node["Alive"]:
            for name in ("head_node", "node_b"):
                if name in node["Resources"]:
                    by_resource[name] = node["NodeID"]
    return by_resource


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("ray") / "tiny", seed=3)
    full = reference_greedy(path, MANY_PROMPTS, NEW_TOKENS)
    return path, [seq[len(p) :] for seq, p in zip(full, MANY_PROMPTS)]


def _gang_node_ids(sup: Supervisor) -> list[str]:
    return sup._rt.gang.node_ids


def _assert_actors_dead(handles: list, pids: list[int]) -> None:
    for handle in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.describe.remote(False), timeout=30)
    assert not wait_gone(pids, timeout=10), "Ray actor processes left behind"


LOCAL = textwrap.dedent(
    """
    import logging
    from actors import Supervisor

    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO)
        with Supervisor("tests.workers:EchoWorker", tp_size=2, pp_size=2, backend="ray", start_timeout=120) as sup:
            print(sup.collective_rpc("whoami"), flush=True)
    """
)


def test_with_no_cluster_a_local_ray_is_started_that_fits_the_gang(tmp_path):
    # First in the module, before the cluster fixture starts one. Four ranks of one
    # logical CPU each; this machine may have two cores, Ray's default local size.
    assert not ray.is_initialized()
    script = tmp_path / "local.py"
    script.write_text(LOCAL)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.getcwd()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]"
    cpus = max(os.cpu_count() or 1, 4)
    assert f"started a local Ray with {cpus} logical CPUs for 4 ranks" in done.stderr, "connected to some other Ray"


def test_local_ray_size_and_placement_feasibility():
    from actors.context import RankMap

    cores = os.cpu_count() or 1
    assert local_ray_cpus(RayOptions(), RankMap(tp_size=2, pp_size=2)) == max(cores, 4)
    assert local_ray_cpus(RayOptions(num_cpus=0.5), RankMap(tp_size=1, pp_size=3)) == max(cores, 2)
    nodes = [{"CPU": 4.0, "head_node": 1.0}, {"CPU": 2.0, "node_b": 1.0}]
    one = {"CPU": 1.0}
    assert check_fits(nodes, [("STRICT_PACK", [one] * 4)]) is None
    assert "no node has {'CPU': 5.0}" in check_fits(nodes, [("STRICT_PACK", [one] * 5)])
    assert check_fits(nodes, [("STRICT_PACK", [{"CPU": 1.0, "node_b": 0.01}] * 2)]) is None
    assert check_fits(nodes, [("STRICT_PACK", [{"CPU": 1.0, "node_b": 0.01}] * 3)]) is not None
    assert check_fits(nodes, [("STRICT_SPREAD", [{"CPU": 2.0}] * 2)]) is None
    assert check_fits(nodes, [("STRICT_SPREAD", [{"CPU": 3.0}] * 2)]) is not None
    assert check_fits(nodes, [("STRICT_SPREAD", [one] * 3)]) is not None
    assert check_fits(nodes, [("STRICT_PACK", [{"GPU": 1.0}])]) is not None


def test_collective_rpc_order_replies_and_remote_errors(cluster):
    with Supervisor("tests.workers:EchoWorker", tp_size=2, pp_size=2, backend="ray", start_timeout=120) as sup:
        assert sup.backend == "ray"
        assert sup.collective_rpc("whoami") == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
        assert sup.collective_rpc("whoami", reply_ranks=[(1, 0)]) == [(1, 0, 2)]
        futures = [sup.submit("echo", args=(i,)) for i in range(50)]
        assert [f.result(timeout=30) for f in futures] == list(range(50))
        assert sup.collective_rpc("echo", args=(b"x" * 300_000,), reply_ranks=[0]) == [b"x" * 300_000]  # writer-thread path
        with pytest.raises(RemoteError) as info:
            sup.collective_rpc("fail", kwargs={"on": (1, 1)})
        assert isinstance(info.value, ValueError) and info.value.rank == (1, 1)
        with pytest.raises(RemoteError) as info:
            sup.collective_rpc("no_such_method")
        assert isinstance(info.value, AttributeError)
        health = sup.check_health()
        assert sorted(health) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert sup.collective_rpc("pid") == [health[r]["pid"] for r in sorted(health)]


def test_pipelined_calls_overlap_across_stages(cluster):
    with Supervisor(
        "tests.workers:PipeStageWorker", {"stage_seconds": S}, pp_size=2, backend="ray", start_timeout=120
    ) as sup:
        sup.collective_rpc("init_distributed", timeout=60)
        sup.submit("step", args=(0,)).result(timeout=30)
        n = 8
        t0 = time.monotonic()
        futures = [sup.submit("step", args=(i,)) for i in range(n)]
        assert [f.result(timeout=60) for f in futures] == [i + 2 for i in range(n)]
        elapsed = time.monotonic() - t0
        # Overlapped: about (n + 1) * S = 2.25 s; serialized it would be 2 * n * S = 4 s.
        assert (n + 1) * S - 0.05 <= elapsed < (n + 1) * S + 0.8, elapsed


def test_stages_placed_on_the_nodes_asked_for(cluster, node_ids):
    options = RayOptions(num_cpus=1, stage_resources=[ON_B, ON_HEAD])
    with Supervisor(
        "tests.workers:PipeStageWorker", {"stage_seconds": 0.05}, pp_size=2, tp_size=2,
        backend="ray", ray_options=options, start_timeout=120,
    ) as sup:
        assert _gang_node_ids(sup) == [node_ids["node_b"]] * 2 + [node_ids["head_node"]] * 2
        # torch.distributed spans both nodes: its rendezvous is on rank 0's node (node_b).
        sup.collective_rpc("init_distributed", timeout=60)
        assert sup.submit("step", args=(5,)).result(timeout=30) == 7


def test_stages_pinned_by_rays_own_node_address_resource(cluster):
    # Every Ray node carries "node:<ip>"; the placement check must count it like any other resource.
    on_ip = RayOptions(stage_resources=[{f"node:{ray.util.get_node_ip_address()}": 0.01}])
    with Supervisor("tests.workers:EchoWorker", backend="ray", ray_options=on_ip, start_timeout=120) as sup:
        assert sup.collective_rpc("whoami") == [(0, 0, 0)]


def test_spread_stages_puts_each_stage_on_its_own_node(cluster):
    with Supervisor(
        "tests.workers:EchoWorker", tp_size=2, pp_size=2, backend="ray",
        ray_options=RayOptions(num_cpus=0.5, spread_stages=True), start_timeout=120,
    ) as sup:
        nodes = _gang_node_ids(sup)
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
        assert sup.collective_rpc("whoami", reply_ranks=[3]) == [(1, 1, 3)]


def test_tp2_pp2_greedy_output_equals_transformers(cluster, checkpoint):
    path, expected = checkpoint
    with LLM(path, tp=2, pp=2, block_size=BLOCK, max_num_seqs=3, backend="ray", start_timeout=120) as llm:
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        handles, pids = list(llm.supervisor._rt.gang._actors), llm.supervisor.pids
    _assert_actors_dead(handles, pids)


def test_a_crash_under_restart_policy_gives_identical_output(cluster, checkpoint):
    """A stage-1 actor is SIGKILLed mid-run: the gang restarts as new Ray actors (Ray itself never
    restarts one), the engine recomputes, and greedy output is unchanged."""
    path, expected = checkpoint
    plan = FaultPlan([Fault((1, 0), "execute_model", at_call=4, action="crash")])
    with LLM(
        path, tp=1, pp=2, block_size=BLOCK, max_num_seqs=3, policy="restart", fault_plan=plan,
        backend="ray", start_timeout=120,
    ) as llm:
        first = list(llm.supervisor._rt._gangs[0]._actors)
        first_pids = list(llm.supervisor._rt._gangs[0].pids)
        outputs = llm.generate(MANY_PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        assert llm.supervisor.epoch == 1 and llm.engine.stats()["num_recoveries"] == 1
        last = llm.supervisor._rt._gangs[-1]
        assert not set(last.pids) & set(first_pids)
        assert "Ray reports" in str(llm.supervisor.status()["last_break"]["message"])
        _assert_actors_dead(first, first_pids)  # the broken epoch's actors stay dead
        handles, pids = list(last._actors), list(last.pids)
    _assert_actors_dead(handles, pids)


def test_actor_death_is_actor_died_naming_the_rank(cluster):
    with Supervisor("tests.workers:EchoWorker", pp_size=2, backend="ray", start_timeout=120) as sup:
        handles, pids = list(sup._rt.gang._actors), sup.pids
        start = time.monotonic()
        with pytest.raises(ActorDied) as info:
            sup.collective_rpc("die", args=("sigkill", (1, 0)))
        assert time.monotonic() - start < 5
        assert info.value.rank == (1, 0) and info.value.pid == pids[1]
        assert "Ray reports" in str(info.value), str(info.value)
        with pytest.raises(ActorDied):
            sup.collective_rpc("noop")
    _assert_actors_dead(handles, pids)


def test_a_missed_deadline_names_the_rank_with_its_stacks(cluster):
    # Ray actors may be on other hosts: stacks come over the health connection, not by a signal.
    with Supervisor("tests.workers:EchoWorker", tp_size=2, backend="ray", start_timeout=120) as sup:
        start = time.monotonic()
        with pytest.raises(ActorTimeout) as info:
            sup.collective_rpc("sleep", kwargs={"seconds": 3.0, "on": (0, 1)}, timeout=0.5)
        assert time.monotonic() - start < 3.0
        assert info.value.ranks == [(0, 1)]
        assert "in sleep" in info.value.stacks[(0, 1)]


PARENT = textwrap.dedent(
    """
    import sys, time
    import ray
    from actors import Supervisor

    if __name__ == "__main__":
        ray.init(address=sys.argv[1], logging_level="WARNING")
        sup = Supervisor("tests.workers:EchoWorker", pp_size=2, backend="ray", start_timeout=120)
        sup.submit("sleep", args=(60.0,))
        print(" ".join(map(str, sup.pids)), flush=True)
        time.sleep(120)
    """
)


def test_actors_go_when_the_driver_is_sigkilled(cluster, tmp_path):
    """Ray actors fate-share with their owner: the SIGKILLed supervisor's job ends and Ray kills them."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    parent = subprocess.Popen([sys.executable, str(script), cluster[0].address], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        start = time.monotonic()
        parent.kill()
        parent.wait(timeout=10)
        assert not wait_gone(pids, timeout=20), "Ray actors outlived their SIGKILLed driver"
        print(f"ray actors gone {time.monotonic() - start:.2f} s after the driver's SIGKILL")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_gang_the_cluster_can_never_hold_fails_at_once(cluster):
    cases = [
        (dict(tp_size=2), RayOptions(num_cpus=3), "no node has {'CPU': 6.0}"),  # nodes have 4 and 2
        (dict(pp_size=2), RayOptions(stage_resources=[{}, {"no_such_node": 1.0}]), "no_such_node"),
        (dict(pp_size=3), RayOptions(spread_stages=True), "3 stages on distinct nodes"),
    ]
    for layout, options, why in cases:
        start = time.monotonic()
        with pytest.raises(ActorStartupError, match="can never place this gang") as info:
            Supervisor("tests.workers:EchoWorker", backend="ray", ray_options=options, start_timeout=60, **layout)
        assert time.monotonic() - start < 5, "an impossible placement waited out its timeout"
        assert why in str(info.value) and "bundle_group" not in str(info.value)


def test_a_gang_with_no_room_now_is_a_startup_error_naming_the_stage(cluster):
    on_b = RayOptions(stage_resources=[ON_B])
    with Supervisor("tests.workers:EchoWorker", tp_size=2, backend="ray", ray_options=on_b, start_timeout=120):
        # node_b's two CPUs are taken: the second gang fits the cluster, not the free room.
        with pytest.raises(ActorStartupError, match=r"could not place stage 0 .* free"):
            Supervisor("tests.workers:EchoWorker", backend="ray", ray_options=on_b, start_timeout=3)


# Last of the cluster tests: Ray reports the removed node alive for a while after.
def test_node_death_is_actor_died_naming_the_stage(cluster):
    cluster_, _ = cluster
    extra = cluster_.add_node(num_cpus=1, resources={"node_c": 1.0})
    cluster_.wait_for_nodes()
    options = RayOptions(num_cpus=1, stage_resources=[{}, {"node_c": 0.01}])
    sup = Supervisor("tests.workers:EchoWorker", pp_size=2, backend="ray", ray_options=options, start_timeout=120)
    try:
        pids = sup.pids
        cluster_.remove_node(extra, allow_graceful=False)
        start = time.monotonic()
        with pytest.raises(ActorDied) as info:
            sup.collective_rpc("sleep", args=(60.0,), timeout=90)
        assert info.value.rank == (1, 0) and time.monotonic() - start < 30
        assert not wait_gone(pids[1:], timeout=10)
    finally:
        sup.close()
    assert not wait_gone(pids, timeout=10)


def test_bad_ray_options_are_config_errors():
    with pytest.raises(ConfigError, match="stage_resources"):
        Supervisor("tests.workers:EchoWorker", pp_size=2, backend="ray", ray_options=RayOptions(stage_resources=[{}]))
    with pytest.raises(ConfigError, match="backend"):
        Supervisor("tests.workers:EchoWorker", backend="threads")


def test_missing_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(BackendUnavailable, match=r"pip install 'pipeactors\[ray\]'"):
        Supervisor("tests.workers:EchoWorker", backend="ray")
