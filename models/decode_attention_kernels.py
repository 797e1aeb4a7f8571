"""The numba kernels behind models/decode_attention.py (imported only where numba is installed).

Module-level functions so that numba can cache their machine code between runs
(`cache=True`: next to this file, or in numba's user cache where that is read-only).

`attend_<dtype>` runs the tasks [lo, hi) (task = sequence * kv_heads + kv head) on the
calling thread, with no thread pool at all; `attend_<dtype>_parallel` splits all tasks
into `parts` contiguous ranges over numba's pool. A rank with one thread uses the first:
starting numba's OpenMP pool in it would share (and resize) torch's own OpenMP runtime.
"""

from __future__ import annotations

import numba
import numpy as np

# Reassociation lets LLVM vectorise the dot products and sums; no "nnan"/"ninf", so a
# NaN or inf in the inputs is carried through rather than being undefined behaviour.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def softmax_rows(s, n):  # noqa: ANN001 - typed by numba
    """In place: each row g of s[:, :n] becomes softmax(s[g, :n]), in float32."""
    for g in range(s.shape[0]):
        m = s[g, 0]
        for t in range(1, n):
            m = max(m, s[g, t])
        total = np.float32(0.0)
        for t in range(n):
            e = np.exp(s[g, t] - m)
            s[g, t] = e
            total += e
        inv = np.float32(1.0) / total
        for t in range(n):
            s[g, t] *= inv


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_float32(q, kbuf, vbuf, rows, counts, scale, out, lo, hi):  # noqa: ANN001 - typed by numba
    """Tasks [lo, hi): out[i, h] = softmax(q[i, h] k^T * scale) v over keys [0, counts[i]) of row rows[i], head h.

    q/out [B, H, G, D] float32; kbuf/vbuf [R, H, cap, D] float32. Each key row is read
    once for all G query heads that share it, and so is each value row.
    """
    heads, groups, dim = q.shape[1], q.shape[2], q.shape[3]
    s = np.empty((groups, kbuf.shape[2]), np.float32)  # scores, then probabilities
    acc = np.empty((groups, dim), np.float32)
    for task in range(lo, hi):
        i = task // heads
        h = task - i * heads
        n = counts[i]
        k, v, qh = kbuf[rows[i], h], vbuf[rows[i], h], q[i, h]
        for t in range(n):
            for g in range(groups):
                a = np.float32(0.0)
                for d in range(dim):
                    a += qh[g, d] * k[t, d]
                s[g, t] = a * scale
        softmax_rows(s, n)
        acc[:] = 0.0
        for t in range(n):
            for g in range(groups):
                p = s[g, t]
                for d in range(dim):
                    acc[g, d] += p * v[t, d]
        out[i, h] = acc


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_bfloat16(q, kbuf, vbuf, rows, counts, scale, out, lo, hi):  # noqa: ANN001 - typed by numba
    """As attend_float32, with kbuf/vbuf holding bfloat16 bits as uint16, widened one key (value) row at a time."""
    heads, groups, dim = q.shape[1], q.shape[2], q.shape[3]
    s = np.empty((groups, kbuf.shape[2]), np.float32)
    acc = np.empty((groups, dim), np.float32)
    wide = np.empty(dim, np.uint32)  # a bfloat16 is the top half of the float32 with the same value
    row = wide.view(np.float32)
    for task in range(lo, hi):
        i = task // heads
        h = task - i * heads
        n = counts[i]
        k16, v16, qh = kbuf[rows[i], h], vbuf[rows[i], h], q[i, h]
        for t in range(n):
            for d in range(dim):
                wide[d] = np.uint32(k16[t, d]) << 16
            for g in range(groups):
                a = np.float32(0.0)
                for d in range(dim):
                    a += qh[g, d] * row[d]
                s[g, t] = a * scale
        softmax_rows(s, n)
        acc[:] = 0.0
        for t in range(n):
            for d in range(dim):
                wide[d] = np.uint32(v16[t, d]) << 16
            for g in range(groups):
                p = s[g, t]
                for d in range(dim):
                    acc[g, d] += p * row[d]
        out[i, h] = acc


@numba.njit(fastmath=FASTMATH, nogil=True, parallel=True, cache=True)
def attend_float32_parallel(q, kbuf, vbuf, rows, counts, scale, out, parts):  # noqa: ANN001 - typed by numba
    """Every task, in `parts` contiguous ranges run by numba's thread pool."""
    tasks = q.shape[0] * q.shape[1]
    for p in numba.prange(parts):
        attend_float32(q, kbuf, vbuf, rows, counts, scale, out, tasks * p // parts, tasks * (p + 1) // parts)


@numba.njit(fastmath=FASTMATH, nogil=True, parallel=True, cache=True)
def attend_bfloat16_parallel(q, kbuf, vbuf, rows, counts, scale, out, parts):  # noqa: ANN001 - typed by numba
    """As attend_float32_parallel, over bfloat16 keys and values."""
    tasks = q.shape[0] * q.shape[1]
    for p in numba.prange(parts):
        attend_bfloat16(q, kbuf, vbuf, rows, counts, scale, out, tasks * p // parts, tasks * (p + 1) // parts)
