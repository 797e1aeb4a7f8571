"""Causal attention of bfloat16 prompt chunks on CPU through the AVX512-BF16 GEMM micro-kernel.

A prompt step attends each chunk to its sequence's keys causally: to itself where the
chunk is the whole context, else to the cached prefix and itself.
`F.scaled_dot_product_attention` ran a 128-token chunk at about 0.62 ms per layer of the
default model on one Zen 4 core (its flash kernel over small blocks; about 54 GFLOP/s),
14% of a 512-token prompt step. Here both products go
through the micro-kernel of models/bf16_gemm_kernels.py (scores in float32, only the
key panels a block of rows can see), with a float32 softmax between them and the
probabilities rounded to bfloat16 for the product with the values, as SDPA's CPU
kernel rounds them for bfloat16 inputs (models/prompt_attention_kernels.py).

It needs bfloat16, a head_dim that is a multiple of 32, numba and a CPU with
avx512_bf16; elsewhere, or with the switch off (`set_enabled(False)`: a worker's
`prompt_attention_kernel=False`), `attend_prompts` returns False and the caller keeps
SDPA. A rank with one thread runs every chunk on it; one with more splits the chunks
over numba's pool, as decode attention does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Union

import torch

from models import bf16_gemm
from models.numba_kernels import load_checked, native_address, pool_size, run_split, uses_pool

__all__ = ["attend_prompts", "enabled", "fits", "prepare", "set_enabled", "supports"]

logger = logging.getLogger(__name__)

_Kernel = Callable[..., None]

_enabled = True


def set_enabled(on: bool) -> None:
    """Run whole-context bf16 prompt chunks through the kernel (True, the default) or through SDPA (False). Process-wide."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], stops: list[int], scale: float,
    key_starts: Optional[list[int]] = None, key_counts: Optional[list[int]] = None,
) -> torch.Tensor:
    """What the kernel computes (see `attend_prompts`), through SDPA in float32: [T, H, D]."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    key_starts = starts if key_starts is None else key_starts
    key_counts = [e - s for s, e in zip(starts, stops)] if key_counts is None else key_counts
    for s, e, ks_, n in zip(starts, stops, key_starts, key_counts):
        qs = q[s:e].float().transpose(0, 1)[None]
        ks, vs = (t[ks_ : ks_ + n].float().transpose(0, 1)[None] for t in (k, v))
        # Query i sees the keys before the chunk and the chunk's first i + 1.
        mask = torch.arange(n)[None, :] <= torch.arange(e - s)[:, None] + (n - (e - s))
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def _check(run: Callable[..., None]) -> None:
    # Builds (or loads from numba's cache) and checks a kernel now, so a broken toolchain fails once, here.
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, lengths in ((4, 2, 32, (1, 5, 33)), (2, 2, 64, (70, 2))):
        total = sum(lengths)
        q = torch.randn(total, heads, dim, generator=g).bfloat16()
        k = torch.randn(total, kv_heads, dim, generator=g).bfloat16()
        v = torch.randn(total, kv_heads, dim, generator=g).bfloat16()
        stops = torch.tensor(lengths).cumsum(0)
        starts = stops - torch.tensor(lengths)
        out = torch.full_like(q, float("nan"))
        run(q, k, v, out, starts, stops, starts, stops - starts, 0.3)
        want = _reference(q, k, v, starts.tolist(), stops.tolist(), 0.3)
        # bf16 probabilities and a bf16 result: within a few bf16 ulps of the float32 attention.
        if not torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2):
            worst = (out.float() - want).abs().max().item()
            raise RuntimeError(f"the prompt attention kernel differs from SDPA by {worst} (heads {heads}/{kv_heads}, dim {dim})")


def _as_bits(t: torch.Tensor) -> Any:
    return t.view(torch.int16).numpy()


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
               stops: torch.Tensor, key_starts: torch.Tensor, key_counts: torch.Tensor, scale: float) -> tuple[Any, ...]:
    """The kernel's arguments but the chunk range. Their types are always the same (the
    pool's kernel is called by address, compiled for exactly these): q, k, v and out must
    be C-contiguous bfloat16, the four indexes contiguous int64."""
    import numpy as np

    return (
        _as_bits(q), _as_bits(k), _as_bits(v), _as_bits(out),
        starts.numpy(), stops.numpy(), key_starts.numpy(), key_counts.numpy(), np.float32(scale),
    )


def _call(kernel: Union[_Kernel, int], parts: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          out: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor, key_starts: torch.Tensor,
          key_counts: torch.Tensor, scale: float) -> None:
    """Every chunk: `kernel` on this thread (parts == 1), else the address `kernel` as `parts` ranges on numba's pool."""
    args = _arguments(q, k, v, out, starts, stops, key_starts, key_counts, scale)
    if parts == 1:
        kernel(*args, 0, starts.shape[0])
    else:
        run_split(kernel, parts, starts.shape[0], args)


