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


# exp(x) for x <= 0 in float32 as in Cephes' expf: x = k ln2 + r with |r| <= ln2 / 2
# (ln2 split in two so k ln2 is exact), e^r by a degree-7 polynomial, 2^k written into
# the exponent bits. A softmax row stays within 4.5 ulp of the exact one (np.exp: 2.7;
# tests/test_models_decode_attention.py), and unlike numba's np.exp, a libm call per
# element, LLVM vectorises it: a 64-row decode layer's softmax 0.40 -> 0.17 ms, one core.
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.33654)  # ln of float32's smallest normal: below it e^x counts as 0
EXP_POLY = (
    np.float32(1.9875691500e-4),
    np.float32(1.3981999507e-3),
    np.float32(8.3334519073e-3),
    np.float32(4.1665795894e-2),
    np.float32(1.6666665459e-1),
    np.float32(5.0000001201e-1),
)


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def softmax_rows(s, n, scale_bits):  # noqa: ANN001 - typed by numba
    """In place: each row g of s[:, :n] becomes softmax(s[g, :n]), in float32.

    `scale_bits` is int32 scratch of at least n: the 2^k factors, built as bits.
    A NaN in a row makes the row NaN, as np.exp would.
    """
    c0, c1, c2, c3, c4, c5 = EXP_POLY
    scales = scale_bits.view(np.float32)
    for g in range(s.shape[0]):
        m = s[g, 0]
        for t in range(1, n):
            m = max(m, s[g, t])
        for t in range(n):
            x = s[g, t] - m
            under = x < EXP_MIN
            x = max(x, EXP_MIN)
            k = np.floor(x * LOG2E + np.float32(0.5))
            k = k if k == k else np.float32(0.0)  # NaN: keep the conversion defined; p carries the NaN
            r = x - k * LN2_HI - k * LN2_LO
            p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
            p = p * r * r + r + np.float32(1.0)
            scale_bits[t] = (np.int32(k) + np.int32(127)) << 23
            s[g, t] = np.float32(0.0) if under else p
        total = np.float32(0.0)
        for t in range(n):
            e = s[g, t] * scales[t]
            s[g, t] = e
            total += e
        inv = np.float32(1.0) / total
        for t in range(n):
            s[g, t] *= inv


# Each key (value) row is used by the G query heads of its kv head. With G == 2 (the
# default model's, and common GQA) both heads go through the row in one loop, two
# multiply-adds per element loaded, with the accumulators in registers (1.39 -> 1.21 ms
# a 64-row bf16 layer, one core); other G take the row one head at a time. The branch is
# written out in each kernel: through a helper, numba builds views per key and loses it.


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_float32(q, kbuf, vbuf, rows, counts, scale, out, lo, hi):  # noqa: ANN001 - typed by numba
    """Tasks [lo, hi): out[i, h] = softmax(q[i, h] k^T * scale) v over keys [0, counts[i]) of row rows[i], head h.

    q/out [B, H, G, D] float32; kbuf/vbuf [R, H, cap, D] float32. Each key row is read
    once for all G query heads that share it, and so is each value row.
    """
    heads, groups, dim = q.shape[1], q.shape[2], q.shape[3]
    s = np.empty((groups, kbuf.shape[2]), np.float32)  # scores, then probabilities
    bits = np.empty(kbuf.shape[2], np.int32)
    acc = np.empty((groups, dim), np.float32)
    acc0, acc1 = acc[0], acc[groups - 1]
    for task in range(lo, hi):
        i = task // heads
        h = task - i * heads
        n = counts[i]
        k, v, qh = kbuf[rows[i], h], vbuf[rows[i], h], q[i, h]
        q0, q1 = qh[0], qh[groups - 1]
        for t in range(n):
            row = k[t]
            if groups == 2:
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for d in range(dim):
                    x = row[d]
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                s[0, t] = a0 * scale
                s[1, t] = a1 * scale
            else:
                for g in range(groups):
                    a = np.float32(0.0)
                    for d in range(dim):
                        a += qh[g, d] * row[d]
                    s[g, t] = a * scale
        softmax_rows(s, n, bits)
        acc[:] = 0.0
        for t in range(n):
            row = v[t]
            if groups == 2:
                p0, p1 = s[0, t], s[1, t]
                for d in range(dim):
                    x = row[d]
                    acc0[d] += p0 * x
                    acc1[d] += p1 * x
            else:
                for g in range(groups):
                    p = s[g, t]
                    for d in range(dim):
                        acc[g, d] += p * row[d]
        out[i, h] = acc


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_bfloat16(q, kbuf, vbuf, rows, counts, scale, out, lo, hi):  # noqa: ANN001 - typed by numba
    """As attend_float32, with kbuf/vbuf holding bfloat16 bits as uint16, widened one key (value) row at a time."""
    heads, groups, dim = q.shape[1], q.shape[2], q.shape[3]
    s = np.empty((groups, kbuf.shape[2]), np.float32)
    bits = np.empty(kbuf.shape[2], np.int32)
    acc = np.empty((groups, dim), np.float32)
    acc0, acc1 = acc[0], acc[groups - 1]
    wide = np.empty(dim, np.uint32)  # a bfloat16 is the top half of the float32 with the same value
    row = wide.view(np.float32)
    for task in range(lo, hi):
        i = task // heads
        h = task - i * heads
        n = counts[i]
        k16, v16, qh = kbuf[rows[i], h], vbuf[rows[i], h], q[i, h]
        q0, q1 = qh[0], qh[groups - 1]
        for t in range(n):
            for d in range(dim):
                wide[d] = np.uint32(k16[t, d]) << 16
            if groups == 2:
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for d in range(dim):
                    x = row[d]
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                s[0, t] = a0 * scale
                s[1, t] = a1 * scale
            else:
                for g in range(groups):
                    a = np.float32(0.0)
                    for d in range(dim):
                        a += qh[g, d] * row[d]
                    s[g, t] = a * scale
        softmax_rows(s, n, bits)
        acc[:] = 0.0
        for t in range(n):
            for d in range(dim):
                wide[d] = np.uint32(v16[t, d]) << 16
            if groups == 2:
                p0, p1 = s[0, t], s[1, t]
                for d in range(dim):
                    x = row[d]
                    acc0[d] += p0 * x
                    acc1[d] += p1 * x
            else:
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
