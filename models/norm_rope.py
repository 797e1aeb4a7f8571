"""RMSNorm and rotary embeddings on CPU in one numba pass each, with torch's arithmetic.

Every decoder layer runs two RMSNorms and rotates its queries and keys. In torch each
is a handful of ops over small tensors: the norm five, the rotation of one tensor six
(a slice, a negation, a cat, two multiplies, an add), each with its own dispatch and
temporary. On one Zen 4 core, bfloat16, per call (`tools/bench_norm_rope.py --ops`): a
32-row norm 26 -> 15 us and the rotation of a 32-row step's queries and keys 45 -> 24 us;
at 512 rows 212 -> 115 and 397 -> 171 us. The kernels take addresses rather than numpy
arrays, as the GEMM kernel does (models/bf16_gemm.py): on the faster host of 2026-12-08 that
took a 32-row norm from 11.1 to 8.2 us and the rotation from 14.1 to 9.8 (torch's: 20-22
and 37-38); in a 32-row decode step of the whole model (`tools/bench_step.py --parts`, two
runs each way) the norms went from 0.33-0.37 to 0.24-0.30 ms and the rotations from
0.27-0.29 to 0.22-0.25.

Same numbers as torch: the rotation rounds where torch's ops round, so its output is
torch's bit for bit (checked when the kernels are built); the norm computes in float32
as transformers' LlamaRMSNorm does (mean of squares, rsqrt, rounding to the input's
dtype before the weight), but sums the squares in another order, which can move its
scale by an ulp (float32) and so, rarely, round an output to the neighbouring bfloat16.
(`models.llama.RMSNorm`'s own torch path, used without the kernel, rounds differently
again: it squares a `vector_norm`.)

`rms_norm` and `rotate_` return None wherever a kernel cannot run (no numba, a build
that failed its check, a GPU tensor, another dtype or shape, autograd) or the process
has turned them off (`set_enabled(False)`: a worker's `norm_rope_kernels=False`): the
caller then keeps torch's ops.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from models.numba_kernels import load_checked

__all__ = ["enabled", "prepare", "rms_norm", "rotate_", "set_enabled"]

_Kernel = Callable[..., None]

# The type whose values each float type's kernels read: bfloat16 as its int16 bits.
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.float32}

# Process-wide: a worker process is one rank, and the modules that call the kernels
# (models.llama) hold no options of their own.
_enabled = True


def set_enabled(on: bool) -> None:
    """Use the kernels where they can run (True, the default) or always torch's ops (False), in this process."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """Whether this process uses the kernels where they can run."""
    return _enabled


def _check(dtype: torch.dtype, kernels: tuple[_Kernel, _Kernel]) -> None:
    # Builds (or loads from numba's cache) and checks each kernel now, so a broken toolchain fails once, here.
    # The ops the kernels replace (models.llama imports this module, so not at its top).
    from models.llama import apply_rotary, rms_norm_reference

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 16, generator=g) * 4).to(dtype)
    x[0, 0, 0], x[1, 1, 9] = float("nan"), float("inf")
    angles = torch.randn(5, 8, generator=g) * 3
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    want = apply_rotary(x, cos, sin)
    got = _run_rotary(kernels[1], x.clone(), cos, sin)
    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.nan_to_num(), want.nan_to_num()):
        raise RuntimeError(f"the {dtype} rotary kernel differs from torch by {(got - want).abs().nan_to_num().max().item()}")
    rows = (torch.randn(7, 48, generator=g) * 3).to(dtype)
    weight = (torch.rand(48, generator=g) + 0.5).to(dtype)
    want = rms_norm_reference(rows, weight, 1e-5)
    got = _run_norm(kernels[0], rows, weight, 1e-5)
    if not torch.allclose(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0):
        raise RuntimeError(f"the {dtype} norm kernel differs from torch by {(got.float() - want.float()).abs().max().item()}")


@functools.lru_cache(maxsize=None)
def _kernels(dtype: torch.dtype) -> Optional[tuple[_Kernel, _Kernel]]:
    """The (norm, rotary) kernels for `dtype`, built (or loaded from numba's cache) and checked on the first call; None if unusable.

    One source per op; each dtype is compiled on its own first call (in _check), so a
    rank builds its own dtype's only.
    """
    bits = dtype == torch.bfloat16
    return load_checked(
        "models.norm_rope_kernels",
        lambda kern: (
            (kern.rms_norm_bits_at, kern.rotary_bits_at) if bits else (kern.rms_norm_float32_at, kern.rotary_float32_at)
        ),
        functools.partial(_check, dtype),
        f"{dtype} norm and rotary kernels",
        "RMSNorm and rotary embeddings use torch's ops",
    )


def prepare(dtype: Optional[torch.dtype] = None) -> bool:
    """Builds the kernels for `dtype` (default: every dtype they serve) now (a worker calls it
    while loading); returns whether they can run."""
    return all(_kernels(d) is not None for d in ([dtype] if dtype is not None else _BITS))


# The kernels take addresses (see models/norm_rope_kernels.py): the callers below check
# that every tensor is a contiguous CPU tensor of the kernel's dtype and shape first.


def _run_norm(kernel: _Kernel, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(eps))
    return out


def _run_rotary(kernel: _Kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    kernel(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, dim)
    return x


def _plain(*xs: torch.Tensor) -> bool:
    """CPU tensors of one kernel dtype, contiguous, with autograd off (no graph to keep), kernels on."""
    dtype = xs[0].dtype
    return (
        _enabled
        and dtype in _BITS
        and not torch.is_grad_enabled()
        and all(x.is_cpu and x.dtype == dtype and x.is_contiguous() for x in xs)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """weight * norm(x) [T, D] as `models.llama.RMSNorm` computes it, or None where the kernel cannot run."""
    if x.dim() != 2 or weight.shape != x.shape[1:] or x.shape[0] == 0 or not _plain(x, weight):
        return None
    kernels = _kernels(x.dtype)
    if kernels is None:
        return None
    return _run_norm(kernels[0], x, weight, eps)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """Rotates x [T, heads, head_dim] in place by cos and sin [T, head_dim] (rotate-half layout) and returns it.

    The same bits as `models.llama.apply_rotary`; None, with x untouched, where the kernel cannot run.
    """
    if (
        x.dim() != 3
        or cos.shape != (x.shape[0], x.shape[2])
        or sin.shape != cos.shape
        or x.shape[2] % 2
        or x.numel() == 0
        or not _plain(x, cos, sin)
    ):
        return None
    kernels = _kernels(x.dtype)
    if kernels is None:
        return None
    return _run_rotary(kernels[1], x, cos, sin)
