"""Remote errors, dead actors, failed startups and a killed parent: prompt, specific, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from actors import ActorDied, ActorStartupError, FaultPlan, RemoteError, Supervisor
from actors.faults import Fault
from tests.conftest import child_pids, pid_alive, wait_gone

WORKER = "tests.workers:EchoWorker"


@pytest.mark.parametrize("rank", [(0, 0), (0, 1), (1, 1)])
def test_error_on_any_rank_fails_the_call_at_once(rank):
    with Supervisor(WORKER, tp_size=2, pp_size=2) as sup:
        t0 = time.monotonic()
        # Only the output rank (1, 0) replies on success, yet a failure elsewhere arrives at once.
        future = sup.submit("fail", kwargs={"on": rank, "exc_type": KeyError, "others_sleep": 3.0})
        with pytest.raises(RemoteError) as info:
            future.result(timeout=10)
        assert time.monotonic() - t0 < 1.0
        err = info.value
        assert isinstance(err, KeyError)
        assert err.rank == rank
        assert err.method == "fail"
        assert "tests/workers.py" in err.remote_traceback and "in fail" in err.remote_traceback
        assert f"pp={rank[0]}, tp={rank[1]}" in str(err)
        assert isinstance(err.__cause__, KeyError) and err.__cause__.__traceback__ is not None
        # The gang is still usable after a remote exception.
        assert sup.collective_rpc("whoami")[0] == (0, 0, 0)


def test_remote_error_keeps_the_original_exception_attributes():
    with Supervisor(WORKER) as sup:
        with pytest.raises(FileNotFoundError) as info:
            sup.collective_rpc(lambda w: open("/nonexistent/file"))
        assert info.value.filename == "/nonexistent/file"
        assert info.value.errno == 2


@pytest.mark.parametrize(
    "how,exitcode,signame",
    [("sigkill", -signal.SIGKILL, "SIGKILL"), ("exit", 7, None), ("segfault", -signal.SIGSEGV, "SIGSEGV")],
)
@pytest.mark.parametrize("victim", [(0, 0), (1, 0)])
def test_dead_actor_fails_pending_and_later_calls(how, exitcode, signame, victim):
    sup = Supervisor(WORKER, pp_size=2, max_inflight=2)
    pids = sup.pids
    try:
        # The other rank waits 30 s inside the call, as a peer would inside a collective.
        dying = sup.submit("die", kwargs={"how": how, "on": victim, "delay": 0.3})
        queued = sup.submit("sleep", args=(30,))
        t0 = time.monotonic()
        with pytest.raises(ActorDied) as info:
            dying.result(timeout=10)
        assert time.monotonic() - t0 < 0.3 + 1.0  # seen within 1 s of the death
        err = info.value
        assert err.rank == victim
        assert err.exitcode == exitcode and err.signal == signame
        assert f"pp={victim[0]}, tp={victim[1]}" in str(err)
        with pytest.raises(ActorDied):
            queued.result(timeout=1)
        with pytest.raises(ActorDied):
            sup.collective_rpc("noop")
        with pytest.raises(ActorDied):
            sup.submit("noop")
        assert wait_gone(pids) == []  # the rest of the broken gang is shut down, too
    finally:
        sup.close()


def test_death_is_detected_within_a_second():
    with Supervisor(WORKER, pp_size=2) as sup:
        victim = sup.pids[1]
        future = sup.submit("sleep", args=(30,))
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ActorDied, match=r"pp=1, tp=0.*SIGKILL"):
            future.result(timeout=5)
        assert time.monotonic() - t0 < 1.0


def test_missing_worker_class_fails_startup_promptly():
    t0 = time.monotonic()
    with pytest.raises(ActorStartupError, match="no attribute 'Nope'") as info:
        Supervisor("tests.workers:Nope", tp_size=2)
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value.__cause__, ImportError)
    assert child_pids() == [] or wait_gone(child_pids()) == []


def test_missing_worker_module_fails_startup():
    with pytest.raises(ActorStartupError, match="No module named"):
        Supervisor("no_such_package.module:Worker")


def test_constructor_error_fails_startup_with_remote_traceback():
    with pytest.raises(ActorStartupError, match="constructor refused") as info:
        Supervisor(WORKER, {"fail_in_init": True}, pp_size=2)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteError) and isinstance(cause, ValueError)
    assert "in __init__" in cause.remote_traceback
    assert wait_gone(child_pids()) == []


def test_startup_timeout_names_the_ranks_and_leaves_nothing():
    t0 = time.monotonic()
    with pytest.raises(ActorStartupError, match=r"not ready within 1s") as info:
        Supervisor(WORKER, {"init_sleep": 30}, tp_size=2, start_timeout=1.0)
    assert time.monotonic() - t0 < 6
    assert "rank (pp=0, tp=0)" in str(info.value) and "rank (pp=0, tp=1)" in str(info.value)
    assert "in __init__" in str(info.value)  # their stacks
    assert wait_gone(child_pids()) == []


def test_bad_worker_spec_is_a_config_error():
    from actors import ConfigError

    with pytest.raises(ConfigError):
        Supervisor(3.5)
    with pytest.raises(ActorStartupError, match="package.module:ClassName"):
        Supervisor("tests.workers.EchoWorker")


UNGUARDED = textwrap.dedent(
    """
    from actors import Supervisor

    with Supervisor("tests.workers:EchoWorker", start_timeout=30) as sup:
        print("started", flush=True)
    """
)


def test_a_script_without_a_main_guard_gets_told_why_its_actors_died(tmp_path, script_env):
    # Spawned actors re-import the parent's main module; unguarded, that module starts a
    # Supervisor inside a process still bootstrapping, and the process exits with code 1.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=script_env, timeout=60)
    assert done.returncode != 0 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("actors.errors.ActorStartupError"), last
    assert "died before the actor started" in last and 'if __name__ == "__main__":' in last


def test_an_actor_that_exits_in_its_constructor_gets_no_main_guard_hint():
    plan = FaultPlan([Fault((0, 1), "__init__", 1, "exit")])
    with pytest.raises(ActorStartupError, match=r"pp=0, tp=1.*exited with code 1") as info:
        Supervisor(WORKER, tp_size=2, fault_plan=plan)
    assert "main module" not in str(info.value)
    assert wait_gone(child_pids()) == []


def test_unpicklable_worker_kwargs_raise_serialization_error():
    import threading

    from actors import SerializationError

    with pytest.raises(SerializationError, match="worker_kwargs"):
        Supervisor(WORKER, {"tag": threading.Lock()})


PARENT = textwrap.dedent(
    """
    import sys, time
    from actors import Supervisor
    if __name__ == "__main__":
        sup = Supervisor("tests.workers:EchoWorker", tp_size=2, pp_size=2)
        busy = sup.submit("sleep", args=(60,))  # one actor is busy, the others idle
        print(" ".join(map(str, sup.pids)), flush=True)
        print(sup._rt.workdir, flush=True)
        time.sleep(120)
    """
)


def test_actors_exit_when_the_parent_is_sigkilled(tmp_path, script_env):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=script_env)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        workdir = parent.stdout.readline().strip()
        assert len(pids) == 4 and all(pid_alive(p) for p in pids)
        t0 = time.monotonic()
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(pids, timeout=5.0) == []
        assert time.monotonic() - t0 < 5.0
        # The dead parent's private dir (control socket, stack files) is swept by the next supervisor.
        assert os.path.isdir(workdir)
        with Supervisor(WORKER):
            assert not os.path.exists(workdir)
    finally:
        parent.kill()
        parent.wait()
