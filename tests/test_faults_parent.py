"""The parent of a gang is SIGKILLed while a batch is in flight: its actors go within 5 s, and it
leaves no shared memory behind (tp2 maps a shared all-reduce buffer, models/shm_allreduce.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import pid_alive, wait_gone
from tests.model_checkpoints import build_checkpoint

pytestmark = pytest.mark.timeout(120)

PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from actors import Fault, FaultPlan
    from scheduling import LLM, SamplingParams

    if __name__ == "__main__":
        tp, pp = int(sys.argv[2]), int(sys.argv[3])
        # The output rank sits 60 s in its third step: that batch is in flight when the parent dies.
        plan = FaultPlan([Fault((pp - 1, 0), "execute_model", 3, "delay", 60.0)])
        llm = LLM(sys.argv[1], tp=tp, pp=pp, block_size=8, kv_cache_bytes=1 << 20, fault_plan=plan,
                  policy="restart", step_timeout=120.0)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        threading.Thread(target=llm.generate, args=([[1, 2, 3], [4, 5, 6, 7]], params), daemon=True).start()
        while not (llm.engine.num_batches >= 3 and llm.supervisor.status()["in_flight"] > 0):
            time.sleep(0.01)
        print(" ".join(map(str, llm.supervisor.pids)), flush=True)
        time.sleep(120)
    """
)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def held_open(names: set[str]) -> set[str]:
    """The /dev/shm entries some live process has open or mapped (they are not left behind)."""
    paths = {f"/dev/shm/{n}": n for n in names}
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                targets += [line.split()[-1] for line in f if "/dev/shm/" in line]
        except OSError:
            continue
        held |= {paths[t] for t in targets if t in paths}
    return held


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["tp1pp2", "tp2pp1"])
def test_actors_exit_and_shared_memory_is_released_when_the_parent_is_sigkilled(tmp_path, script_env, tp, pp):
    path = build_checkpoint(
        tmp_path / "tiny", seed=5, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    shm_before = shm_entries()
    parent = subprocess.Popen([sys.executable, str(script), path, str(tp), str(pp)], stdout=subprocess.PIPE, text=True, env=script_env)
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids), line
        start = time.monotonic()
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(pids, timeout=5.0) == []
        assert time.monotonic() - start < 5.0
    finally:
        parent.kill()
        parent.wait()
    # multiprocessing's resource tracker (which outlives the parent) unlinks what the parent
    # registered; give it a moment, then nothing new may be left that no process holds.
    def left_behind() -> set[str]:
        new = shm_entries() - shm_before
        return new - held_open(new)

    deadline = time.monotonic() + 5.0
    left = left_behind()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = left_behind()
    assert not left, f"shared memory left behind: {sorted(left)}"
