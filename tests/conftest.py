"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import os
import time
import uuid

import pytest

# Set in the environment of scripts a test runs in a subprocess; every process they start
# (fork server, resource tracker, actors) inherits it, even once reparented to init.
TEST_TAG_VAR = "PIPEACTORS_TEST_TAG"


def child_pids(parent: int | None = None) -> list[int]:
    """Live processes whose parent is `parent` (default: this one), minus multiprocessing's
    resource tracker; a fork server counts through its children (the actors it forked)."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for pid, cmdline in _children(parent):
        if b"resource_tracker" in cmdline:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            pids += [child for child, _ in _children(pid)]
        else:
            pids.append(pid)
    return pids


def _children(parent: int) -> list[tuple[int, bytes]]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == parent and state != "Z":
            out.append((int(entry), cmdline))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 5.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds for them to end."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if p and pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment holds TEST_TAG_VAR=tag."""
    needle = f"{TEST_TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if needle in environ and pid_alive(int(entry)):
            pids.append(int(entry))
    return pids


@pytest.fixture
def script_env():
    """The environment for a script a test runs in a subprocess (this repo importable).

    After the test, every process started under it, whichever process it was reparented
    to (the script's fork server and resource tracker outlive a SIGKILLed script), must
    end within 10 s.
    """
    tag = uuid.uuid4().hex
    yield dict(os.environ, PYTHONPATH=os.getcwd(), **{TEST_TAG_VAR: tag})
    left = wait_gone(tagged_pids(tag), timeout=10.0)
    assert not left, f"processes started by the test's script outlived it: {left}"


@pytest.fixture(autouse=True, scope="session")
def fork_server():
    """Start the fork server once with the ranks' modules, as `LLM` does, so that every gang
    of the run forks from it instead of each rank importing torch (whichever test came first
    would otherwise fix the server's preload list for the whole run)."""
    from multiprocessing import forkserver, resource_tracker

    from actors import prestart
    from scheduling.llm import PRELOAD

    prestart(PRELOAD)
    yield
    # Stop the server, then the resource tracker it started, and wait for each, so that
    # they are gone when pytest exits instead of finishing their exits (the server has
    # torch loaded) a moment later, unreaped. `_stop` is CPython's hook for its own tests;
    # without it both still end, at EOF of their pipes to this process.
    for holder in (getattr(forkserver, "_forkserver", None), getattr(resource_tracker, "_resource_tracker", None)):
        stop = getattr(holder, "_stop", None)
        if stop is not None:
            stop()


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    """Module-scoped so that module fixtures may keep one gang for several tests."""
    yield
    deadline = time.monotonic() + 5.0
    left = child_pids()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = child_pids()
    assert not left, f"test left child processes behind: {left}"
