"""The numba kernels behind models/decode_attention.py (imported only where numba is installed).

Module-level functions so that numba can cache their machine code between runs
(`cache=True`: next to this file, or in numba's user cache where that is read-only).

`attend` runs the tasks [lo, hi) (task = sequence * kv_heads + kv head) on the
calling thread, with no thread pool at all; a rank with several threads splits all
tasks into contiguous ranges over numba's pool (models/pool_kernels.py). A rank with one
thread never does: starting numba's OpenMP pool in it would share (and resize) torch's
own OpenMP runtime. It compiles once per dtype of the keys and values (float32, or
bfloat16 as int16 bits).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from models.norm_rope_kernels import widen
from models.numba_pointer import pointer

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
def softmax_rows(s, n, scale_bits, scale):  # noqa: ANN001 - typed by numba
    """In place: each row g of s[:, :n] becomes softmax(s[g, :n] * scale), in float32 (scale > 0).

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
            x = (s[g, t] - m) * scale
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
# multiply-adds per element loaded, with the accumulators in registers; other G take the
# row one head at a time. The branch is taken once per task, outside the loops over
# keys: inside them it kept LLVM from vectorising as well (about 10% of the kernel).
#
# A step reaches each layer's keys and values after the rest of the model has been
# through the cache (a 64-row layer's are 11.5 MB in bf16), and one task's rows are too
# short a run for the hardware prefetcher to get ahead. So while a task computes, it
# asks for the next task's rows, one row per row of its own; and a pass over the value
# accumulators weighs two value rows. One core, bf16, `tools/bench_attention.py`: 1.32-1.44
# -> 1.05 ms a layer, against 0.89-0.94 to only copy the keys and values out; a 64-row
# decode step of the default model 46.6 -> 42.5 ms (`tools/bench_step.py --parts`).


