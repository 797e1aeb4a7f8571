"""models/norm_rope.py: the RMSNorm and rotary kernels compute what models.llama's torch ops compute."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from models import norm_rope
from models.llama import RMSNorm, apply_rotary, rms_norm_reference, rotary_cos_sin

HAS_NUMBA = importlib.util.find_spec("numba") is not None
DTYPES = [torch.bfloat16, torch.float32]
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")


def angles(rows: int, head_dim: int, dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return rotary_cos_sin(torch.arange(start, start + rows), inv_freq, dtype)


@needs_numba
def test_the_kernels_build_and_pass_their_check():
    assert norm_rope.prepare()


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, head_dim", [(1, 8, 64), (32, 4, 64), (513, 3, 16), (7, 1, 2)])
def test_the_rotation_is_torchs_bit_for_bit_and_in_place(dtype, rows, heads, head_dim):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, heads, head_dim, generator=g) * 3).to(dtype)
    cos, sin = angles(rows, head_dim, dtype, start=1000)
    want = apply_rotary(x, cos, sin)
    with torch.inference_mode():
        got = norm_rope.rotate_(x, cos, sin)
    assert got is x and torch.equal(x, want)


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_go_through_the_rotation_as_in_torch(dtype):
    x = torch.randn(4, 2, 8).to(dtype)
    x[0, 0, 1], x[1, 1, 6], x[2, 0, 0] = float("nan"), float("inf"), float("-inf")
    x[3, 1, 2] = 3e38  # near the top of both types' range
    cos, sin = angles(4, 8, dtype)
    want = apply_rotary(x, cos, sin)
    with torch.inference_mode():
        got = norm_rope.rotate_(x.clone(), cos, sin)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 512), (64, 512), (512, 64), (3, 7)])
def test_the_norm_matches_torch_up_to_its_summation_order(dtype, rows, dim):
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(rows, dim, generator=g) * 4).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    want = rms_norm_reference(x, weight, 1e-5)
    with torch.inference_mode():
        got = norm_rope.rms_norm(x, weight, 1e-5)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    else:
        # The scale may move by a float32 ulp, which can round an output to the next bfloat16:
        # never further, and rarely.
        differ = got != want
        assert differ.float().mean() < 0.01
        assert ((got.float() - want.float()).abs()[differ] <= want.float().abs()[differ] * 2**-7).all()


@needs_numba
def test_an_rmsnorm_module_runs_the_kernel_outside_autograd(monkeypatch):
    ran = []
    run_norm = norm_rope._run_norm
    norm_rope.prepare()  # its check calls _run_norm too: built before the count starts
    monkeypatch.setattr(norm_rope, "_run_norm", lambda *a: ran.append(1) or run_norm(*a))
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        got = norm(x)
    assert ran == [1]
    torch.testing.assert_close(got, rms_norm_reference(x, norm.weight.detach(), 1e-6), rtol=1e-6, atol=0)


@needs_numba
def test_where_no_kernel_can_run_the_caller_keeps_torchs_ops():
    # Each input is contiguous and would run but for the one thing named.
    cos, sin = angles(3, 8, torch.float32)
    x = torch.randn(3, 2, 8)
    rows, weight = torch.randn(3, 8), torch.ones(8)
    with torch.inference_mode():
        assert norm_rope.rotate_(x.clone(), cos, sin) is not None and norm_rope.rms_norm(rows, weight, 1e-5) is not None
        assert norm_rope.rotate_(x.to(torch.float16), cos.half(), sin.half()) is None  # another dtype
        assert norm_rope.rotate_(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin) is None  # not contiguous
        odd_cos, odd_sin = angles(3, 8, torch.float32)[0][:, :7].contiguous(), angles(3, 8, torch.float32)[1][:, :7].contiguous()
        assert norm_rope.rotate_(x[:, :, :7].contiguous(), odd_cos, odd_sin) is None  # odd head_dim
        assert norm_rope.rotate_(x, cos.double(), sin.double()) is None  # mixed dtypes
        assert norm_rope.rotate_(x, cos[:2].contiguous(), sin[:2].contiguous()) is None  # angles for other rows
        assert norm_rope.rotate_(x[:0], cos[:0], sin[:0]) is None  # no rows
        assert norm_rope.rms_norm(x, weight, 1e-5) is None  # 3-d
        assert norm_rope.rms_norm(rows, torch.ones(7), 1e-5) is None  # weight of another width
        assert norm_rope.rms_norm(rows.t().contiguous().t(), weight, 1e-5) is None  # not contiguous
        assert norm_rope.rms_norm(rows.half(), weight.half(), 1e-5) is None  # another dtype
        assert norm_rope.rms_norm(rows[:0], weight, 1e-5) is None  # no rows
    # Autograd on: nothing runs, x is untouched.
    before = x.clone()
    assert norm_rope.rotate_(x, cos, sin) is None and torch.equal(x, before)
    assert norm_rope.rms_norm(rows, weight, 1e-5) is None
    # Turned off for the process: nothing runs either.
    try:
        norm_rope.set_enabled(False)
        with torch.inference_mode():
            assert norm_rope.rotate_(x, cos, sin) is None and norm_rope.rms_norm(rows, weight, 1e-5) is None
    finally:
        norm_rope.set_enabled(True)
    assert norm_rope.enabled()


def test_without_the_kernels_the_model_code_falls_back(monkeypatch):
    # What a host without numba, or one whose build failed its check, runs.
    cos, sin = angles(4, 8, torch.bfloat16)
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    rows = x[:, 0].contiguous()
    monkeypatch.setattr(norm_rope, "_kernels", lambda dtype: None)
    with torch.inference_mode():
        assert norm_rope.rotate_(x, cos, sin) is None and norm_rope.rms_norm(rows, torch.ones(8).bfloat16(), 1e-5) is None
        norm = RMSNorm(8, 1e-5).to(torch.bfloat16)
        h = rows.float()
        scale = torch.linalg.vector_norm(h, dim=-1, keepdim=True).pow(2).div(8).add(1e-5).rsqrt()
        want = (h * scale).to(torch.bfloat16) * norm.weight.detach()  # models.llama.RMSNorm's own torch path
        assert torch.equal(norm(rows), want)
