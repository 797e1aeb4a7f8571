"""models/pool_kernels.py through models.numba_kernels.run_split: a kernel called by address over numba's pool."""

from __future__ import annotations

import pytest

numba = pytest.importorskip("numba")
np = pytest.importorskip("numpy")

from models.numba_kernels import native_address, pool_size, run_split  # noqa: E402

pytestmark = pytest.mark.skipif(pool_size() < 2, reason="numba's pool has one thread here")


@numba.njit(nogil=True)
def _count(out, step, lo, hi):  # noqa: ANN001 - typed by numba
    for i in range(lo, hi):
        out[i] += step


@pytest.mark.parametrize("total", [0, 1, 2, 5, 64])
def test_every_index_once(total: int) -> None:
    # Two parts (callers never ask for more than the pool's threads): ranges of 0 and 1 too.
    out = np.zeros(total, np.int64)
    address = native_address(_count, (out, 7, 0, 0))
    run_split(address, 2, total, (out, 7))
    assert out.tolist() == [7] * total


def test_arguments_reach_the_kernel_by_address() -> None:
    # A float argument between arrays and the range: the call must lay them out as numba does.
    @numba.njit(nogil=True)
    def scaled(src, factor, dst, lo, hi):  # noqa: ANN001 - typed by numba
        for i in range(lo, hi):
            dst[i] = src[i] * factor

    src = np.arange(10, dtype=np.float32)
    dst = np.zeros(10, np.float32)
    address = native_address(scaled, (src, np.float32(0.5), dst, 0, 0))
    run_split(address, 2, 10, (src, np.float32(0.5), dst))
    assert dst.tolist() == (src * 0.5).tolist()
    # The same address serves other arrays of the same types.
    other = np.zeros(10, np.float32)
    run_split(address, 2, 10, (src + 1, np.float32(2.0), other))
    assert other.tolist() == ((src + 1) * 2).tolist()
