"""glibc keeps freed memory in the process once models.host_memory asks it to."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
    ),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints how many MB of a freed 64 MB tensor stay resident.
SCRIPT = """
import sys, torch
from models.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mb()
x = torch.ones(16 * 2**20)  # 64 MB, touched
del x
print(rss_mb() - before)
"""


def _resident_after_free(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_a_freed_large_tensor_stays_resident_only_when_asked():
    assert _resident_after_free("default") < 16  # mmapped, returned to the kernel on free
    assert _resident_after_free("keep") > 48  # kept in the heap for the next allocation


def test_workers_on_cpu_keep_freed_memory_unless_told_not_to(tmp_path):
    from actors.context import ActorContext
    from models.worker import LlamaWorker
    from tests.model_checkpoints import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "m")
    ctx = ActorContext(pp=0, tp=0, tp_size=1, pp_size=1, master_addr="127.0.0.1", master_port=0)
    assert LlamaWorker(ctx, model=ckpt, keep_freed_memory=True).keeps_freed_memory
    assert not LlamaWorker(ctx, model=ckpt, keep_freed_memory=False).keeps_freed_memory
