"""A layer's new keys and values into the paged cache and the KV mirror in one numba call.

Every layer of every step stores its tokens' keys and values at their cache slots
and, for the decode rows, at their positions in the mirror (models/kv_mirror.py).
In torch that is four indexing ops (two `index_copy_`, two `index_put_`), each with
its dispatch and checks, for a few KB of data: on one core of this project's AMD
machine about 100 us a layer of a 32-row decode step, 0.8 ms of a 25 ms whole-model
step, most of it paid per step rather than per row. One call does the same copies.

The result is torch's bit for bit (a copy). Shapes and indices are checked before
anything is written, as torch's ops check theirs. The cache's and the mirror's
arrays are viewed for the kernel once (`bits`), not on every call, and the step's
keys, values and indices go to it by address: converting a tensor costs about 1.5-2.7
us, as much as the copy of a 32-row step's keys (`tools/bench_calls.py`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
import torch

from models.numba_kernels import int64_index, load_checked

__all__ = ["bits", "prepare", "supports", "write_kv"]

_Kernel = Callable[..., None]

# Values are copied as their bits: the integer type of each element size.
_BITS = {2: torch.int16, 4: torch.int32}
# The float type each element size's kernel is checked with.
_CHECKED_AS = {2: torch.bfloat16, 4: torch.float32}
# Each element size's entry point by address (models/kv_write_kernels.py).
_ENTRIES = {2: "write_kv_int16_at", 4: "write_kv_int32_at"}

_NO_INDEX = torch.empty(0, dtype=torch.int64)


def supports(t: torch.Tensor) -> bool:
    """Whether the kernel can write into this cache tensor: CPU, contiguous, a 2- or 4-byte dtype."""
    return t.is_cpu and t.is_contiguous() and t.is_floating_point() and t.element_size() in _BITS


def bits(t: torch.Tensor) -> np.ndarray:
    """t's memory as an integer array of its element size (t must pass `supports`): what the kernel reads and writes."""
    return t.detach().view(_BITS[t.element_size()]).numpy()


def _empty_mirror(k: np.ndarray) -> np.ndarray:
    return np.empty((0, k.shape[1], 0, k.shape[2]), dtype=k.dtype)


def _check(dtype: torch.dtype, kernel: _Kernel) -> None:
    # Builds (or loads from numba's cache) and checks the kernel for dtype's element size
    # now, so a broken toolchain fails once, here.
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 5, 3, 4, generator=g).to(dtype)
    paged_k, paged_v = torch.zeros(2, 8, 3, 4, dtype=dtype)  # flat slots [S, H, D]
    mirror_k, mirror_v = torch.zeros(2, 3, 3, 6, 4, dtype=dtype)  # [R, H, L, D]
    slots = torch.tensor([7, 0, 3, 4, 1])
    take, rows, positions = torch.tensor([4, 1]), torch.tensor([2, 0]), torch.tensor([5, 0])
    kernel(
        k.data_ptr(), v.data_ptr(), 5, slots.data_ptr(), bits(paged_k), bits(paged_v),
        take.data_ptr(), rows.data_ptr(), positions.data_ptr(), 2, bits(mirror_k), bits(mirror_v),
    )
    want_k, want_v = torch.zeros_like(paged_k), torch.zeros_like(paged_v)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    want_mk, want_mv = torch.zeros_like(mirror_k), torch.zeros_like(mirror_v)
    want_mk.permute(0, 2, 1, 3).index_put_((rows, positions), k[take])
    want_mv.permute(0, 2, 1, 3).index_put_((rows, positions), v[take])
    for got, want in ((paged_k, want_k), (paged_v, want_v), (mirror_k, want_mk), (mirror_v, want_mv)):
        if not torch.equal(got, want):
            raise RuntimeError(f"the {dtype} KV write kernel differs from torch's index_copy_ / index_put_")


@functools.lru_cache(maxsize=None)
def _kernel(size: int) -> Optional[_Kernel]:
    """The kernel for elements of `size` bytes, built (or loaded from numba's cache) and checked
    on the first call; None if unusable. Each size compiles on its own: a rank builds its cache's."""
    return load_checked(
        "models.kv_write_kernels",
        lambda kern: getattr(kern, _ENTRIES[size]),
        functools.partial(_check, _CHECKED_AS[size]),
        f"the {8 * size}-bit KV write kernel",
        "keys and values are stored with torch's indexing ops",
    )


def prepare(dtype: Optional[torch.dtype] = None) -> bool:
    """Builds the kernel for a cache of `dtype` (default: every element size it serves) now
    (a worker calls it while loading); returns whether it can run."""
    sizes = [dtype.itemsize] if dtype is not None else list(_BITS)
    return all(size in _BITS and _kernel(size) is not None for size in sizes)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    paged: tuple[np.ndarray, np.ndarray],
    mirror: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]] = None,
) -> bool:
    """Stores k, v [T, H, D] at flat slots [T] of `paged` (the `bits` of the keys' and values'
    blocks viewed as [slots, H, D]), and, with `mirror` = (take [B], rows [B], positions [B],
    mirror keys, mirror values) (the last two `bits` of [R, H, L, D] buffers), each decode row
    k[take[i]] at position positions[i] of mirror row rows[i] (likewise v).

    Returns False, having written nothing, where the kernel cannot run (not built, or k
    and v not contiguous CPU tensors of the cache's element size, or in an autograd graph).
    Raises ValueError on mismatched shapes and IndexError on an index out of range, having
    written nothing.
    """
    paged_k, paged_v = paged
    size = k.element_size()
    kernel = _kernel(size) if size in _BITS else None
    if (
        kernel is None
        or k.requires_grad
        or v.requires_grad
        or k.dtype != v.dtype
        or k.dim() != 3
        or not (k.is_contiguous() and v.is_contiguous() and k.is_cpu and v.is_cpu)
        or size != paged_k.itemsize
        or not k.is_floating_point()
    ):
        return False
    # The kernel sees k, v and the indices through their addresses: their shapes are checked
    # here (as the kernel checks the arrays'), the indices' values by the kernel.
    n = k.shape[0]
    if v.shape != k.shape or slots.shape != (n,) or paged_k.shape != paged_v.shape:
        raise ValueError("keys, values and slots disagree in shape")
    if k.shape[1:] != paged_k.shape[1:]:
        raise ValueError("keys do not fit the KV cache's heads or head size")
    slots = int64_index(slots)
    if mirror is None:
        take = rows = positions = _NO_INDEX
        mirror_k = mirror_v = _empty_mirror(paged_k)
    else:
        take, rows, positions, mirror_k, mirror_v = mirror
        if mirror_k.itemsize != size or mirror_v.itemsize != size:
            return False
        take, rows, positions = int64_index(take), int64_index(rows), int64_index(positions)
        if not take.shape == rows.shape == positions.shape:
            raise ValueError("decode rows, mirror rows and positions disagree in length")
    kernel(
        k.data_ptr(), v.data_ptr(), n, slots.data_ptr(), paged_k, paged_v,
        take.data_ptr(), rows.data_ptr(), positions.data_ptr(), take.shape[0], mirror_k, mirror_v,
    )
    return True
