"""The Supervisor's call API: rank map, collective calls, submit, bad input, close, control plane."""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future
from multiprocessing import AuthenticationError

import pytest

from actors import (
    ActorContext,
    ConfigError,
    RankMap,
    RemoteError,
    SerializationError,
    Supervisor,
    SupervisorClosed,
)
from actors.control import connect_registry
from tests.conftest import wait_gone

WORKER = "tests.workers:EchoWorker"


@pytest.fixture(scope="module")
def gang():
    with Supervisor(WORKER, tp_size=2, pp_size=2, start_timeout=60) as sup:
        yield sup


def test_rank_map_follows_pp_times_tp_plus_tp():
    ranks = RankMap(tp_size=8, pp_size=4)
    assert ranks.world_size == 32
    assert ranks.output_rank == 24
    assert ranks.rank_of(3, 0) == 24
    assert ranks.coords(13) == (1, 5)
    assert all(ranks.rank_of(*ranks.coords(r)) == r for r in range(32))
    with pytest.raises(ConfigError):
        ranks.coords(32)
    with pytest.raises(ConfigError):
        ranks.rank_of(4, 0)


@pytest.mark.parametrize("tp_size,pp_size", [(0, 1), (1, 0), (-1, 2), (1.5, 1), (True, 1)])
def test_invalid_sizes_raise_config_error(tp_size, pp_size):
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        Supervisor(WORKER, tp_size=tp_size, pp_size=pp_size)


def test_shape_of_a_gang(gang):
    assert (gang.world_size, gang.output_rank) == (4, 2)
    assert gang.rank_of(1, 1) == 3 and gang.coords(2) == (1, 0)
    assert len(set(gang.pids)) == 4


def test_collective_rpc_replies_in_global_rank_order(gang):
    assert gang.collective_rpc("whoami") == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]


def test_worker_gets_a_full_context(gang):
    contexts = gang.collective_rpc("context")
    assert all(isinstance(c, ActorContext) for c in contexts)
    assert [c.global_rank for c in contexts] == [0, 1, 2, 3]
    assert {(c.tp_size, c.pp_size, c.world_size) for c in contexts} == {(2, 2, 4)}
    assert len({(c.master_addr, c.master_port) for c in contexts}) == 1
    assert contexts[0].master_port > 0


def test_reply_ranks_selects_who_answers(gang):
    assert gang.collective_rpc("whoami", reply_ranks=[3, (0, 0)]) == [(0, 0, 0), (1, 1, 3)]


def test_callable_runs_with_the_worker(gang):
    assert gang.collective_rpc(lambda w, k: (w.ctx.global_rank * k), args=(10,)) == [0, 10, 20, 30]


def test_submit_resolves_to_the_output_rank(gang):
    future = gang.submit("whoami")
    assert isinstance(future, Future)
    assert future.result(timeout=10) == (1, 0, 2)
    assert gang.submit("whoami", reply_rank=(0, 1)).result(timeout=10) == (0, 1, 1)


def test_submit_futures_support_callbacks(gang):
    done = threading.Event()
    seen = []
    future = gang.submit("echo", args=("hi",))
    future.add_done_callback(lambda f: (seen.append(f.result()), done.set()))
    assert done.wait(10) and seen == ["hi"]


def test_many_pipelined_submits_resolve_by_id(gang):
    futures = [gang.submit("echo", args=(i,)) for i in range(200)]
    assert [f.result(timeout=30) for f in futures] == list(range(200))


