"""The numba kernels behind models/decode_attention.py (imported only where numba is installed).

Module-level functions so that numba can cache their machine code between runs
(`cache=True`: next to this file, or in numba's user cache where that is read-only).
"""

from __future__ import annotations

import numba
import numpy as np

# Reassociation lets LLVM vectorise the dot products and sums; no "nnan"/"ninf", so a
# NaN or inf in the inputs is carried through rather than being undefined behaviour.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def one_head(qh, k, v, n, scale, s, out):  # noqa: ANN001 - typed by numba
    """qh [G, D], k/v [>= n, D] float32; s [G, >= n] scratch; out [G, D] = softmax(qh k[:n]^T * scale) v[:n]."""
    groups, dim = qh.shape
    for t in range(n):
        for g in range(groups):
            acc = np.float32(0.0)
            for d in range(dim):
                acc += qh[g, d] * k[t, d]
            s[g, t] = acc * scale
    for g in range(groups):
        m = s[g, 0]
        for t in range(1, n):
            m = max(m, s[g, t])
        total = np.float32(0.0)
        for t in range(n):
            e = np.exp(s[g, t] - m)
            s[g, t] = e
            total += e
        inv = np.float32(1.0) / total
        for d in range(dim):
            out[g, d] = 0.0
        for t in range(n):
            p = s[g, t] * inv
            for d in range(dim):
                out[g, d] += p * v[t, d]


@numba.njit(fastmath=FASTMATH, nogil=True, parallel=True, cache=True)
def attend_float32(q, kbuf, vbuf, rows, counts, scale, out):  # noqa: ANN001 - typed by numba
    """One task per (sequence, kv head): q/out [B, H, G, D]; kbuf/vbuf [R, H, cap, D] float32."""
    b, heads, groups = q.shape[0], q.shape[1], q.shape[2]
    for task in numba.prange(b * heads):
        i, h = task // heads, task % heads
        n = counts[i]
        s = np.empty((groups, n), np.float32)
        one_head(q[i, h], kbuf[rows[i], h], vbuf[rows[i], h], n, scale, s, out[i, h])


@numba.njit(fastmath=FASTMATH, nogil=True, parallel=True, cache=True)
def attend_bfloat16(q, kbuf, vbuf, rows, counts, scale, out):  # noqa: ANN001 - typed by numba
    """As attend_float32, with kbuf/vbuf holding bfloat16 bits as uint16 (widened a row at a time)."""
    b, heads, groups, dim = q.shape
    for task in numba.prange(b * heads):
        i, h = task // heads, task % heads
        n = counts[i]
        # A bfloat16 is the top half of the float32 with the same value.
        kw = np.empty((n, dim), np.uint32)
        vw = np.empty((n, dim), np.uint32)
        k16, v16 = kbuf[rows[i], h], vbuf[rows[i], h]
        for t in range(n):
            for d in range(dim):
                kw[t, d] = np.uint32(k16[t, d]) << 16
                vw[t, d] = np.uint32(v16[t, d]) << 16
        s = np.empty((groups, n), np.float32)
        one_head(q[i, h], kw.view(np.float32), vw.view(np.float32), n, scale, s, out[i, h])
