"""Each layer's q/k/v projections as one linear, and its gate/up projections as another.

A decode step multiplies a few dozen rows by each weight, where a matmul call's
fixed cost is a good part of the arithmetic: on one core of this project's
machine (bf16, 32 rows, the default model's shapes) q, k and v take 195 us as
three calls and 166 us as one, gate and up 458 us as two calls and 428 us as one.
The fused output is also rotated once for the queries and keys together.

`fuse_projections` runs after the weights are loaded (and sharded: a rank's
column-parallel q/k/v shards sit side by side in its fused weight, just as its own
heads do), before `models.prepack`. The fused stage holds each weight once.
"""

from __future__ import annotations

import torch
from torch import nn

from models.llama import Attention, FeedForward

__all__ = ["fuse_projections"]


def _fused(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=parts[0].weight.requires_grad)
    return fused


def fuse_projections(stage: nn.Module) -> int:
    """Fuses, in place, every attention's q/k/v and every MLP's gate/up linears of `stage`; returns how many modules.

    A module whose projections are not plain bias-free `nn.Linear`s (already packed or
    fused, or biased) is left as it is.
    """
    count = 0
    for module in stage.modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            parts = [module.q_proj, module.k_proj, module.v_proj]
            if all(type(p) is nn.Linear and p.bias is None and not p._forward_hooks for p in parts):
                module.qkv_proj = _fused(parts)
                del module.q_proj, module.k_proj, module.v_proj
                count += 1
        elif isinstance(module, FeedForward) and module.gate_up_proj is None:
            parts = [module.gate_proj, module.up_proj]
            if all(type(p) is nn.Linear and p.bias is None and not p._forward_hooks for p in parts):
                module.gate_up_proj = _fused(parts)
                del module.gate_proj, module.up_proj
                count += 1
    return count
