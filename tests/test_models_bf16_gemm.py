"""Our AVX512-BF16 GEMM kernel (models/bf16_gemm.py) computes what F.linear computes in bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import bf16_gemm
from models.numba_kernels import pool_size
from models.prepack import PackedWeight, prepack_supported
from tests.kernel_threads import assert_pool_only_with_threads

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not bf16_gemm.prepare(), reason="no avx512_bf16 or no numba on this machine"),
]


@pytest.fixture(autouse=True)
def kernel_switched_on():
    # The switch is process-wide: a bf16 worker loaded earlier in this process may have turned it off.
    before = bf16_gemm.enabled()
    bf16_gemm.set_enabled(True)
    yield
    bf16_gemm.set_enabled(before)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    # One thread runs the kernel on the caller's thread; two split the panels over numba's pool.
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    if request.param > 1 and pool_size() > 1:
        # Built and checked, not fallen back to one thread.
        assert bf16_gemm._parallel_kernel() is not None
    yield request.param
    torch.set_num_threads(before)


def _close_to_float32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # The float32 sum of bf16 products, rounded once: within half a bf16 ulp, plus float32 rounding.
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4 * w.shape[1])


# Row counts around the 8-row blocks and the 64-row chunks; widths of one and several panels.
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 130, 513])
@pytest.mark.parametrize("k, n", [(2, 32), (40, 64), (512, 96), (1408, 512)])
def test_kernel_equals_f_linear_for_any_row_count_and_shape(rows, k, n, threads):
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    _close_to_float32(bf16_gemm.linear(x, bf16_gemm.pack(w)), x, w)
    assert torch.get_num_threads() == threads


def test_mostly_bit_for_bit_with_torch_bfloat16_linear(threads):
    # Same float32 sums in another order: at most a rare one-ulp difference from torch's own result.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1408, 512, generator=g).bfloat16()
    x = torch.randn(64, 512, generator=g).bfloat16()
    got, want = bf16_gemm.linear(x, bf16_gemm.pack(w)), F.linear(x, w)
    assert (got != want).float().mean().item() < 0.01


def test_strided_and_3d_inputs(one_thread):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g).bfloat16()
    packed = bf16_gemm.pack(w)
    x = torch.randn(2, 9, 48, generator=g).bfloat16()
    _close_to_float32(bf16_gemm.linear(x, packed), x, w)
    view = x[:, ::2]  # not contiguous
    _close_to_float32(bf16_gemm.linear(view, packed), view, w)
    assert bf16_gemm.linear(x[:, :0], packed).shape == (2, 0, 64)


def test_bad_inputs_raise():
    packed = bf16_gemm.pack(torch.randn(32, 8).bfloat16())
    with pytest.raises(ValueError, match="has 6 features, the packed weight takes 8"):
        bf16_gemm.linear(torch.randn(3, 6).bfloat16(), packed)
    with pytest.raises(ValueError, match="takes CPU bfloat16 inputs, got torch.float32"):
        bf16_gemm.linear(torch.randn(3, 8), packed)


def test_supports_only_what_the_kernel_can_run():
    assert bf16_gemm.supports(torch.zeros(64, 16, dtype=torch.bfloat16))
    assert not bf16_gemm.supports(torch.zeros(48, 16, dtype=torch.bfloat16))  # not whole panels
    assert not bf16_gemm.supports(torch.zeros(64, 15, dtype=torch.bfloat16))  # odd width
    assert not bf16_gemm.supports(torch.zeros(64, 16))  # float32
    assert not bf16_gemm.supports(torch.zeros(64, 16, dtype=torch.float16))


@pytest.mark.skipif(not prepack_supported(torch.bfloat16, "cpu"), reason="no oneDNN bfloat16 packing")
def test_packed_weight_takes_the_kernel_where_it_can_run(threads):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    packed = PackedWeight(w, b)
    assert packed.own_kernel
    torch.testing.assert_close(packed.linear(x).float(), F.linear(x, w, b).float(), rtol=2**-7, atol=2e-2)
    assert not PackedWeight(torch.randn(48, 64).bfloat16()).own_kernel  # oneDNN for what the kernel cannot run
    assert not PackedWeight(w.float()).own_kernel
    bf16_gemm.set_enabled(False)
    try:
        assert not PackedWeight(w).own_kernel
    finally:
        bf16_gemm.set_enabled(True)


_USE_KERNEL = """
from models import bf16_gemm

assert bf16_gemm.prepare(threads)
w = torch.randn(96, 64).bfloat16()
packed = bf16_gemm.pack(w)
for rows in (1, 9, 70):
    x = torch.randn(rows, 64).bfloat16()
    torch.testing.assert_close(bf16_gemm.linear(x, packed).float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-2)
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_keeps_the_rank_thread_count(threads: int) -> None:
    assert_pool_only_with_threads(_USE_KERNEL, "bf16_gemm._parallel_kernel", "()", threads)