@intrinsic
def _prefetch(typingctx, buf, offset):  # noqa: ANN001, ANN202 - typed by numba
    """A hint that the byte at `offset` of buf's data (a C-contiguous array) is read soon: llvm.prefetch."""
    if not (isinstance(buf, types.Array) and buf.layout == "C" and isinstance(offset, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte_ptr], ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        )
        # A read (0), kept in every cache level (3), of data (1).
        builder.call(fn, [builder.gep(builder.bitcast(data, byte_ptr), [args[1]]), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(buf, offset), codegen


@numba.njit(nogil=True, cache=True)
def _prefetch_run(buf, start, count):  # noqa: ANN001 - typed by numba
    """Hints the cache lines of buf.flat[start:start + count] in."""
    size = buf.itemsize
    for b in range(start * size, (start + count) * size, 64):
        _prefetch(buf, b)


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend(q, kbuf, vbuf, rows, counts, scale, out, lo, hi):  # noqa: ANN001 - typed by numba
    """Tasks [lo, hi): out[i, h] = softmax(q[i, h] k^T * scale) v over keys [0, counts[i]) of row rows[i], head h.

    q/out [B, H, G, D] float32; kbuf/vbuf [R, H, cap, D], C-contiguous, float32 or
    bfloat16 bits as int16 (widened as they are read). Each key row is read once for
    all G query heads that share it, and so is each value row.
    """
    heads, groups, dim = q.shape[1], q.shape[2], q.shape[3]
    cap = kbuf.shape[2]
    s = np.empty((groups, cap), np.float32)  # scores, then probabilities
    bits = np.empty(cap, np.int32)
    acc = np.empty((groups, dim), np.float32)
    acc0, acc1 = acc[0], acc[groups - 1]
    s0, s1 = s[0], s[groups - 1]
    for task in range(lo, hi):
        i = task // heads
        h = task - i * heads
        n = counts[i]
        k, v, qh = kbuf[rows[i], h], vbuf[rows[i], h], q[i, h]
        q0, q1 = qh[0], qh[groups - 1]
        # The next task's keys and values start at flat index `ahead` of kbuf and vbuf.
        ahead, ahead_n = 0, 0
        if task + 1 < hi:
            j = (task + 1) // heads
            ahead = (rows[j] * heads + task + 1 - j * heads) * cap * dim
            ahead_n = counts[j]
        if groups == 2:
            for t in range(n):
                if t < ahead_n:
                    _prefetch_run(kbuf, ahead + t * dim, dim)
                row = k[t]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for d in range(dim):
                    x = widen(row[d])
                    a0 += q0[d] * x
                    a1 += q1[d] * x
                s0[t] = a0 * scale
                s1[t] = a1 * scale
        else:
            for t in range(n):
                if t < ahead_n:
                    _prefetch_run(kbuf, ahead + t * dim, dim)
                row = k[t]
                for g in range(groups):
                    a = np.float32(0.0)
                    for d in range(dim):
                        a += qh[g, d] * widen(row[d])
                    s[g, t] = a * scale
        softmax_rows(s, n, bits, np.float32(1.0))
        acc[:] = 0.0
        if groups == 2:
            t = 0
            while t + 1 < n:
                if t < ahead_n:
                    _prefetch_run(vbuf, ahead + t * dim, min(2, ahead_n - t) * dim)
                row = v[t]
                row2 = v[t + 1]
                p0, p1 = s0[t], s1[t]
                r0, r1 = s0[t + 1], s1[t + 1]
                for d in range(dim):
                    x = widen(row[d])
                    y = widen(row2[d])
                    acc0[d] += p0 * x + r0 * y
                    acc1[d] += p1 * x + r1 * y
                t += 2
            if t < n:
                row = v[t]
                p0, p1 = s0[t], s1[t]
                for d in range(dim):
                    x = widen(row[d])
                    acc0[d] += p0 * x
                    acc1[d] += p1 * x
        else:
            for t in range(n):
                if t < ahead_n:
                    _prefetch_run(vbuf, ahead + t * dim, dim)
                row = v[t]
                for g in range(groups):
                    p = s[g, t]
                    for d in range(dim):
                        acc[g, d] += p * widen(row[d])
        # Element by element: an array assigned into a slice makes numba compile the
        # shape-mismatch error's string formatting, about 3 s of this kernel's 5 s build.
        for g in range(groups):
            for d in range(dim):
                out[i, h, g, d] = acc[g, d]


# Entry points that take byte addresses and sizes instead of arrays: converting the
# queries, both buffers, the rows and counts and the output to numpy arrays made preparing
# a call cost 11-16 us instead of 4-8 (`tools/bench_calls.py`), and a decode step makes one
# call a layer. The caller
# (models/decode_attention.py) checks every dtype, layout and shape first. One entry per
# dtype of the keys and values, so that a rank compiles only its own.


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_bits_at(q, kbuf, vbuf, rows, counts, scale, out, b, heads, groups, dim, slots, cap, lo, hi):  # noqa: ANN001
    """`attend` over bfloat16 keys and values (int16 bits) [slots, heads, cap, dim] at kbuf and
    vbuf, with float32 q and out [b, heads, groups, dim] and int64 rows and counts [b] at addresses."""
    attend(
        numba.carray(pointer(q, np.float32), (b, heads, groups, dim)),
        numba.carray(pointer(kbuf, np.int16), (slots, heads, cap, dim)),
        numba.carray(pointer(vbuf, np.int16), (slots, heads, cap, dim)),
        numba.carray(pointer(rows, np.int64), (b,)),
        numba.carray(pointer(counts, np.int64), (b,)),
        scale,
        numba.carray(pointer(out, np.float32), (b, heads, groups, dim)),
        lo,
        hi,
    )


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def attend_float32_at(q, kbuf, vbuf, rows, counts, scale, out, b, heads, groups, dim, slots, cap, lo, hi):  # noqa: ANN001
    """`attend_bits_at` over float32 keys and values."""
    attend(
        numba.carray(pointer(q, np.float32), (b, heads, groups, dim)),
        numba.carray(pointer(kbuf, np.float32), (slots, heads, cap, dim)),
        numba.carray(pointer(vbuf, np.float32), (slots, heads, cap, dim)),
        numba.carray(pointer(rows, np.int64), (b,)),
        numba.carray(pointer(counts, np.int64), (b,)),
        scale,
        numba.carray(pointer(out, np.float32), (b, heads, groups, dim)),
        lo,
        hi,
    )
