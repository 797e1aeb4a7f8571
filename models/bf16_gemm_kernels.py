"""The numba kernel behind models/bf16_gemm.py (imported only where numba is installed).

`gemm` computes C[M, N] = A[M, K] @ W[N, K].T in bfloat16 on the calling thread
(`gemm_panels` a range of its panels: models/bf16_gemm.py splits them over numba's pool), with W
packed by `models.bf16_gemm.pack` into panels of 32 output columns: [N / 32, K / 2,
32, 2], so that one k-pair of a panel is 128 contiguous bytes, two zmm registers of
bf16 pairs. The inner loop is AVX512-BF16's `vdpbf16ps` (a pair of
bf16 products added into float32 lanes), reached as its LLVM intrinsic because numba
has no bfloat type; the float32 sums are rounded to bf16 once, at the end (round to
nearest even, `vcvtneps2bf16`), as oneDNN does.

It takes raw addresses, not arrays: a call from Python then costs about 2 us instead
of the 10-20 us that converting and dispatching tensors costs, which matters for a
decode step's 57 small GEMMs. The caller (models/bf16_gemm.py) checks every shape,
dtype and layout before it passes an address. Only build this module on a CPU that
has avx512_bf16: LLVM cannot compile the intrinsic for one that does not.
"""

from __future__ import annotations

import functools

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Output columns of one packed panel (two zmm registers of float32 sums per row), as packed.
from models.bf16_gemm import PANEL

# Rows of A one micro-kernel call keeps in registers: 8 x 2 accumulators, 2 panel
# registers and a broadcast fit the 32 zmm registers with room to spare.
ROWS = 8
# Rows of A per pass over all the weights: a 64-row decode step is one pass.
CHUNK = 64


