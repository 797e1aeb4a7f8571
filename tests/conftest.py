"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import os
import time

import pytest


def child_pids(parent: int | None = None) -> list[int]:
    """Live processes whose parent is `parent` (default: this one), minus multiprocessing's resource tracker."""
    parent = os.getpid() if parent is None else parent
    pids = []
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
        if ppid != parent or state == "Z" or b"resource_tracker" in cmdline:
            continue
        pids.append(int(entry))
    return pids


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
