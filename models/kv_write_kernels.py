"""The numba kernel behind models/kv_write.py (imported only where numba is installed).

A pure copy: values are moved as their bits (int16 for 2-byte dtypes, int32 for
4-byte ones), so the result is the input's bits in any floating dtype.
"""

from __future__ import annotations

import numba
import numpy as np

from models.numba_pointer import pointer


@numba.njit(nogil=True, cache=True)
def write_kv(k, v, slots, paged_k, paged_v, take, rows, positions, mirror_k, mirror_v):  # noqa: ANN001 - typed by numba
    """paged[slots[t]] = kv[t] for every token t; mirror[rows[i], :, positions[i]] = kv[take[i]] for every i.

    k, v [T, H, D]; slots [T]; paged_k/v [S, H, D] (flat slots); take, rows, positions
    [B]; mirror_k/v [R, H, L, D]. Shapes and every index are checked before anything is
    written: a mismatch raises ValueError, a bad index IndexError, and both caches stay
    as they were.
    """
    n, heads, dim = k.shape
    if v.shape != k.shape or slots.shape[0] != n or paged_k.shape != paged_v.shape:
        raise ValueError("keys, values and slots disagree in shape")
    if paged_k.shape[1] != heads or paged_k.shape[2] != dim:
        raise ValueError("keys do not fit the KV cache's heads or head size")
    if take.shape[0] > 0:
        if mirror_k.shape != mirror_v.shape or mirror_k.shape[1] != heads or mirror_k.shape[3] != dim:
            raise ValueError("keys do not fit the KV mirror's heads or head size")
        if rows.shape[0] != take.shape[0] or positions.shape[0] != take.shape[0]:
            raise ValueError("decode rows, mirror rows and positions disagree in length")
    for t in range(n):
        if slots[t] < 0 or slots[t] >= paged_k.shape[0]:
            raise IndexError("KV cache slot out of range")
    for i in range(take.shape[0]):
        if take[i] < 0 or take[i] >= n:
            raise IndexError("decode row out of range of the step's tokens")
        if rows[i] < 0 or rows[i] >= mirror_k.shape[0] or positions[i] < 0 or positions[i] >= mirror_k.shape[2]:
            raise IndexError("KV mirror row or position out of range")
    for t in range(n):
        s = slots[t]
        for h in range(heads):
            for j in range(dim):
                paged_k[s, h, j] = k[t, h, j]
                paged_v[s, h, j] = v[t, h, j]
    for i in range(take.shape[0]):
        t, r, p = take[i], rows[i], positions[i]
        for h in range(heads):
            for j in range(dim):
                mirror_k[r, h, p, j] = k[t, h, j]
                mirror_v[r, h, p, j] = v[t, h, j]


# Entry points that take the step's tensors by address: converting k, v and four index
# tensors to numpy arrays made a call cost 7-10 us instead of 4-7 (`tools/bench_calls.py`),
# and a decode step makes one call a layer. The cache's and the mirror's buffers stay arrays (viewed once, `bits`).
# The caller (models/kv_write.py) checks dtypes, layouts and shapes first; the indices
# are checked here, by `write_kv`. One entry per element size, so that a rank compiles
# only its cache's.


@numba.njit(nogil=True, cache=True)
def write_kv_int16_at(k, v, n, slots, paged_k, paged_v, take, rows, positions, b, mirror_k, mirror_v):  # noqa: ANN001
    """`write_kv` of 2-byte values: k, v [n, H, D] and slots [n] (int64) at addresses, take, rows,
    positions [b] (int64) at addresses; the buffers as arrays of their bits."""
    heads, dim = paged_k.shape[1], paged_k.shape[2]
    write_kv(
        numba.carray(pointer(k, np.int16), (n, heads, dim)), numba.carray(pointer(v, np.int16), (n, heads, dim)),
        numba.carray(pointer(slots, np.int64), (n,)), paged_k, paged_v,
        numba.carray(pointer(take, np.int64), (b,)), numba.carray(pointer(rows, np.int64), (b,)),
        numba.carray(pointer(positions, np.int64), (b,)), mirror_k, mirror_v,
    )


@numba.njit(nogil=True, cache=True)
def write_kv_int32_at(k, v, n, slots, paged_k, paged_v, take, rows, positions, b, mirror_k, mirror_v):  # noqa: ANN001
    """`write_kv_int16_at` for 4-byte values."""
    heads, dim = paged_k.shape[1], paged_k.shape[2]
    write_kv(
        numba.carray(pointer(k, np.int32), (n, heads, dim)), numba.carray(pointer(v, np.int32), (n, heads, dim)),
        numba.carray(pointer(slots, np.int64), (n,)), paged_k, paged_v,
        numba.carray(pointer(take, np.int64), (b,)), numba.carray(pointer(rows, np.int64), (b,)),
        numba.carray(pointer(positions, np.int64), (b,)), mirror_k, mirror_v,
    )
