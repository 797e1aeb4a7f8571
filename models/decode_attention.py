"""Decode attention over the KV mirror in one pass, compiled with numba.

A decode step attends one query per sequence (per query head) over that sequence's
whole context. `F.scaled_dot_product_attention` on CPU runs that as a flash kernel
built for long query blocks: with a handful of query rows per kv head, its tiny
GEMM calls and the padded mask cost more than reading the keys and values. Here
each (sequence, kv head) is one task that reads its keys once (every query head of
the group scores against each key while it is in cache), takes a softmax in
float32 over the scores, and reads its values once: on one thread of this
project's AMD machine that is 2.5 ms a layer against SDPA's 3.9 over the throughput
workload's decode step (float32, 64 sequences, 176 positions; `tools/bench_attention.py`).

Inputs are the mirror's own buffers ([rows, kv_heads, len_cap, head_dim], each
(row, head) a contiguous run) with each sequence's row and key count, so there is
no padding to scatter queries into and no mask. bfloat16 keys and values are
widened to float32 as they are read; the scores, softmax and sums are float32 in
either dtype, as SDPA's CPU kernel computes them. Those buffers are not in cache
when a step reaches them, so each task asks for the next task's rows while it
computes (models/decode_attention_kernels.py).

A rank with one torch thread runs every task on its own thread; one with more splits
them over numba's pool, as many ways as it has torch threads. One-thread ranks never
start that pool: it is an OpenMP pool in the same runtime as torch's, and starting it
reset the rank's torch thread count to the machine's core count (four one-thread
ranks on two cores then ran eight threads, and TP2xPP2 fell from 584 to 89 output
tokens/s; `tests/test_models_decode_attention.py` checks the count is kept).

numba is imported and the kernel compiled (or loaded from numba's cache) on first
use; where numba is missing or the kernel cannot be built, `available()` is False
and callers keep SDPA.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from models.numba_kernels import int64_index, load_checked, native_address, pool_size, run_split, uses_pool

__all__ = ["available", "mirror_decode_attention", "prepare", "supports"]

_DTYPES = (torch.float32, torch.bfloat16)
# Each dtype's entry point by address (models/decode_attention_kernels.py).
_ENTRIES = {torch.float32: "attend_float32_at", torch.bfloat16: "attend_bits_at"}


_Kernel = Callable[..., None]


def _check(run: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    # Compiles (or loads from numba's cache) and checks a kernel for keys of `dtype` now, so
    # a broken toolchain fails once, here. One dtype at a time: each is a compile of its own
    # (3-4 s here), and a rank needs one.
    q = torch.randn(2, 2, 2, 8)
    kv = torch.randn(2, 3, 2, 5, 8).to(dtype)
    rows, counts = torch.tensor([2, 0]), torch.tensor([5, 3])
    got = run(q, kv[0], kv[1], rows, counts)
    want = _reference(q, kv[0], kv[1], rows, counts, 0.3)
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        raise RuntimeError(f"the {dtype} kernel differs from SDPA by {(got - want).abs().max().item()}")


@functools.lru_cache(maxsize=None)
def _kernel(dtype: torch.dtype) -> Optional[_Kernel]:
    """The one-thread kernel for keys of `dtype`; None where numba is missing or it fails its check."""
    return load_checked(
        "models.decode_attention_kernels",
        lambda kern: getattr(kern, _ENTRIES[dtype]),
        lambda kernel: _check(lambda *a: _run(kernel, 1, *a, 0.3), dtype),
        f"{dtype} decode attention kernel",
        "decode attention uses SDPA",
    )


@functools.lru_cache(maxsize=None)
def _parallel_kernel(dtype: torch.dtype) -> Optional[int]:
    """For the thread pool: the address of the kernel for keys of `dtype`, built and
    checked on the first call from a rank with several threads (`run_split` runs it).

    None where it cannot run (the one-thread kernel serves then). A rank with one
    thread never builds it, so it never starts numba's pool.
    """
    if _kernel(dtype) is None:
        return None
    like = torch.zeros(1, 1, 1, 8)
    kv = torch.zeros(1, 1, 1, 8, dtype=dtype)
    args, _, _ = _arguments(like, kv, kv, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0.3)
    return load_checked(
        "models.decode_attention_kernels",
        lambda kern: native_address(getattr(kern, _ENTRIES[dtype]), args + (0, 0)),
        lambda address: _check(lambda *a: _run(address, 2, *a, 0.3), dtype),
        f"parallel {dtype} decode attention kernel",
        "decode attention runs on one thread",
    )


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel can run here for keys of `dtype` (imports numba and compiles on the first call)."""
    return dtype in _DTYPES and _kernel(dtype) is not None


