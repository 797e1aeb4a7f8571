"""`pointer(address, dtype)`: an int64 byte address as a typed pointer inside numba code.

The kernels' address entry points (models/norm_rope_kernels.py, models/kv_write_kernels.py)
wrap it in `numba.carray` to see a tensor's memory as an array of a given shape, so
that a call from Python passes integers instead of converting tensors to numpy arrays.
Imported only where numba is installed.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic

__all__ = ["pointer"]


@intrinsic
def pointer(typingctx, address, dtype):  # noqa: ANN001, ANN202 - typed by numba
    """The int64 `address` as a pointer to values of `dtype` (a number class: np.int16, np.float32)."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    typed = types.CPointer(dtype.instance_type)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], context.get_value_type(typed))

    return typed(address, dtype), codegen
