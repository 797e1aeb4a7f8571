"""The numba kernels behind models/argmax.py (imported only where numba is installed).

Each row's values are read as the integer bits of their float type and mapped to integer
keys whose order is the floats' order (-0.0 and +0.0 share a key). LLVM vectorises the
integer max of a block, which it would not do for a float max that must honour NaN. A
row is scanned block by block; a block only replaces the best one if its max is strictly
larger, so the first block holding the row's max wins, and the first match inside it is
the first index of the row. A NaN anywhere makes the first NaN the answer, as in
`torch.max(dim=-1)`.
"""

from __future__ import annotations

import numba
import numpy as np

BLOCK = 512  # values per block: 1-2 KB, read once for the max and once more only for the winner


@numba.njit(nogil=True, cache=True)
def _block_max_bf16(blk):  # noqa: ANN001 - typed by numba
    """(max key, max of |bits|) over a block of bfloat16 bits (int16)."""
    best = np.int32(-(2**31))
    mag = np.int32(0)
    for j in range(blk.shape[0]):
        s = np.int32(blk[j])
        sign = np.int32(s >> np.int32(15))
        best = max(best, np.int32(np.int32(s ^ np.int32(sign & np.int32(0x7FFF))) - sign))
        mag = max(mag, np.int32(s & np.int32(0x7FFF)))
    return best, mag


@numba.njit(nogil=True, cache=True)
def argmax_bfloat16(x, out):  # noqa: ANN001 - typed by numba
    """out[i] = first index of the largest value of row i of x [N, V] (bfloat16 bits as int16); NaN first."""
    n, vocab = x.shape
    for i in range(n):
        row = x[i]
        best, best_at, nan_at = np.int32(-(2**31)), 0, -1
        for b0 in range(0, vocab, BLOCK):
            key, mag = _block_max_bf16(row[b0 : b0 + BLOCK])
            if mag > 0x7F80:  # a NaN: exponent all ones, mantissa not zero
                nan_at = b0
                break
            if key > best:
                best, best_at = key, b0
        blk = row[nan_at : nan_at + BLOCK] if nan_at >= 0 else row[best_at : best_at + BLOCK]
        for j in range(blk.shape[0]):
            s = np.int32(blk[j])
            sign = s >> 15
            if (nan_at >= 0 and (s & 0x7FFF) > 0x7F80) or (nan_at < 0 and (s ^ (sign & 0x7FFF)) - sign == best):
                out[i] = (nan_at if nan_at >= 0 else best_at) + j
                break


@numba.njit(nogil=True, cache=True)
def _block_max_f32(blk):  # noqa: ANN001 - typed by numba
    """(max key, max of |bits|) over a block of float32 bits (int32)."""
    best = np.int32(-(2**31))
    mag = np.int32(0)
    for j in range(blk.shape[0]):
        s = blk[j]
        sign = np.int32(s >> np.int32(31))
        best = max(best, np.int32(np.int32(s ^ np.int32(sign & np.int32(0x7FFFFFFF))) - sign))
        mag = max(mag, np.int32(s & np.int32(0x7FFFFFFF)))
    return best, mag


@numba.njit(nogil=True, cache=True)
def argmax_float32(x, out):  # noqa: ANN001 - typed by numba
    """out[i] = first index of the largest value of row i of x [N, V] (float32 bits as int32); NaN first."""
    n, vocab = x.shape
    for i in range(n):
        row = x[i]
        best, best_at, nan_at = np.int32(-(2**31)), 0, -1
        for b0 in range(0, vocab, BLOCK):
            key, mag = _block_max_f32(row[b0 : b0 + BLOCK])
            if mag > 0x7F800000:
                nan_at = b0
                break
            if key > best:
                best, best_at = key, b0
        blk = row[nan_at : nan_at + BLOCK] if nan_at >= 0 else row[best_at : best_at + BLOCK]
        for j in range(blk.shape[0]):
            s = np.int64(blk[j])
            sign = np.int64(-1) if s < 0 else np.int64(0)
            if (nan_at >= 0 and (s & 0x7FFFFFFF) > 0x7F800000) or (
                nan_at < 0 and (s ^ (sign & 0x7FFFFFFF)) - sign == best
            ):
                out[i] = (nan_at if nan_at >= 0 else best_at) + j
                break
