"""Linear weights reordered once for oneDNN's CPU matmul instead of on every call.

`F.linear` on CPU hands a plain [out, in] weight to a GEMM that reorders it for
its kernel on every call. Over a decode step's few dozen rows that costs about as
much as the arithmetic: on one thread of this project's machine (float32,
`tools/bench_matmul.py --packed --shape 32 512 N`), the MLP's gate projection
(N = 1408) runs at 93 GFLOP/s with a plain weight and 124-125 with a packed one,
the LM head (N = 32000) at 76 and 94; at 512 rows the two are within a few percent.
The packed tensor replaces the plain weight, so a rank holds one copy.

A bfloat16 weight, where this CPU has avx512_bf16, is laid out for our own kernel
instead (models/bf16_gemm.py), on one thread or several: faster than oneDNN's over a
decode step's rows, level with it or a little faster over a prompt step's, and cheaper
per call.

Only CPU tensors in float32 or bfloat16 are packed, and only where this torch
build has oneDNN's ops (`torch.ops.mkldnn._reorder_linear_weight`); elsewhere
(GPU, another dtype, an old or stripped build) `prepack_stage` leaves the
`nn.Linear` modules as they are.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from models import bf16_gemm

__all__ = ["PackedLinear", "PackedWeight", "prepack_stage", "prepack_supported"]

logger = logging.getLogger(__name__)

# The row count the layout is chosen for; any row count runs on it (decode batches
# of a few dozen rows are where packing pays).
_ROWS_HINT = 64
_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _ops_work(dtype: torch.dtype) -> bool:
    # A build without oneDNN, or one whose private ops changed, keeps F.linear.
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.arange(12, dtype=torch.float32).view(3, 4).to(dtype)
        x = torch.ones(2, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out.float(), torch.nn.functional.linear(x, w).float()))
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        logger.debug("oneDNN weight packing unavailable for %s: %s", dtype, exc)
        return False


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device can be packed here."""
    return torch.device(device).type == "cpu" and dtype in _DTYPES and _ops_work(dtype)


class PackedWeight:
    """A [out, in] weight held in oneDNN's blocked layout; `linear(x)` equals `F.linear(x, weight, bias)`.

    `x` is [..., in] of the weight's dtype; the result is [..., out].
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a packed weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        # bfloat16: our kernel (models/bf16_gemm.py) where it can run, chosen once, here.
        self.own_kernel = bf16_gemm.supports(weight)
        if self.own_kernel:
            self.packed = bf16_gemm.pack(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            out = bf16_gemm.linear(x, self.packed)  # checks x itself, with the same message
            return out if self.bias is None else out.add_(self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the packed weight takes {self.in_features}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedLinear(nn.Module):
    """Drop-in for a bias-free or biased `nn.Linear` whose weight is a `PackedWeight`.

    Forward hooks of the module it replaces come along (a row-parallel linear's
    all-reduce is one).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_packed = PackedWeight(linear.weight, linear.bias)
        self._forward_hooks.update(linear._forward_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_packed.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def prepack_stage(stage: nn.Module) -> int:
    """Replaces, in place, every `nn.Linear` of `stage` by a `PackedLinear` and packs modules that offer `prepack()`.

    Returns how many weights were packed; 0 where packing is not supported. A weight
    that shares its storage with another parameter (an LM head tied to the embedding)
    is left alone: packing it would hold a second copy.
    """
    first = next(stage.parameters(), None)
    if first is None or not prepack_supported(first.dtype, first.device):
        return 0
    del first  # hold no reference: each plain weight is freed as soon as its module is replaced
    owners: dict[int, int] = {}  # storage -> how many modules hold it
    for module in stage.modules():
        for ptr in {p.data_ptr() for p in module.parameters(recurse=False)}:
            owners[ptr] = owners.get(ptr, 0) + 1

    def alone(weight: Optional[torch.Tensor]) -> bool:
        return weight is not None and owners.get(weight.data_ptr(), 0) == 1

    count = 0
    # Parents only: a list holding the linears themselves would keep every plain weight alive.
    for parent in [m for m in stage.modules() if not isinstance(m, nn.Linear)]:
        for name in [n for n, c in parent.named_children() if isinstance(c, nn.Linear)]:
            child = getattr(parent, name)
            if alone(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
            del child
        prepack = getattr(parent, "prepack", None)
        if callable(prepack) and alone(getattr(parent, "weight", None)) and prepack():
            count += 1
    return count
