"""Greedy token choice: the index of each row's largest logit, exactly as `torch.max(dim=-1)` picks it.

`torch.max(dim=-1)` on CPU does not vectorise the search for the index: over a decode
step's [64, 32000] bfloat16 logits it took 1.7 ms on one Zen 4 core, about a twentieth
of the whole step. `row_argmax` runs a numba kernel (models/argmax_kernels.py) that
compares the values' bits as integers, which LLVM does vectorise (0.23 ms there), and
falls back to `torch.max` wherever the kernel cannot run (no numba, a GPU tensor, another
dtype). Same answer either way: the first index of the row's max; NaN, where a row has
one, wins at its first position.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from models.numba_kernels import load_checked

__all__ = ["prepare", "row_argmax"]

_Kernel = Callable[..., None]

# The integer type whose bits each float type's kernel reads.
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _check_rows(dtype: torch.dtype) -> torch.Tensor:
    # Random rows plus the cases the kernel must resolve as torch does.
    x = torch.randn(8, 1100, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 5], x[0, 7] = float("nan"), float("nan")  # first NaN wins
    x[1] = -0.0  # -0.0 and +0.0 are equal: the first one wins
    x[1, 3] = 0.0
    x[2] = float("-inf")
    x[3, 10], x[3, 600] = float("inf"), float("inf")
    x[4] = -x[4].abs()
    x[4, 700] = float("nan")  # after the first block
    x[5, 1099] = 100.0  # last position, short last block
    x[6, 513], x[6, 900] = 50.0, 50.0  # tie across blocks
    return x


@functools.lru_cache(maxsize=1)
def _kernels() -> Optional[dict[torch.dtype, _Kernel]]:
    """The kernels by dtype, built (or loaded from numba's cache) and checked on the first call; None if unusable."""
    return load_checked(
        "models.argmax_kernels",
        lambda kern: {torch.bfloat16: kern.argmax_bfloat16, torch.float32: kern.argmax_float32},
        _check,
        "argmax kernel",
        "greedy argmax uses torch.max",
    )


def _check(kernels: dict[torch.dtype, _Kernel]) -> None:
    for dtype, kernel in kernels.items():
        x = _check_rows(dtype)
        got, want = _run(kernel, x), x.max(dim=-1).indices
        if not torch.equal(got, want):
            raise RuntimeError(f"the {dtype} kernel chose {got.tolist()}, torch.max {want.tolist()}")


def prepare() -> bool:
    """Builds the kernels now (a worker calls it while loading); returns whether they can run."""
    return _kernels() is not None


def _run(kernel: _Kernel, logits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.view(_BITS[logits.dtype]).numpy(), out.numpy())
    return out


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Token ids [N] (int64, on logits' device): the first index of each row's max of logits [N, V]."""
    if (
        logits.dim() == 2
        and logits.device.type == "cpu"
        and logits.dtype in _BITS
        and logits.shape[0] > 0
        and logits.shape[1] > 0
        and not logits.requires_grad
    ):
        kernels = _kernels()
        if kernels is not None:
            return _run(kernels[logits.dtype], logits.contiguous())
    return logits.max(dim=-1).indices