class _BFloat(ir.Type):
    """LLVM's `bfloat`, which llvmlite's IR builder does not offer."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32x16 = ir.VectorType(ir.FloatType(), 16)
_I32x16 = ir.VectorType(_I32, 16)
_BF16x32 = ir.VectorType(_BFloat(), 32)
_BF16x16 = ir.VectorType(_BFloat(), 16)


def _function(module: ir.Module, name: str, ftype: ir.FunctionType) -> ir.Function:
    existing = module.globals.get(name)
    return existing if existing is not None else ir.Function(module, ftype, name)


def _panel_intrinsic(float32_out: bool):  # noqa: ANN202 - a numba intrinsic
    """The micro-kernel intrinsic, storing C in bfloat16 (rounded once) or, for float32_out, as float32 sums."""

    @intrinsic
    def rows_times_panel(typingctx, rows, a, b, c, pairs, lda, ldc, ahead, ahead_step, ahead_second):  # noqa: ANN001, ANN202
        return _rows_times_panel_sig, functools.partial(_rows_times_panel_codegen, float32_out)

    return rows_times_panel


_rows_times_panel_sig = types.void(*[types.int64] * 10)


def _rows_times_panel_codegen(float32_out, context, builder, signature, args):  # noqa: ANN001, ANN202
    """C[rows, 32] = A[rows, K] @ panel for 1 <= rows <= 8, hinting lines at `ahead` into L2.

    a, b, c, ahead: byte addresses of A's first row, the panel, C's first row and what to
    prefetch; pairs = K / 2; lda, ldc: the row strides of A and C in bytes. Each k-pair
    hints the cache lines at ahead + pair * ahead_step and ahead_second bytes after it
    (0: the same line again, for one line a pair). One loop is built per row count, each
    with its sums in registers, and `rows` picks one (an LLVM switch).
    """
    nrows, a0, b0, c0, npairs, lda_, ldc_, ahead0, step, second = args
    module = builder.module
    dot = _function(
        module, "llvm.x86.avx512bf16.dpbf16ps.512", ir.FunctionType(_F32x16, [_F32x16, _BF16x32, _BF16x32])
    )
    to_bf16 = _function(module, "llvm.x86.avx512bf16.cvtneps2bf16.512", ir.FunctionType(_BF16x16, [_F32x16]))
    prefetch = _function(module, "llvm.prefetch.p0", ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32]))

    def at(base, *offsets):  # noqa: ANN001, ANN202
        for off in offsets:
            base = builder.add(base, off)
        return base

    def rows_loop(num_rows: int, entry: ir.Block, end: ir.Block) -> None:
        # From `entry`: the loop over k-pairs for num_rows rows, then their stores, then `end`.
        loop = builder.append_basic_block(f"pairs{num_rows}")
        done = builder.append_basic_block(f"store{num_rows}")
        builder.position_at_end(entry)
        builder.branch(loop)
        builder.position_at_end(loop)
        pair = builder.phi(_I64)
        pair.add_incoming(_I64(0), entry)
        sums = []
        for _ in range(num_rows * 2):
            acc = builder.phi(_F32x16)
            acc.add_incoming(ir.Constant(_F32x16, None), entry)
            sums.append(acc)
        b_at = at(b0, builder.mul(pair, _I64(PANEL * 4)))
        halves = [
            builder.load(builder.inttoptr(at(b_at, _I64(64 * h)), _BF16x32.as_pointer()), align=1) for h in (0, 1)
        ]
        ahead_at = at(ahead0, builder.mul(pair, step))
        for line_at in (ahead_at, at(ahead_at, second)):
            # A read (0), kept in L2 and below (2), of data (1): L1 holds the panel in use.
            builder.call(prefetch, [builder.inttoptr(line_at, _I8P), _I32(0), _I32(2), _I32(1)])
        a_at = at(a0, builder.mul(pair, _I64(4)))
        new = []
        for r in range(num_rows):
            a_pair = builder.load(
                builder.inttoptr(at(a_at, builder.mul(lda_, _I64(r))), _I32.as_pointer()), align=2
            )
            splat = builder.insert_element(ir.Constant(_I32x16, None), a_pair, _I32(0))
            splat = builder.shuffle_vector(splat, ir.Constant(_I32x16, None), ir.Constant(_I32x16, [0] * 16))
            a_bf16 = builder.bitcast(splat, _BF16x32)
            for h in (0, 1):
                new.append(builder.call(dot, [sums[2 * r + h], halves[h], a_bf16]))
        next_pair = builder.add(pair, _I64(1))
        pair.add_incoming(next_pair, builder.block)
        for acc, value in zip(sums, new):
            acc.add_incoming(value, builder.block)
        builder.cbranch(builder.icmp_signed("<", next_pair, npairs), loop, done)
        builder.position_at_end(done)
        for r in range(num_rows):
            row_at = at(c0, builder.mul(ldc_, _I64(r)))
            for h in (0, 1):
                if float32_out:
                    ptr = builder.inttoptr(at(row_at, _I64(64 * h)), _F32x16.as_pointer())
                    builder.store(new[2 * r + h], ptr, align=4)
                else:
                    out = builder.call(to_bf16, [new[2 * r + h]])
                    builder.store(out, builder.inttoptr(at(row_at, _I64(32 * h)), _BF16x16.as_pointer()), align=2)
        builder.branch(end)

    end = builder.append_basic_block("rows_done")
    starts = {n: builder.append_basic_block(f"rows{n}") for n in range(1, ROWS + 1)}
    switch = builder.switch(nrows, starts[ROWS])  # the caller passes 1..8
    for n, block in starts.items():
        switch.add_case(_I64(n), block)
    for n, block in starts.items():
        rows_loop(n, block, end)
    builder.position_at_end(end)
    return context.get_dummy_value()


# C in bfloat16 (the GEMM's) and in float32 (attention scores, models/prompt_attention_kernels.py).
rows_times_panel = _panel_intrinsic(False)
rows_times_panel_f32 = _panel_intrinsic(True)


@numba.njit(nogil=True, cache=True)
def gemm(a, b, c, m, k, n):  # noqa: ANN001 - typed by numba
    """C[m, n] = A[m, k] @ W.T for contiguous bf16 A and C at addresses a and c, W packed at b.

    k must be even and n a multiple of 32 (the caller checks). See `gemm_panels`.
    """
    gemm_panels(a, b, c, m, k, n, 0, n // PANEL)


@numba.njit(nogil=True, cache=True)
def gemm_panels(a, b, c, m, k, n, j0, j1):  # noqa: ANN001 - typed by numba
    """Columns [32 j0, 32 j1) of C[m, n] = A[m, k] @ W.T (see `gemm`).

    Up to CHUNK rows at a time, panel by panel: every 8-row block of the chunk runs
    over the panel, and the first two blocks hint the next panel (the range's first
    again after its last) into L2 half each (a lone block hints all of it), so that its
    weights stream in from memory while this one computes. Chunks keep a prompt step's
    rows of A in cache while all of the weights pass by.
    """
    pairs = k // 2
    panel_bytes = pairs * PANEL * 4
    lda = k * 2
    ldc = n * 2
    for first in range(0, m, CHUNK):
        rows = min(CHUNK, m - first)
        more = first + CHUNK < m
        blocks = (rows + ROWS - 1) // ROWS
        a_c = a + first * lda
        c_c = c + first * ldc
        for j in range(j0, j1):
            b_j = b + j * panel_bytes
            if j + 1 < j1:
                ahead = b_j + panel_bytes
            elif more:
                ahead = b + j0 * panel_bytes
            else:
                ahead = b_j
            c_j = c_c + j * PANEL * 2
            for blk in range(blocks):
                r = min(ROWS, rows - blk * ROWS)
                a_blk = a_c + blk * ROWS * lda
                c_blk = c_j + blk * ROWS * ldc
                if blocks == 1:
                    rows_times_panel(r, a_blk, b_j, c_blk, pairs, lda, ldc, ahead, 128, 64)
                elif blk < 2:
                    rows_times_panel(r, a_blk, b_j, c_blk, pairs, lda, ldc, ahead + blk * pairs * 64, 64, 0)
                else:
                    # The next panel is on its way: hint lines of this one, already in cache.
                    rows_times_panel(r, a_blk, b_j, c_blk, pairs, lda, ldc, b_j, 64, 0)