def prepare(threads: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> bool:
    """Builds now (compiles, or loads from numba's cache) the kernels a rank with `threads` threads will run.

    Default: this process's torch thread count, and both dtypes (a worker names its own:
    each costs a compile the first time on a machine). Returns whether they can run. A
    worker calls it while loading, so that its first decode step does not pay for it.
    """
    dtypes = _DTYPES if dtype is None else (dtype,)
    if not all(available(d) for d in dtypes):
        return False
    if uses_pool(threads):
        for d in dtypes:
            _parallel_kernel(d)
    return True


def supports(like: torch.Tensor) -> bool:
    """Whether the kernel can attend keys like `like` (CPU, float32 or bfloat16, numba built)."""
    return like.device.type == "cpu" and available(like.dtype)


def _arguments(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, scale: float
) -> tuple[tuple[Any, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kernel's arguments but the task range, the float32 output they write, and the
    tensors whose addresses they hold (keep them alive until the kernel returns).

    Addresses and sizes, whose types are the same for every call (the pool's kernel is
    called by address, compiled for exactly these): k_buf and v_buf must be C-contiguous
    [R, kv_heads, len_cap, head_dim] (the caller checks).
    """
    import numpy as np

    b, heads, groups, dim = q.shape
    q = q.float().contiguous()
    rows, counts = int64_index(rows), int64_index(counts)
    out = torch.empty((b, heads, groups, dim), dtype=torch.float32)
    slots, cap = k_buf.shape[0], k_buf.shape[2]
    args = (
        q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), rows.data_ptr(), counts.data_ptr(), np.float32(scale),
        out.data_ptr(), b, heads, groups, dim, slots, cap,
    )
    return args, out, (q, k_buf, v_buf, rows, counts)


def _run(
    kernel: Union[_Kernel, int],
    parts: int,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Runs every task: `kernel` on this thread (parts == 1), else the address `kernel` as `parts` ranges on numba's pool."""
    # `_held` keeps alive, until this returns, the tensors whose addresses `args` holds.
    args, out, _held = _arguments(q, k_buf, v_buf, rows, counts, scale)
    tasks = q.shape[0] * q.shape[1]
    if parts == 1:
        kernel(*args, 0, tasks)
    else:
        run_split(kernel, parts, tasks, args)
    return out


def _reference(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, scale: float
) -> torch.Tensor:
    length = int(counts.max())
    k, v = k_buf[rows, :, :length].float(), v_buf[rows, :, :length].float()
    mask = (torch.arange(length)[None, :] < counts[:, None])[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)


def mirror_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
) -> Optional[torch.Tensor]:
    """softmax(q k^T * scale) v for each sequence over its first `counts[i]` keys; None where the kernel cannot run.

    q [B, kv_heads, groups, head_dim]: sequence i's query heads, grouped by the kv head
    they share. k_buf, v_buf [R, kv_heads, len_cap, head_dim], contiguous CPU tensors:
    sequence i's keys are k_buf[rows[i], :, :counts[i]]. rows, counts: [B] int64 on CPU,
    1 <= counts[i] <= len_cap. Returns [B, kv_heads, groups, head_dim] in q's dtype (None, too,
    for a query that requires grad: the kernel has no backward).
    """
    if not supports(k_buf) or q.requires_grad or not q.is_cpu:
        return None  # no backward here; the kernel reads CPU memory
    if not (
        k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape
        and v_buf.dtype == k_buf.dtype and v_buf.is_cpu
    ):
        return None
    if (
        q.dim() != 4
        or k_buf.dim() != 4
        or q.shape[1] != k_buf.shape[1]
        or q.shape[3] != k_buf.shape[3]
        or rows.dim() != 1
        or q.shape[0] != rows.shape[0]
        or counts.shape != rows.shape
    ):
        raise ValueError(
            f"decode attention: queries {tuple(q.shape)} do not match keys {tuple(k_buf.shape)} and {rows.shape[0]} rows"
        )
    # The rank's torch thread count is its share of cores; the kernel uses as many.
    parts = min(torch.get_num_threads(), pool_size())
    pool = _parallel_kernel(k_buf.dtype) if parts > 1 else None
    kernel = pool if pool is not None else _kernel(k_buf.dtype)
    assert kernel is not None  # supports() built it
    return _run(kernel, parts if pool is not None else 1, q, k_buf, v_buf, rows, counts, scale).to(q.dtype)
