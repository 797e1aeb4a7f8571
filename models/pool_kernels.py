"""One numba kernel that runs any of our one-thread kernels over numba's thread pool.

Imported only where numba is installed (models/numba_kernels.py's `run_split` uses it).

A `parallel=True` function that calls a jitted kernel directly gets its own copy of
that kernel's machine code. numba links the callee into the parallel function's
library, and LLVM optimizes and compiles it again. On first start that took 2.5-5.6 s
for each of the GEMM, decode attention and prompt attention kernels, on top of the
one-thread kernel itself.

`split_call` instead calls a kernel's compiled code through its address, as numba
calls one of its own functions. It compiles in 0.3-1.3 s (the address lookup
included), once per tuple of argument types, and serves every kernel whose last two
arguments are the bounds of a range of work, [lo, hi).
"""

from __future__ import annotations

import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def call_native(typingctx, address, args, lo, hi):  # noqa: ANN001, ANN202 - a numba intrinsic
    """Calls the function at `address` (numba's calling convention, returning None) with *args, lo, hi.

    The function must have been compiled for exactly these argument types, with lo and
    hi as int64 (`models.numba_kernels.native_address` gives such an address). An
    exception it raises goes to call_native's caller, but `split_call`'s parallel loop
    does not pass it on: a kernel run through it must not raise (ours do not; their
    callers check shapes and dtypes first).
    """
    if not (isinstance(address, types.Integer) and isinstance(args, types.BaseTuple)):
        return None
    if not (isinstance(lo, types.Integer) and isinstance(hi, types.Integer)):
        return None
    arg_types = tuple(args) + (types.int64, types.int64)

    def codegen(context, builder, signature, llargs):  # noqa: ANN001, ANN202
        fn_type = context.call_conv.get_function_type(types.none, arg_types)
        fn = builder.inttoptr(llargs[0], fn_type.as_pointer())
        values = [builder.extract_value(llargs[1], i) for i in range(len(args))]
        values += [context.cast(builder, llargs[j], signature.args[j], types.int64) for j in (2, 3)]
        status, _ = context.call_conv.call_function(builder, fn, types.none, arg_types, values)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(address, args, lo, hi), codegen


@numba.njit(nogil=True, parallel=True, cache=True)
def split_call(address, total, args, parts):  # noqa: ANN001 - typed by numba
    """The kernel at `address` called as kernel(*args, lo, hi) on `parts` contiguous ranges of [0, total), in parallel."""
    for p in numba.prange(parts):
        call_native(address, args, total * p // parts, total * (p + 1) // parts)