@functools.lru_cache(maxsize=1)
def _kernel() -> Optional[_Kernel]:
    """The one-thread kernel; None where numba, the instruction or its check is missing."""
    if not bf16_gemm.cpu_supported():
        logger.info("this CPU has no avx512_bf16: prompt attention uses SDPA")
        return None  # LLVM cannot build the micro-kernel here
    return load_checked(
        "models.prompt_attention_kernels",
        lambda kern: kern.attend_chunks,
        lambda kernel: _check(lambda *a: _call(kernel, 1, *a)),
        "the prompt attention kernel",
        "prompt attention uses SDPA",
    )


@functools.lru_cache(maxsize=1)
def _parallel_kernel() -> Optional[int]:
    """For the thread pool: the kernel's address, built and checked on the first call from
    a rank with several threads (`run_split` runs it; None: one thread serves)."""
    if _kernel() is None:
        return None
    one = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    index = torch.zeros(1, dtype=torch.int64)
    args = _arguments(one, one, one, one, index, index, index, index, 0.3)
    return load_checked(
        "models.prompt_attention_kernels",
        lambda kern: native_address(kern.attend_chunks, args + (0, 0)),
        lambda address: _check(lambda *a: _call(address, 2, *a)),
        "the parallel prompt attention kernel",
        "prompt attention runs on one thread",
    )


def prepare(threads: Optional[int] = None) -> bool:
    """Builds the kernels a rank with `threads` threads runs (a worker calls it while loading); whether they can run."""
    if _kernel() is None:
        return False
    if uses_pool(threads):
        _parallel_kernel()
    return True


def fits(head_dim: int) -> bool:
    """Whether heads of this size can take the kernel (whole panels of 32 values)."""
    return head_dim > 0 and head_dim % bf16_gemm.PANEL == 0


def supports(q: torch.Tensor) -> bool:
    """Whether chunks with queries like q [T, H, D] can take the kernel here."""
    return (
        _enabled
        and q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.dim() == 3
        and fits(q.shape[2])
        and not torch.is_grad_enabled()
        and _kernel() is not None
    )


def attend_prompts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: list[int], stops: list[int],
    scale: float, key_starts: Optional[list[int]] = None, key_counts: Optional[list[int]] = None,
) -> bool:
    """Causal attention of each chunk's queries over its keys, into out; False where the kernel cannot run.

    q, out [T, H, D] and k, v [L, KV, D]: contiguous CPU bfloat16 tensors (H a multiple of
    KV). Chunk i's queries are rows starts[i]:stops[i] of q, and its result goes to the
    same rows of out. Its keys and values are rows key_starts[i]:key_starts[i] +
    key_counts[i] of k and v (default: the chunk's own rows, the chunk being its whole
    context), at least as many as its queries: the last query sees them all, each
    earlier one a key fewer (a cached prefix, then the chunk). Nothing is written when it
    returns False.
    """
    if not (starts and supports(q)):
        return False
    if not all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in (q, k, v, out)):
        return False
    if key_starts is None or key_counts is None:
        key_starts, key_counts = starts, [e - s for s, e in zip(starts, stops)]
    if k.shape != v.shape or out.shape != q.shape or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"prompt attention: queries {tuple(q.shape)} do not match keys {tuple(k.shape)}, values {tuple(v.shape)}")
    for s, e, ks, n in zip(starts, stops, key_starts, key_counts):
        if not (0 <= s < e <= q.shape[0] and 0 <= ks and e - s <= n and ks + n <= k.shape[0]):
            raise ValueError(
                f"prompt attention: a chunk of query rows [{s}, {e}) over key rows [{ks}, {ks + n}) does not fit "
                f"{q.shape[0]} queries and {k.shape[0]} keys (keys must be at least as many as queries)"
            )
    parts = min(torch.get_num_threads(), pool_size(), len(starts))
    pool = _parallel_kernel() if parts > 1 else None
    kernel = pool if pool is not None else _kernel()
    assert kernel is not None
    as_index = functools.partial(torch.tensor, dtype=torch.int64)
    _call(kernel, parts if pool is not None else 1, q, k, v, out,
          as_index(starts), as_index(stops), as_index(key_starts), as_index(key_counts), scale)
    return True
