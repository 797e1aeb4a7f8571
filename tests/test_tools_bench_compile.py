"""tools/bench_compile.py: a rank's kernels compiled from an empty numba cache, timed kernel by kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench_compile.py")


def run(script_env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], env=script_env, capture_output=True, text=True, timeout=240)


def test_one_line_per_thread_count_with_the_kernels_asked_for(script_env):
    done = run(script_env, "--threads", "1", "--kernels", "kv_write", "argmax")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 1
    line = lines[0]
    assert (line["bench"], line["dtype"], line["threads"], line["repeat"]) == ("compile", "bfloat16", 1, 0)
    assert list(line["kernels_s"]) == ["kv_write", "argmax"]
    # Compiled, not loaded from a cache: numba's cache loads take a few milliseconds,
    # a build of each of these at least a tenth of a second.
    assert all(seconds > 0.1 for seconds in line["kernels_s"].values())
    assert line["total_s"] == pytest.approx(sum(line["kernels_s"].values()), abs=0.002)


def test_a_kernel_the_rank_would_not_build_is_refused(script_env):
    # The bf16 GEMM is a bfloat16 rank's only.
    done = run(script_env, "--dtype", "float32", "--threads", "1", "--kernels", "bf16_gemm")
    assert done.returncode != 0
    assert "not built for float32" in done.stderr
