"""Supervision policy, fault plans, health checks: failures are ordinary events."""

from __future__ import annotations

import time

import pytest

from actors import (
    ActorDied,
    ActorError,
    ActorTimeout,
    ConfigError,
    Fault,
    FaultPlan,
    GangRestarted,
    InjectedFault,
    RemoteError,
    SupervisionPolicy,
    Supervisor,
)
from tests.conftest import wait_gone

WORKER = "tests.workers:EchoWorker"


def test_fault_spec_parses():
    fault = Fault.parse("1,0:execute_model:3:delay:0.5@*")
    assert fault == Fault((1, 0), "execute_model", 3, "delay", 0.5, None)
    assert Fault.parse("0,1:load_model:1:crash").epoch == 0
    with pytest.raises(ConfigError):
        Fault.parse("nonsense")
    with pytest.raises(ConfigError):
        Fault((0, 0), "x", at_call=0)
    with pytest.raises(ConfigError):
        Fault((0, 0), "x", action="explode")


def test_policy_values_are_checked():
    assert SupervisionPolicy.of("restart").strategy == "restart"
    with pytest.raises(ConfigError):
        SupervisionPolicy.of("retry")
    with pytest.raises(ConfigError):
        SupervisionPolicy("restart", max_restarts=-1)


@pytest.mark.parametrize("action,error", [("crash", ActorDied), ("exit", ActorDied), ("raise", InjectedFault)])
def test_fault_fires_at_the_nth_call_on_its_rank_only(action, error):
    plan = FaultPlan([Fault((0, 1), "echo", at_call=3, action=action)])
    with Supervisor(WORKER, tp_size=2, fault_plan=plan) as sup:
        assert sup.collective_rpc("echo", args=(1,)) == [1, 1]
        assert sup.collective_rpc("echo", args=(2,)) == [2, 2]
        with pytest.raises(error) as info:
            sup.collective_rpc("echo", args=(3,))
        assert info.value.rank == (0, 1)


def test_fail_policy_shuts_the_gang_down_after_a_death():
    plan = FaultPlan([Fault((1, 0), "echo", at_call=1, action="crash")])
    sup = Supervisor(WORKER, pp_size=2, fault_plan=plan)
    pids = sup.pids
    try:
        with pytest.raises(ActorDied):
            sup.submit("echo", args=(1,)).result(timeout=10)
        assert wait_gone(pids) == []
        assert sup.status()["state"] == "failed"
        with pytest.raises(ActorDied, match=r"pp=1, tp=0"):
            sup.collective_rpc("noop")
    finally:
        sup.close()


def test_restart_policy_replaces_the_gang_and_replays_setup():
    plan = FaultPlan([Fault((1, 0), "echo", at_call=2, action="crash")])
    with Supervisor(WORKER, pp_size=2, policy="restart", fault_plan=plan) as sup:
        old = sup.pids
        sup.collective_rpc("sleep", args=(0.0,), setup=True)
        assert sup.submit("echo", args=("a",)).result(timeout=10) == "a"
        t0 = time.monotonic()
        with pytest.raises(GangRestarted) as info:
            sup.submit("echo", args=("b",)).result(timeout=10)
        assert isinstance(info.value.cause, ActorDied) and info.value.cause.rank == (1, 0)
        assert info.value.retryable
        # The next call waits for the new gang, then runs there: the fault was for epoch 0.
        assert sup.submit("echo", args=("b",)).result(timeout=30) == "b"
        recovery = time.monotonic() - t0
        assert sup.epoch == 1 and wait_gone(old) == []
        assert set(sup.pids).isdisjoint(old)
        status = sup.status()
        assert (status["state"], status["restarts"], status["ranks_alive"]) == ("running", 1, 2)
        assert recovery < 10


def test_restart_budget_exhausted_escalates_to_fail():
    plan = FaultPlan([Fault((0, 0), "echo", at_call=1, action="crash", epoch=None)])
    policy = SupervisionPolicy("restart", max_restarts=2, period_s=60)
    with Supervisor(WORKER, policy=policy, fault_plan=plan) as sup:
        for _ in range(2):
            with pytest.raises(GangRestarted):
                sup.submit("echo", args=(1,)).result(timeout=30)
        with pytest.raises(ActorDied):
            sup.submit("echo", args=(1,)).result(timeout=30)
        assert sup.status()["state"] == "failed" and sup.status()["restarts"] == 2
        with pytest.raises(ActorDied):
            sup.collective_rpc("noop")


