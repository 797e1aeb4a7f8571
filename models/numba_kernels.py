"""Loading a module of numba kernels once: imported, built (or read from numba's cache) and checked, or None.

The kernel modules (models/*_kernels.py) import numba at their top, so importing one
fails where numba is missing; a kernel whose build or check fails on this machine is
as unusable. Either way the caller keeps its torch path, and the log says why: at INFO
for a missing numba (an optional dependency), at WARNING for a kernel that did not
build or did not compute what torch computes.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Optional, TypeVar

__all__ = ["int64_index", "load_checked", "native_address", "pool_size", "run_split", "uses_pool"]

logger = logging.getLogger(__name__)

K = TypeVar("K")


def load_checked(
    module: str, select: Callable[[ModuleType], K], check: Callable[[K], None], what: str, instead: str
) -> Optional[K]:
    """`select(module)` once `check` has passed on it; None where numba is missing or the check fails.

    `what` names the kernels and `instead` what the caller does without them, for the log.
    """
    try:
        kern = importlib.import_module(module)
    except ImportError as exc:
        logger.info("numba unavailable (%s): %s", exc, instead)
        return None
    try:
        kernels = select(kern)  # may compile (`native_address`)
        check(kernels)
    except Exception as exc:  # noqa: BLE001 - any failure to build or to agree means "use torch"
        logger.warning("%s unavailable (%s): %s", what, exc, instead)
        return None
    return kernels


@functools.lru_cache(maxsize=1)
def pool_size() -> int:
    """The most threads numba's pool can run (NUMBA_NUM_THREADS, fixed once numba is loaded); 1 without numba."""
    try:
        import numba
    except ImportError:
        return 1
    return int(numba.config.NUMBA_NUM_THREADS)


def int64_index(t: Any) -> Any:
    """Index tensor `t` as a kernel that takes it by address reads it: 1-D, contiguous int64 on
    the CPU (the engine's already are, and come back as they are). ValueError if not 1-D."""
    import torch

    if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu", torch.int64).contiguous()
    if t.dim() != 1:
        raise ValueError(f"an index tensor must be 1-D, got shape {tuple(t.shape)}")
    return t


def uses_pool(threads: Optional[int] = None) -> bool:
    """Whether a process with `threads` torch threads (default: this one's) runs kernels on numba's pool.

    A one-thread rank never does: starting the pool would reset torch's thread count.
    """
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    return min(threads, pool_size()) > 1


def native_address(kernel: Any, args: tuple[Any, ...]) -> int:
    """The address of numba dispatcher `kernel`'s machine code for arguments typed as `args`.

    Compiled now, or loaded from numba's cache, if it was not yet; valid while the
    process lives (the dispatcher keeps it). What `run_split` calls: the caller must then
    pass arguments of exactly these types. It reads numba's compile result (`library`,
    `fndesc`), which numba does not document: where a release changes them this raises,
    and `load_checked` falls back to one thread.
    """
    import numba

    sig = tuple(numba.typeof(a) for a in args)
    kernel.compile(sig)
    compiled = kernel.overloads[sig]
    return int(compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name))


def run_split(address: int, parts: int, total: int, args: tuple[Any, ...]) -> None:
    """kernel(*args, lo, hi) for `parts` contiguous ranges [lo, hi) of [0, total), on numba's pool.

    `address` is `native_address(kernel, args + (lo, hi))` for arguments of these very
    types (models/pool_kernels.py says why it is called by address).
    """
    from models.pool_kernels import split_call

    run_on_pool(split_call, parts, address, total, args)


def run_on_pool(kernel: Callable[..., Any], parts: int, *args: Any) -> Any:
    """`kernel(*args, parts)`, a numba `parallel=True` kernel, on `parts` threads of numba's pool.

    numba's OpenMP pool is the same runtime as torch's (one libgomp per process), and
    starting or using it can change torch's thread count: this puts it back.
    """
    import numba
    import torch

    threads = torch.get_num_threads()
    numba.set_num_threads(parts)
    try:
        return kernel(*args, parts)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