def test_unknown_method_names_the_rank(gang):
    with pytest.raises(RemoteError, match="no method 'nope'") as info:
        gang.collective_rpc("nope")
    assert isinstance(info.value, AttributeError)
    assert info.value.rank in {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_private_methods_are_refused(gang):
    with pytest.raises(AttributeError, match="private"):
        gang.collective_rpc("__init__")


def test_unpicklable_argument_raises_serialization_error_before_sending(gang):
    with pytest.raises(SerializationError, match="cannot pickle the arguments of 'echo'"):
        gang.collective_rpc("echo", args=(threading.Lock(),))
    assert gang.collective_rpc("noop") == [None] * 4  # the gang is unharmed


def test_unpicklable_result_fails_with_the_rank(gang):
    with pytest.raises(RemoteError, match="cannot pickle the result") as info:
        gang.submit("unpicklable_result").result(timeout=10)
    assert isinstance(info.value, SerializationError)
    assert info.value.rank == (1, 0)


def test_large_payload_round_trips(gang):
    blob = os.urandom(24 * 1024 * 1024)
    assert gang.submit("echo", args=(blob,)).result(timeout=60) == blob


def test_submit_does_not_block_on_a_large_payload_to_a_busy_actor(gang):
    busy = gang.submit("sleep", args=(1.0,))
    t0 = time.monotonic()
    big = gang.submit("echo", args=(b"x" * (8 * 1024 * 1024),))
    assert time.monotonic() - t0 < 0.5
    assert busy.result(timeout=10) == (1, 0)
    assert len(big.result(timeout=30)) == 8 * 1024 * 1024


def test_submit_waits_for_room_beyond_max_inflight(gang):
    assert gang.max_inflight == 2
    t0 = time.monotonic()
    first = [gang.submit("sleep", args=(0.5,)) for _ in range(2)]
    assert time.monotonic() - t0 < 0.3
    third = gang.submit("noop")  # waits until the first sleep has finished
    assert time.monotonic() - t0 >= 0.45
    for f in first + [third]:
        f.result(timeout=10)


def test_bad_rank_and_timeout_arguments_raise_config_error(gang):
    with pytest.raises(ConfigError):
        gang.collective_rpc("noop", reply_ranks=[4])
    with pytest.raises(ConfigError):
        gang.collective_rpc("noop", reply_ranks=[])
    with pytest.raises(ConfigError):
        gang.submit("noop", reply_rank=(2, 0))
    with pytest.raises(ConfigError):
        gang.collective_rpc("noop", timeout=0)
    with pytest.raises(ConfigError):
        gang.collective_rpc(42)
    assert gang.collective_rpc("noop", timeout=math.inf) == [None] * 4


def test_wrong_authkey_is_refused(gang):
    with pytest.raises(AuthenticationError):
        connect_registry(gang.control_address, b"not the key")


def test_right_authkey_reaches_the_registry(gang):
    registry = connect_registry(gang.control_address, gang._authkey)
    members = registry.members()
    assert sorted(members) == [0, 1, 2, 3]
    assert [members[r]["pid"] for r in range(4)] == gang.pids


def test_tcp_control_plane_on_loopback():
    with Supervisor(WORKER, control_address=("127.0.0.1", 0)) as sup:
        host, port = sup.control_address
        assert host == "127.0.0.1" and port > 0
        assert sup.collective_rpc("whoami") == [(0, 0, 0)]
        with pytest.raises(AuthenticationError):
            connect_registry(sup.control_address, b"wrong")


def test_close_is_idempotent_and_later_calls_raise():
    sup = Supervisor(WORKER, tp_size=2)
    pids = sup.pids
    sup.close()
    sup.close()
    assert sup.closed
    assert wait_gone(pids, timeout=0) == []
    with pytest.raises(SupervisorClosed):
        sup.collective_rpc("noop")
    with pytest.raises(SupervisorClosed):
        sup.submit("noop")


def test_close_fails_pending_calls():
    sup = Supervisor(WORKER, shutdown_grace=0.2)
    future = sup.submit("sleep", args=(30,))
    time.sleep(0.2)
    t0 = time.monotonic()
    sup.close()
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(SupervisorClosed):
        future.result(timeout=1)


def test_garbage_collected_supervisor_stops_its_actors():
    sup = Supervisor(WORKER)
    pids = sup.pids
    del sup
    import gc

    gc.collect()
    assert wait_gone(pids) == []


def test_driver_cpus_pin_the_reply_router_only():
    cpu = max(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    with Supervisor(WORKER, driver_cpus=[cpu]) as sup:
        assert sup.driver_cpus == [cpu]
        assert sup.submit("echo", args=(1,)).result(timeout=30) == 1
        router = sup._rt.router._thread  # this gang's (other tests' gangs have their own)
        deadline = time.monotonic() + 5.0  # the thread pins itself when it starts
        while os.sched_getaffinity(router.native_id) != {cpu} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.sched_getaffinity(router.native_id) == {cpu}
        assert os.sched_getaffinity(0) == mine  # the caller's thread is left alone


@pytest.mark.parametrize("cpus", [[], ["0"], [True], "0", [10**6]])
def test_driver_cpus_that_are_not_this_process_s_cpus_are_a_config_error(cpus):
    with pytest.raises(ConfigError, match="driver_cpus"):
        Supervisor(WORKER, driver_cpus=cpus)