def test_fault_during_a_restart_is_retried_within_budget():
    plan = FaultPlan([
        Fault((0, 0), "echo", at_call=1, action="crash"),          # breaks epoch 0
        Fault((0, 1), "__init__", at_call=1, action="crash", epoch=1),  # epoch 1 fails to start
    ])
    with Supervisor(WORKER, tp_size=2, policy="restart", fault_plan=plan) as sup:
        with pytest.raises(GangRestarted):
            sup.submit("echo", args=(1,)).result(timeout=30)
        assert sup.collective_rpc("echo", args=(2,)) == [2, 2]
        assert sup.epoch == 2 and sup.status()["restarts"] == 2


def test_failing_setup_replay_counts_as_a_failed_restart():
    plan = FaultPlan([
        Fault((0, 0), "echo", at_call=1, action="crash"),
        Fault((0, 0), "sleep", at_call=1, action="raise", epoch=None),  # the replayed setup call
    ])
    policy = SupervisionPolicy("restart", max_restarts=2)
    with Supervisor(WORKER, policy=policy, fault_plan=plan) as sup:
        with pytest.raises(InjectedFault):
            sup.collective_rpc("sleep", args=(0.0,), setup=True)  # not recorded: it failed
        sup.collective_rpc("sleep", args=(0.0,), setup=True)      # call 2: fine, recorded
        with pytest.raises(GangRestarted):
            sup.submit("echo", args=(1,)).result(timeout=30)
        with pytest.raises(ActorError, match="restart budget exhausted"):
            sup.collective_rpc("noop", timeout=60)


def test_hang_past_the_deadline_reports_stacks_then_restarts():
    plan = FaultPlan([Fault((0, 1), "echo", at_call=1, action="hang")])
    with Supervisor(WORKER, tp_size=2, policy="restart", fault_plan=plan) as sup:
        t0 = time.monotonic()
        with pytest.raises(GangRestarted) as info:
            sup.collective_rpc("echo", args=(1,), timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        cause = info.value.cause
        assert isinstance(cause, ActorTimeout) and cause.ranks == [(0, 1)]
        assert "in _act" in cause.stacks[(0, 1)]  # the hung frame, from faulthandler
        assert sup.submit("echo", args=(2,)).result(timeout=30) == 2


def test_slow_rank_just_inside_its_deadline_is_no_alarm():
    plan = FaultPlan([Fault((0, 0), "echo", at_call=1, action="delay", seconds=0.6)])
    with Supervisor(WORKER, policy="restart", fault_plan=plan) as sup:
        assert sup.submit("echo", args=(1,), timeout=1.5).result(timeout=10) == 1
        assert sup.status()["restarts"] == 0 and sup.epoch == 0


def test_critical_remote_error_breaks_the_gang():
    with Supervisor(WORKER, pp_size=2, policy="restart") as sup:
        with pytest.raises(GangRestarted) as info:
            sup.submit("fail", kwargs={"on": (0, 0), "others_sleep": 1.0}, critical=True).result(timeout=10)
        assert isinstance(info.value.cause, RemoteError) and isinstance(info.value.cause, ValueError)
        assert sup.collective_rpc("whoami")[1] == (1, 0, 1)
        assert sup.epoch == 1


def test_check_health_does_not_wait_behind_a_busy_call():
    with Supervisor(WORKER, tp_size=2) as sup:
        busy = sup.submit("sleep", args=(2.0,))
        time.sleep(0.1)
        t0 = time.monotonic()
        health = sup.check_health(timeout=1.0)
        assert time.monotonic() - t0 < 0.5
        assert sorted(health) == [(0, 0), (0, 1)]
        assert [health[r]["pid"] for r in sorted(health)] == sup.pids
        assert sup.status()["in_flight"] == 1
        busy.result(timeout=10)


def test_check_health_reports_a_dead_rank():
    import os
    import signal

    with Supervisor(WORKER, tp_size=2) as sup:
        os.kill(sup.pids[1], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(ActorDied, match=r"pp=0, tp=1.*SIGKILL"):
            sup.check_health()
