"""Keep freed host memory in the process, so a step's large activations reuse warm pages.

A CPU step allocates its activations afresh: a prefill of thousands of tokens
makes tens of [T, hidden] and [T, intermediate] tensors per layer, each freed a
few operations later. glibc serves allocations above its mmap threshold (at most
32 MB) with a fresh mmap and returns them to the kernel on free, and trims the
heap's free top above its trim threshold; either way the next tensor of that size
lands on pages the kernel must fault in and zero again, which on this project's
machine runs at 2-2.4 GB/s (../shared/reference/machine.md), about as slow as the
arithmetic on them. Turning both off makes freed memory stay in the heap and be
reused. `tools/bench_step.py --threads 1`, against the same with
`--release-memory`, alternating: the 8192-token prefill took 3.34-3.41 s against
3.81-3.90 s (4 runs each) and the whole workload 8.3-8.4 s against 8.8-9.1 s.

The cost is memory: the process keeps its high-water mark of heap memory instead of
returning it, and large blocks carved from the heap fragment it, so the same run
peaked at 1158-1218 MB resident against 1089-1097 MB. Only glibc has these knobs;
elsewhere `keep_freed_memory` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["keep_freed_memory"]

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# The largest value mallopt's int takes: free heap top above 2 GiB is still returned.
_TRIM_THRESHOLD = 2**31 - 1

_applied = False


def keep_freed_memory() -> bool:
    """Stops glibc from mmapping large blocks and trimming the heap, for this whole process.

    Returns whether the setting is in effect (False where the C library is not glibc).
    Idempotent.
    """
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success.
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    logger.debug("glibc malloc keeps freed memory: %s", _applied)
    return _applied
