"""Tensor parallelism as a transform over a `LlamaStage` built on the meta device.

`shard_stage` replaces each linear with its shard for this rank and records, per
parameter, which slice of the checkpoint tensor it holds (a `ShardSpec`, used by
the loader):

- column-parallel (rows of the weight split): q/k/v and gate/up. Each rank computes
  its own heads / its own part of the intermediate dimension; no communication.
- row-parallel (columns split): o and down. Each rank's output is a partial sum;
  one all-reduce per layer makes it whole.
- vocab-parallel embedding: each rank holds ceil(vocab / tp) rows (the last padded);
  ids outside the shard embed to zero and an all-reduce sums the shards.
- vocab-parallel LM head: each rank computes logits for its rows; they are gathered
  on tp rank 0, the only rank that samples, and the padding columns dropped. When
  every row of a step is greedy, each rank sends only its best (logit, id) per row.

When tp_size > num_key_value_heads, each rank's k/v shard is the one kv head its
query heads use (replicated on tp_size / num_key_value_heads ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.argmax import row_argmax
from models.config import Layout
from models.llama import LlamaStage
from models.prepack import PackedWeight, prepack_supported
from models.shm_allreduce import ShmAllReduce

__all__ = ["ShardSpec", "TPGroup", "VocabParallelEmbedding", "VocabParallelLMHead", "shard_stage"]


@dataclass(frozen=True)
class ShardSpec:
    """A parameter holds checkpoint rows/columns [start, stop) along `dim`; the rest of it (padding) is zero."""

    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]


class TPGroup:
    """This rank's tensor-parallel process group and the two collectives the model needs.

    `shm` (a `models.shm_allreduce.ShmAllReduce`, when every rank of the group maps
    one shared buffer: same host, CPU) carries the all-reduces instead of the group.
    """

    def __init__(
        self, rank: int, size: int, group: Optional[dist.ProcessGroup], shm: Optional[ShmAllReduce] = None
    ) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.shm = shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The concatenation of every rank's x along dim on tp rank 0; x itself elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else x


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, stop) of the vocabulary; other ids embed to zero before the all-reduce."""

    def __init__(self, shard_rows: int, dim: int, start: int, stop: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard_rows, dim))
        self.start, self.stop, self.tp = start, stop, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        out = F.embedding(local, self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows [start, stop), gathered to full-vocabulary logits on tp rank 0.

    Other ranks get back their own shard, which they do not use. `argmax` is the
    greedy shortcut: only each rank's best (logit, id) per row travels.
    """

    def __init__(self, dim: int, shard_rows: int, vocab_size: int, tp: TPGroup, start: int, stop: int) -> None:
        super().__init__()
        self.weight: Optional[nn.Parameter] = nn.Parameter(torch.empty(shard_rows, dim))
        self.vocab_size, self.tp = vocab_size, tp
        self.start, self.stop = start, stop
        self.shard_rows = shard_rows
        self.packed: Optional[PackedWeight] = None  # set by prepack(), which drops `weight`

    def prepack(self) -> bool:
        """Packs the shard's real rows for oneDNN (models/prepack.py) and frees the plain weight; False if unsupported."""
        if self.packed is not None or self.weight is None:
            return False
        if not prepack_supported(self.weight.dtype, self.weight.device):
            return False
        self.packed = PackedWeight(self.weight[: self.stop - self.start])
        self.register_parameter("weight", None)
        return True

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        # Logits of the shard's real vocabulary rows [N, stop - start].
        if self.packed is not None:
            return self.packed.linear(h)
        assert self.weight is not None
        return F.linear(h, self.weight[: self.stop - self.start])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self._local_logits(h)
        pad = self.shard_rows - local.shape[-1]
        if pad:
            # Every shard sends the same width; the last shard's padding rows give logit 0.
            local = F.pad(local, (0, pad))
        logits = self.tp.gather_to_first(local)
        return logits[:, : self.vocab_size] if self.tp.rank == 0 else logits

    def argmax(self, h: torch.Tensor) -> Optional[torch.Tensor]:
        """Token ids [N] of the largest logit of each row of h on tp rank 0 (None elsewhere).

        Ties and NaNs resolve as a full-vocabulary `max(dim=-1)` would: the first
        index wins, so the lowest-ranked shard holding the best value.
        """
        # The padding rows of the last shard would give logit 0: leave them out.
        # In the logits' own dtype: a bf16 -> float32 copy first costs more than the search itself.
        local = self._local_logits(h)
        index = row_argmax(local)
        values = local.gather(1, index[:, None])[:, 0]
        # float64 carries both the float32 logit and the token id exactly.
        pairs = torch.stack((values.double(), (index + self.start).double()))  # [2, N]
        gathered = self.tp.gather_to_first(pairs, dim=0)
        if self.tp.rank != 0:
            return None
        per_rank = gathered.view(self.tp.size, 2, -1)
        best = per_rank[:, 0].max(dim=0).indices  # [N]: which rank's candidate
        return per_rank[:, 1].gather(0, best[None])[0].long()


def _linear(weight_shape: tuple[int, int], like: nn.Linear) -> nn.Linear:
    out_features, in_features = weight_shape
    return nn.Linear(in_features, out_features, bias=False, device=like.weight.device, dtype=like.weight.dtype)


def shard_stage(stage: LlamaStage, layout: Layout, tp: TPGroup) -> dict[str, ShardSpec]:
    """Shards `stage` in place for `layout.tp` of `layout.tp_size`; returns the ShardSpec of each sharded parameter."""
    args = layout.args
    hd, d = args.head_dim, args.hidden_size
    q_lo, q_hi = layout.q_heads
    kv_lo, kv_hi = layout.kv_heads
    i_lo, i_hi = layout.intermediate
    specs: dict[str, ShardSpec] = {}

    def column(module: nn.Module, name: str, prefix: str, start: int, stop: int) -> None:
        full: nn.Linear = getattr(module, name)
        setattr(module, name, _linear((stop - start, full.in_features), full))
        specs[f"{prefix}.{name}.weight"] = ShardSpec(0, start, stop, tuple(full.weight.shape))

    def row(module: nn.Module, name: str, prefix: str, start: int, stop: int) -> None:
        full: nn.Linear = getattr(module, name)
        shard = _linear((full.out_features, stop - start), full)
        shard.register_forward_hook(lambda _m, _inputs, out: tp.all_reduce(out))
        setattr(module, name, shard)
        specs[f"{prefix}.{name}.weight"] = ShardSpec(1, start, stop, tuple(full.weight.shape))

    for index, layer in stage.layers.items():
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"layers.{index}"
        if attn is not None:  # None in a borrowed MLP-only layer
            column(attn, "q_proj", f"{prefix}.self_attn", q_lo * hd, q_hi * hd)
            column(attn, "k_proj", f"{prefix}.self_attn", kv_lo * hd, kv_hi * hd)
            column(attn, "v_proj", f"{prefix}.self_attn", kv_lo * hd, kv_hi * hd)
            row(attn, "o_proj", f"{prefix}.self_attn", q_lo * hd, q_hi * hd)
            attn.n_heads, attn.n_kv_heads = q_hi - q_lo, kv_hi - kv_lo
        if mlp is not None:  # None in a borrowed attention-only layer
            column(mlp, "gate_proj", f"{prefix}.mlp", i_lo, i_hi)
            column(mlp, "up_proj", f"{prefix}.mlp", i_lo, i_hi)
            row(mlp, "down_proj", f"{prefix}.mlp", i_lo, i_hi)

    v_lo, v_hi = layout.vocab
    rows, full_vocab = layout.vocab_shard_size, (args.vocab_size, d)
    ref = next(stage.parameters())
    if stage.embed_tokens is not None:
        stage.embed_tokens = VocabParallelEmbedding(rows, d, v_lo, v_hi, tp).to(ref.device, ref.dtype)
        specs["embed_tokens.weight"] = ShardSpec(0, v_lo, v_hi, full_vocab)
    if stage.lm_head is not None:
        stage.lm_head = VocabParallelLMHead(d, rows, args.vocab_size, tp, v_lo, v_hi).to(ref.device, ref.dtype)
        specs["lm_head.weight"] = ShardSpec(0, v_lo, v_hi, full_vocab)
    return specs
