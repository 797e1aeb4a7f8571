"""How the "mp" backend starts actors: forked from multiprocessing's fork server (with its preload), or spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from actors import ConfigError, Supervisor
from tests.conftest import child_pids, wait_gone

WORKER = "tests.workers:EchoWorker"


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_each_start_method_runs_a_gang_and_leaves_nothing(start_method):
    with Supervisor(WORKER, tp_size=2, start_method=start_method) as sup:
        pids = sup.collective_rpc("pid")
        assert sup.collective_rpc("whoami") == [(0, 0, 0), (0, 1, 1)]
        # The fixture's leftover check sees actors through the fork server too.
        assert sorted(child_pids()) == sorted(pids)
        parents = {_parent_of(pid) for pid in pids}
        if start_method == "spawn":
            assert parents == {os.getpid()}
        else:  # both forked by the one fork server, a child of this process
            assert len(parents) == 1 and parents != {os.getpid()} and _parent_of(parents.pop()) == os.getpid()
    assert wait_gone(pids) == [] and child_pids() == []


def test_bad_start_method_or_preload_is_a_config_error():
    with pytest.raises(ConfigError, match="start_method must be one of"):
        Supervisor(WORKER, start_method="fork")
    with pytest.raises(ConfigError, match="preload must be a sequence of module names"):
        Supervisor(WORKER, preload="torch")
    with pytest.raises(ConfigError, match="preload must be a sequence of module names"):
        Supervisor(WORKER, preload=["torch", ""])


PRELOADED = textwrap.dedent(
    """
    import os, sys
    from actors import Supervisor, prestart

    if __name__ == "__main__":
        prestart(("tests.preload_marker",))
        with Supervisor("tests.workers:EchoWorker", tp_size=2, preload=("tests.preload_marker",)) as sup:
            # The marker module records the pid that imported it: the fork server, not the actor.
            pids = sup.collective_rpc("pid")
            marks = sup.collective_rpc(lambda w: sys.modules["tests.preload_marker"].IMPORTED_BY if "tests.preload_marker" in sys.modules else None)
            print(len(set(marks)) == 1 and None not in marks and not set(marks) & set(pids) and os.getpid() not in marks, flush=True)
    """
)


def test_preloaded_modules_are_imported_once_by_the_fork_server(tmp_path, script_env):
    # In a fresh process: the fork server is one per process and keeps its first preload list.
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=script_env, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_the_models_preload_starts_no_thread():
    # The fork server forks after importing it: a thread started there would be missing,
    # with whatever it held, in every rank.
    code = textwrap.dedent(
        """
        import os, sys
        import torch
        before = len(os.listdir("/proc/self/task"))
        import models.preload
        assert "numba" in sys.modules
        print(before, len(os.listdir("/proc/self/task")))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert before == after


def test_rendezvous_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """Other sockets' bind(0) and outgoing connections draw from the ephemeral range, so a
    rendezvous port is taken below it, where nothing takes a port it did not ask for."""
    import socket

    from actors import gang

    low = gang._ephemeral_low()
    for _ in range(20):
        port = gang.free_port()
        assert gang._RENDEZVOUS_PORTS[0] <= port < min(low, gang._RENDEZVOUS_PORTS[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free when returned
    # No room below the range (a range that starts at 10000): the kernel's bind(0) picks.
    monkeypatch.setattr(gang, "_ephemeral_low", lambda: gang._RENDEZVOUS_PORTS[0])
    assert gang.free_port() >= low
