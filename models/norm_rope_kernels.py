"""The numba kernels behind models/norm_rope.py (imported only where numba is installed).

One source per op, compiled per dtype: a float32 tensor is read as float32, a bfloat16
one as its int16 bits. A bfloat16 is the top half of a float32, so widening is a shift,
and narrowing rounds to the nearest even the way torch's `c10::BFloat16` does (a NaN
becomes the quiet NaN 0x7FC0). `_round` rounds a float32 result to the tensor's dtype
(a no-op for float32) wherever torch's CPU ops would round theirs, so the rotary kernel
gives torch's bits exactly; the norm's sum of squares is summed in another order than
torch's (as any reduction kernel would), the rest rounds as torch does.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from models.numba_pointer import pointer

# Reassociation for the sum of squares only, so LLVM can vectorise it. Nowhere else: no
# "contract" either, since fusing a multiply and an add into one FMA skips the rounding
# that torch's separate ops do between them.
SUM_MATH = {"reassoc", "nsz"}

_QUIET_NAN = np.int32(0x7FC00000)
_HIGH_HALF = np.int32(-65536)  # 0xFFFF0000


def widen(value):  # noqa: ANN001, ANN202 - typed by the overload below
    """A stored value (float32, or bfloat16 bits as int16) as float32."""


def _round(x, like):  # noqa: ANN001, ANN202
    """float32 x rounded to the dtype of the array `like` (nearest even), still a float32."""


def _store(x, like):  # noqa: ANN001, ANN202
    """float32 x, already rounded, as a value of the array `like`'s dtype."""


def _bits(like) -> bool:  # noqa: ANN001
    return isinstance(like.dtype, types.Integer)


@overload(widen)
def _widen_impl(value):  # noqa: ANN001, ANN202
    if isinstance(value, types.Integer):
        return lambda value: np.int32(np.int32(value) << 16).view(np.float32)
    return lambda value: value


@overload(_round)
def _round_impl(x, like):  # noqa: ANN001, ANN202
    if not _bits(like):
        return lambda x, like: x

    def to_bfloat16(x, like):  # noqa: ANN001, ANN202
        u = np.float32(x).view(np.int32)
        nan = (u & np.int32(0x7FFFFFFF)) > np.int32(0x7F800000)
        r = np.int32(np.int32(u + np.int32(0x7FFF) + ((u >> 16) & np.int32(1))) & _HIGH_HALF)
        return np.int32(_QUIET_NAN if nan else r).view(np.float32)

    return to_bfloat16


@overload(_store)
def _store_impl(x, like):  # noqa: ANN001, ANN202
    if _bits(like):
        return lambda x, like: np.int16(np.float32(x).view(np.int32) >> 16)
    return lambda x, like: x


@numba.njit(nogil=True, fastmath=SUM_MATH, cache=True)
def _sum_squares(row):  # noqa: ANN001 - typed by numba
    s = np.float32(0.0)
    for j in range(row.shape[0]):
        v = widen(row[j])
        s += v * v
    return s


@numba.njit(nogil=True, cache=True)
def rms_norm(x, weight, out, eps):  # noqa: ANN001 - typed by numba
    """out[t] = weight * round(x[t] * rsqrt(mean(x[t]^2) + eps)), x [T, D], in float32 (see the module)."""
    n, d = x.shape
    fd, e = np.float32(d), np.float32(eps)  # float32 arithmetic throughout, as torch's
    for t in range(n):
        row, o = x[t], out[t]
        scale = np.float32(1.0) / np.sqrt(_sum_squares(row) / fd + e)
        for j in range(d):
            o[j] = _store(_round(_round(widen(row[j]) * scale, x) * widen(weight[j]), x), x)


@numba.njit(nogil=True, cache=True)
def rotary(x, cos, sin):  # noqa: ANN001 - typed by numba
    """In place: x[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], each op rounded as torch's.

    x [T, H, D], cos and sin [T, D]; rotate_half(v) = cat(-v[D/2:], v[:D/2]).
    """
    n, heads, d = x.shape
    half = d // 2
    for t in range(n):
        c, s = cos[t], sin[t]
        for h in range(heads):
            row = x[t, h]
            for j in range(half):
                a, b = widen(row[j]), widen(row[j + half])
                lo = _round(a * widen(c[j]), x) + _round(-b * widen(s[j]), x)
                hi = _round(b * widen(c[j + half]), x) + _round(a * widen(s[j + half]), x)
                row[j], row[j + half] = _store(_round(lo, x), x), _store(_round(hi, x), x)


# Entry points that take byte addresses and sizes instead of arrays. Converting three
# tensors to numpy arrays and dispatching on their types cost about 4 us of a 32-row norm's
# 9 us per call; a decode step of the default model makes 33 of these calls. The caller
# (models/norm_rope.py) checks every shape, dtype and layout before it passes an address.


@numba.njit(nogil=True, cache=True)
def rms_norm_bits_at(x, weight, out, rows, dim, eps):  # noqa: ANN001 - typed by numba
    """`rms_norm` of bfloat16 tensors (read as int16 bits) at addresses x, weight, out: [rows, dim], [dim], [rows, dim]."""
    rms_norm(
        numba.carray(pointer(x, np.int16), (rows, dim)),
        numba.carray(pointer(weight, np.int16), (dim,)),
        numba.carray(pointer(out, np.int16), (rows, dim)),
        eps,
    )


@numba.njit(nogil=True, cache=True)
def rms_norm_float32_at(x, weight, out, rows, dim, eps):  # noqa: ANN001 - typed by numba
    """`rms_norm` of float32 tensors at addresses x, weight, out: [rows, dim], [dim], [rows, dim]."""
    rms_norm(
        numba.carray(pointer(x, np.float32), (rows, dim)),
        numba.carray(pointer(weight, np.float32), (dim,)),
        numba.carray(pointer(out, np.float32), (rows, dim)),
        eps,
    )


@numba.njit(nogil=True, cache=True)
def rotary_bits_at(x, cos, sin, rows, heads, dim):  # noqa: ANN001 - typed by numba
    """`rotary` in place of a bfloat16 x [rows, heads, dim] at address x, with cos and sin [rows, dim]."""
    rotary(
        numba.carray(pointer(x, np.int16), (rows, heads, dim)),
        numba.carray(pointer(cos, np.int16), (rows, dim)),
        numba.carray(pointer(sin, np.int16), (rows, dim)),
    )


@numba.njit(nogil=True, cache=True)
def rotary_float32_at(x, cos, sin, rows, heads, dim):  # noqa: ANN001 - typed by numba
    """`rotary` in place of a float32 x [rows, heads, dim] at address x, with cos and sin [rows, dim]."""
    rotary(
        numba.carray(pointer(x, np.float32), (rows, heads, dim)),
        numba.carray(pointer(cos, np.float32), (rows, dim)),
        numba.carray(pointer(sin, np.float32), (rows, dim)),
    )
