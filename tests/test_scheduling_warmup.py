"""LLM's first start: helper processes compile the ranks' numba kernels, and the ranks then compile nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba")

_KERNELS = (
    ("models.decode_attention_kernels", "attend"),
    ("models.kv_write_kernels", "write_kv"),
    ("models.norm_rope_kernels", "rms_norm"),
    ("models.norm_rope_kernels", "rotary"),
    ("models.argmax_kernels", "argmax_float32"),
)


def rank_compiles(worker) -> int:  # noqa: ANN001 - run on each rank by collective_rpc
    """How many kernel builds this rank's process compiled instead of loading them from numba's cache."""
    import importlib

    return sum(
        sum(getattr(importlib.import_module(module), name).stats.cache_misses.values()) for module, name in _KERNELS
    )


_SCRIPT = """
import json, sys
from scheduling import LLM, SamplingParams
from tests.model_checkpoints import build_checkpoint
from tests.test_scheduling_warmup import rank_compiles

path = build_checkpoint(sys.argv[1], seed=1)
prompts = [[1, 2, 3, 4], [5, 6, 7]]
out = {}
for workers in (int(sys.argv[2]), int(sys.argv[2])):  # the second start finds the stamp
    with LLM(path, pp=2, dtype="float32", kv_cache_bytes=8 * 2**20, compile_workers=workers) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
        out.setdefault("compiled", []).append(llm.supervisor.collective_rpc(rank_compiles))
        out.setdefault("tokens", []).append(tokens)
print(json.dumps(out))
"""


def _run_cold(script_env: dict, tmp_path, script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`script` in a fresh Python, as on a machine's first start: numba's cache and ours empty.

    Fails the test unless it exits with 0.
    """
    env = dict(script_env, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PIPEACTORS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 0])
def test_after_the_warm_up_the_ranks_compile_nothing(script_env, tmp_path, workers: int) -> None:
    proc = _run_cold(script_env, tmp_path, _SCRIPT, str(tmp_path / "tiny"), str(workers), timeout=280)
    out = json.loads(proc.stdout.splitlines()[-1])
    first, second = out["compiled"]
    if workers:
        assert first == [0, 0], "a rank compiled a kernel the helpers should have built"
        assert list((tmp_path / "cache" / "kernels").glob("*.done"))
    else:
        assert all(n > 0 for n in first), "with no helpers each rank compiles its own"
    assert second == [0, 0]  # everything cached by then
    assert out["tokens"][0] == out["tokens"][1]


_FIRST_START = """
import json, sys, time
import models.default_model as default_model
import models.kernel_warmup as kernel_warmup
from scheduling import LLM
from tests.test_scheduling_warmup import rank_compiles

events = {}
build, start = default_model._build_default_model, kernel_warmup.WarmUp.__init__

def timed_build(*args, **kwargs):
    build(*args, **kwargs)
    events["model_built"] = time.perf_counter()

def timed_start(self, *args, **kwargs):
    events["warm_up_started"] = time.perf_counter()
    start(self, *args, **kwargs)

default_model._build_default_model = timed_build
kernel_warmup.WarmUp.__init__ = timed_start
with LLM(dtype="float32", kv_cache_bytes=8 * 2**20) as llm:
    events["compiled"] = llm.supervisor.collective_rpc(rank_compiles)
print(json.dumps(events))
"""


@pytest.mark.timeout(240)
def test_a_first_start_compiles_while_the_default_model_is_built(script_env, tmp_path) -> None:
    # Nothing built yet, as on a fresh machine: neither the default model nor any kernel.
    proc = _run_cold(script_env, tmp_path, _FIRST_START, timeout=220)
    events = json.loads(proc.stdout.splitlines()[-1])
    assert events["warm_up_started"] < events["model_built"], events
    assert events["compiled"] == [0], "the warm-up built a different set than the rank needed"
    assert list((tmp_path / "cache" / "kernels").glob("*.done"))


_FAILED_BUILD = """
import multiprocessing, time
import models.default_model as default_model
from scheduling import LLM

def failing_build(directory, seed):
    # Fails while the warm-up's helpers compile (bfloat16: seconds of it each).
    deadline = time.monotonic() + 60
    while not multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("helpers running", len(multiprocessing.active_children()))
    raise OSError("No space left on device")

default_model._build_default_model = failing_build
try:
    LLM(dtype="bfloat16", kv_cache_bytes=8 * 2**20)
except OSError as exc:
    print("raised", exc)
print("helpers left", len(multiprocessing.active_children()))
"""


@pytest.mark.timeout(120)
def test_a_failed_build_of_the_default_model_ends_the_warm_up(script_env, tmp_path) -> None:
    proc = _run_cold(script_env, tmp_path, _FAILED_BUILD, timeout=100)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("helpers running") and int(lines[0].split()[-1]) >= 1
    assert "raised No space left on device" in lines
    assert lines[-1] == "helpers left 0"
    assert not list((tmp_path / "cache" / "kernels").glob("*.done"))  # nothing finished: no stamp
