"""models/argmax.py: the greedy argmax kernel picks exactly what torch.max(dim=-1) picks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from models import argmax
from models.argmax import row_argmax

HAS_NUMBA = importlib.util.find_spec("numba") is not None
DTYPES = [torch.bfloat16, torch.float32]


def want(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


@pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")
def test_the_kernel_builds_and_passes_its_check():
    assert argmax.prepare()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 511, 512, 513, 1025, 32000])
def test_random_rows(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 64):
        x = (torch.randn(rows, vocab, generator=g) * 5).to(dtype)
        assert torch.equal(row_argmax(x), want(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_resolve_to_the_first_index(dtype):
    # Few distinct values: every row's max appears many times, in several blocks.
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (40, 3000), generator=g).to(dtype)
    assert torch.equal(row_argmax(x), want(x))
    x = torch.zeros(2, 2000, dtype=dtype)
    x[0, 1500], x[0, 1999] = 1, 1
    x[1, :] = -0.0
    x[1, 900] = 0.0  # -0.0 == +0.0: index 0 is the first max
    assert row_argmax(x).tolist() == [1500, 0] == want(x).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_and_extremes(dtype):
    info = torch.finfo(dtype)
    x = torch.randn(7, 1300, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[0, 1200], x[0, 40] = float("nan"), float("nan")  # the first NaN, even when the max's block came first
    x[0, 3] = float("inf")
    x[1] = float("-inf")
    x[2, 700], x[2, 1299] = float("inf"), float("inf")
    x[3] = -x[3].abs()
    x[4, 10] = info.max
    x[5] = info.min
    x[5, 1299] = info.min / 2
    x[6] = info.tiny * torch.rand(1300).to(dtype)  # small and subnormal values
    x[6, 5] = -info.tiny
    got = row_argmax(x)
    assert torch.equal(got, want(x))
    assert got[0].item() == 40


def test_views_other_dtypes_and_shapes_give_torch_max():
    x = torch.randn(6, 1000)
    assert torch.equal(row_argmax(x[:, 100:900]), want(x[:, 100:900]))  # not contiguous
    assert torch.equal(row_argmax(x.t()), want(x.t()))
    half = x.half()
    assert torch.equal(row_argmax(half), want(half))  # float16: torch.max itself
    assert row_argmax(torch.empty(0, 5)).shape == (0,)
    assert row_argmax(x).dtype == torch.int64
