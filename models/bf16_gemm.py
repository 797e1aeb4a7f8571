"""bfloat16 linears on CPU through our own AVX512-BF16 kernel instead of oneDNN.

On one Zen 4 core (a one-off probe, weights from memory as in a step), oneDNN's
packed bf16 GEMM ran a 32-row decode projection at 130-180 GFLOP/s against about 190
over 64 rows, and every call cost about 14 us before any arithmetic: a large part of
what makes two 32-row pipeline batches cost more than one 64-row batch. The kernel in
models/bf16_gemm_kernels.py keeps 8 rows by 32 columns of float32 sums in registers,
hints the next panel of weights into L2 while it computes, and is called with raw
addresses (about 2 us a call; `PackedLinear` adds about 4, `tools/bench_calls.py`): 170-210 GFLOP/s at 32 rows
from memory, 200-215 at 64, and level with oneDNN from 512 rows up.

A rank with one intra-op thread runs it on that thread. One with more splits the
weight's panels over numba's thread pool, as many ways as it has torch threads (as
decode attention does): with two threads on two Zen 4 cores, 280-420 GFLOP/s at 32
rows against oneDNN's 160-350, 350-440 at 64 against 260-390, and 367-453 at 512
against 362-436. It needs a CPU with avx512_bf16 and numba; without either, nothing
here is built and callers keep oneDNN. The result is the float32 sum rounded to
bfloat16, as oneDNN's; sums are taken in another order, so a value can differ from
oneDNN's by one bf16 ulp.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from models.numba_kernels import load_checked, native_address, pool_size, run_split, uses_pool

__all__ = ["PANEL", "cpu_supported", "enabled", "linear", "pack", "prepare", "set_enabled", "supports"]

logger = logging.getLogger(__name__)

_Kernel = Callable[..., None]

# Output columns of one packed panel (what models/bf16_gemm_kernels.py computes at a time).
PANEL = 32

_enabled = True


def set_enabled(on: bool) -> None:
    """Pack bf16 weights for the kernel where it can run (True, the default) or for oneDNN (False).

    Process-wide; weights packed before the call keep their layout.
    """
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether weights packed from now on in this process take the kernel where it can run."""
    return _enabled


@functools.lru_cache(maxsize=1)
def cpu_supported() -> bool:
    """Whether this CPU has avx512_bf16 as LLVM sees it: what the micro-kernel (here and in
    models/prompt_attention.py) needs to be built at all."""
    # LLVM's view of the host, which is what numba compiles for; not models.config's
    # cpu_has_native_bf16, which also counts AMX and Arm bf16 and says yes when unsure.
    try:
        from llvmlite import binding
    except ImportError:
        return False
    try:
        return bool(binding.get_host_cpu_features().get("avx512bf16", False))
    except Exception as exc:  # noqa: BLE001 - no feature list: treat as absent
        logger.debug("no host CPU features from LLVM: %s", exc)
        return False


def supports(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can be packed for the kernel: a CPU bf16 matrix, out a multiple of 32, in even.

    Also False where the kernel cannot run on this machine (no avx512_bf16, no numba,
    or its check failed) or is switched off (`set_enabled`).
    """
    return (
        _enabled
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % PANEL == 0
        and weight.shape[1] % 2 == 0
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and _kernel() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as the kernel reads it: [N / 32, K / 2, 32, 2], contiguous (`supports` must hold)."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T for W packed by `pack`: [..., N] in bfloat16.

    On as many threads as torch has (numba's pool when more than one). Raises
    ValueError if x is not a CPU bfloat16 tensor with K features.
    """
    # A decode step makes 57 of these calls on a few rows each: every microsecond of
    # Python here is about 0.5% of the step, so the common case (2-D, contiguous, one
    # thread) asks each tensor property once.
    kernel = _kernel()
    assert kernel is not None, "pack() needs supports() first"
    panels, pairs = packed.shape[:2]
    n, k = panels * PANEL, pairs * 2
    shape = x.shape
    if shape[-1] != k:
        raise ValueError(f"input has {shape[-1]} features, the packed weight takes {k}")
    if x.dtype != torch.bfloat16 or not x.is_cpu:
        raise ValueError(f"the bf16 kernel takes CPU bfloat16 inputs, got {x.dtype} on {x.device}")
    a = x if len(shape) == 2 else x.reshape(-1, k)
    if not a.is_contiguous():
        a = a.contiguous()
    m = a.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16)
    if m:
        parts = min(torch.get_num_threads(), pool_size())
        pool = _parallel_kernel() if parts > 1 else None
        if pool is not None:
            run_split(pool, parts, panels, (a.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n))
        else:
            kernel(a.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n)
    return out if len(shape) == 2 else out.view(*shape[:-1], n)


def _check(run: Callable[[int, int, int, int, int, int], None]) -> None:
    # Builds (or loads from numba's cache) and checks a kernel now, so a broken toolchain fails once, here.
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 2, 32), (5, 64, 64), (8, 30, 32), (19, 96, 96), (64, 128, 32), (3, 64, 96)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        packed = pack(w)
        out = torch.empty((m, n), dtype=torch.bfloat16)
        run(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n)
        want = torch.nn.functional.linear(x.float(), w.float())
        # The float32 sum rounded once to bf16: within half a bf16 ulp of the exact sum,
        # plus float32 rounding of the partial sums.
        if not torch.allclose(out.float(), want, rtol=2**-8, atol=1e-4 * k):
            worst = (out.float() - want).abs().max().item()
            raise RuntimeError(f"the bf16 GEMM kernel differs from F.linear by {worst} at m={m}, k={k}, n={n}")


@functools.lru_cache(maxsize=1)
def _kernel() -> Optional[_Kernel]:
    """The kernel, built (or loaded from numba's cache) and checked on the first call; None if unusable."""
    if not cpu_supported():
        logger.info("this CPU has no avx512_bf16: bfloat16 linears use oneDNN")
        return None
    return load_checked(
        "models.bf16_gemm_kernels",
        lambda kern: kern.gemm,
        _check,
        "the bf16 GEMM kernel",
        "bfloat16 linears use oneDNN",
    )


@functools.lru_cache(maxsize=1)
def _parallel_kernel() -> Optional[int]:
    """For the thread pool: the address of `gemm_panels`, built and checked on the first call
    from a process with several threads (models/numba_kernels.py's `run_split` runs it).

    None where it cannot run (the one-thread kernel serves then). A one-thread rank never
    builds it, so it never starts numba's pool (which would reset torch's thread count).
    """
    if _kernel() is None:
        return None
    return load_checked(
        "models.bf16_gemm_kernels",
        # Seven addresses and sizes and the panel range, all int64 as Python ints are.
        lambda kern: native_address(kern.gemm_panels, (0,) * 8),
        lambda address: _check(lambda *args: run_split(address, 2, args[5] // PANEL, args)),
        "the parallel bf16 GEMM kernel",
        "bfloat16 linears run on one thread",
    )


def prepare(threads: Optional[int] = None) -> bool:
    """Builds the kernels a process with `threads` threads runs (a worker calls it while loading).

    Default: this process's torch thread count. Returns whether the kernel can run.
    """
    if _kernel() is None:
        return False
    if uses_pool(threads):
        _parallel_kernel()
    return True

