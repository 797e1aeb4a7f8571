"""models/kernel_warmup.py: what a rank builds, and helper processes that build it into numba's cache first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from models.kernel_warmup import KernelSet
from tests.conftest import wait_gone

pytest.importorskip("numba")


def test_builds_follow_the_dtype_and_the_options() -> None:
    f32 = KernelSet(torch.float32, 1, 64)
    assert set(f32.builds()) == {"decode_attention", "argmax", "norm_rope", "kv_write"}
    bf16 = KernelSet(torch.bfloat16, 2, 64)
    assert set(bf16.builds()) == {"bf16_gemm", "decode_attention", "prompt_attention", "argmax", "norm_rope", "kv_write"}
    assert "prompt_attention" not in KernelSet(torch.bfloat16, 1, 48).builds()  # heads not whole panels of 32
    off = KernelSet(torch.bfloat16, 1, 64, bf16_gemm=False, decode_attention=False, argmax=False)
    assert set(off.builds()) == {"prompt_attention", "norm_rope", "kv_write"}
    assert set(KernelSet(torch.float16, 1, 64).builds()) == {"argmax", "kv_write"}


@pytest.mark.parametrize("parts", [1, 2, 3, 16])
def test_shares_hold_each_build_once(parts: int) -> None:
    kernels = KernelSet(torch.bfloat16, 2, 64)
    shares = kernels.shares(parts)
    assert len(shares) == min(parts, len(kernels.builds()))
    assert sorted(name for share in shares for name in share) == sorted(kernels.builds())
    if parts == 2:
        # The two longest builds start on different sides, and neither side waits on
        # the other for longer than the shortest build takes.
        longest = sorted(kernels.builds(), key=kernels._cost, reverse=True)[:2]
        assert {longest[0] in shares[0], longest[1] in shares[0]} == {True, False}
        loads = [sum(kernels._cost(name) for name in share) for share in shares]
        assert abs(loads[0] - loads[1]) <= min(kernels._cost(name) for name in kernels.builds())


def test_the_stamp_follows_the_settings() -> None:
    assert KernelSet(torch.float32, 1, 64).stamp() == KernelSet(torch.float32, 1, 64).stamp()
    assert KernelSet(torch.float32, 1, 64).stamp() != KernelSet(torch.float32, 2, 64).stamp()
    assert KernelSet(torch.float32, 1, 64).stamp() != KernelSet(torch.bfloat16, 1, 64).stamp()


def test_a_rank_compiles_its_own_dtype_only(script_env, tmp_path) -> None:
    # A fresh numba cache, so that what the build compiles is all there is.
    code = textwrap.dedent("""
        import torch
        from models import kv_write_kernels, norm_rope_kernels
        from models.kernel_warmup import KernelSet
        only = dict(bf16_gemm=False, decode_attention=False, prompt_attention=False, argmax=False)
        assert all(KernelSet(torch.bfloat16, 1, 64, **only).build().values())
        print(*(str(d.signatures) for d in (norm_rope_kernels.rms_norm, norm_rope_kernels.rotary, kv_write_kernels.write_kv)), sep="\\n")
        # The entry points by address: bfloat16's built, float32's not.
        entries = (norm_rope_kernels.rms_norm_bits_at, norm_rope_kernels.rotary_bits_at,
                   kv_write_kernels.write_kv_int16_at, norm_rope_kernels.rms_norm_float32_at,
                   norm_rope_kernels.rotary_float32_at, kv_write_kernels.write_kv_int32_at)
        print("entries", *(len(d.signatures) for d in entries))
    """)
    env = dict(script_env, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *signatures, entries = proc.stdout.splitlines()
    assert entries == "entries 1 1 1 0 0 0"
    assert len(signatures) == 3
    for compiled in signatures:
        # One signature each, over bfloat16's int16 bits: no float32 (or int32) variant.
        assert "int16" in compiled and "float32" not in compiled and "int32" not in compiled, compiled

_WARM = """
import sys, torch
from actors.gang import start_context
from models.kernel_warmup import KernelSet, warm_up

kernels = KernelSet(torch.{dtype}, 1, 64)
context = start_context("forkserver", ("models.preload",))
warm = warm_up(kernels, context, 2)
assert warm is not None and len(warm.pids) == 2, warm
print("pids", *warm.pids, flush=True)
{then}
"""


def _script(then: str, dtype: str = "float32") -> str:
    return textwrap.dedent(_WARM).format(then=textwrap.dedent(then), dtype=dtype)


def _env(script_env, tmp_path) -> dict:
    # A cold numba cache and no stamp: the helpers have everything to compile.
    return dict(script_env, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PIPEACTORS_CACHE=str(tmp_path / "cache"))


@pytest.mark.timeout(240)
def test_the_rank_then_loads_every_kernel_from_the_cache(script_env, tmp_path) -> None:
    then = """
    assert warm.wait(180), "a helper failed"
    assert warm_up(kernels, context, 2) is None  # stamped: the next start skips it
    from models import argmax_kernels, decode_attention_kernels, kv_write_kernels, norm_rope_kernels
    assert all(kernels.build().values())
    dispatchers = [decode_attention_kernels.attend_float32_at, kv_write_kernels.write_kv_int32_at, norm_rope_kernels.rms_norm_float32_at,
                   norm_rope_kernels.rotary_float32_at, argmax_kernels.argmax_float32]
    print("misses", sum(sum(d.stats.cache_misses.values()) for d in dispatchers))
    print("hits", min(sum(d.stats.cache_hits.values()) for d in dispatchers))
    """
    proc = subprocess.run(
        [sys.executable, "-c", _script(then)],
        env=_env(script_env, tmp_path), capture_output=True, text=True, timeout=220,
    )
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["misses"] == "0", proc.stdout  # nothing compiled in the rank's process
    assert int(out["hits"]) >= 1, proc.stdout
    assert list((tmp_path / "cache" / "kernels").glob("*.done"))


@pytest.mark.timeout(120)
def test_helpers_end_with_their_parent(script_env, tmp_path) -> None:
    then = """
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)  # while the helpers compile
    """
    # bfloat16: each helper has several seconds of compiling left when its parent dies.
    # Not read to the end: the helpers hold the pipe too, as long as they live.
    with subprocess.Popen(
        [sys.executable, "-c", _script(then, "bfloat16")],
        env=_env(script_env, tmp_path), stdout=subprocess.PIPE, text=True,
    ) as proc:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert proc.wait(timeout=100) == -9
        assert len(pids) == 2
        assert not wait_gone(pids, timeout=1.5), "a helper outlived its parent"
    assert not list((tmp_path / "cache").glob("kernels/*.done"))


@pytest.mark.timeout(120)
def test_close_ends_the_helpers(script_env, tmp_path) -> None:
    # bfloat16: the helpers have seconds of compiling left, so close() must end them, not wait.
    then = """
    import time
    from tests.conftest import pid_alive
    pids = warm.pids
    start = time.monotonic()
    warm.close()
    print("seconds", time.monotonic() - start)
    print("alive", sum(pid_alive(p) for p in pids))
    """
    proc = subprocess.run(
        [sys.executable, "-c", _script(then, "bfloat16")],
        env=_env(script_env, tmp_path), capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "alive 0"
    assert float(proc.stdout.splitlines()[-2].split()[1]) < 1.5, proc.stdout
