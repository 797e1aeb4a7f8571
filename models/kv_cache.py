"""The paged KV cache of one rank: its layers' keys and values, preallocated once.

Layout (see models/batch.py): for each layer this rank owns, a key tensor and a
value tensor of shape [num_blocks, block_size, num_local_kv_heads, head_dim].
Position p of a sequence lives at block `block_table[p // block_size]`, offset
`p % block_size`; as a flat slot that is `block * block_size + offset`.

All layers share one allocation, zero-filled at creation: the pages are touched
once at load time rather than on the hot path (first touch runs at about 2 GB/s
here), and a masked-out slot never holds a NaN that 0 * NaN would spread.

Decode steps may read a dense copy of their sequences' rows instead of gathering
blocks (`models.kv_mirror.KVMirror`, owned here; `begin_step` / `end_step` bracket a
step's layers); the blocks stay the source of truth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from models import decode_attention, kv_write
from models.kv_mirror import KVMirror

if TYPE_CHECKING:
    from models.step import DecodeGroup, StepInputs

__all__ = ["LayerKV", "PagedKVCache"]


class _Workspace:
    """Reused buffers for gathered keys and values, grown only when a step needs more.

    Layers run one after another, so one pair serves them all; a fresh buffer each
    layer would pay first-touch page faults, three times the cost of the copy itself.
    """

    def __init__(self, like: torch.Tensor) -> None:
        self.like = like
        self.k = like.new_empty((0, *like.shape[1:]))
        self.v = like.new_empty((0, *like.shape[1:]))

    def get(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k.shape[0] < blocks:
            self.k = self.like.new_empty((blocks, *self.like.shape[1:]))
            self.v = self.like.new_empty((blocks, *self.like.shape[1:]))
        return self.k[:blocks], self.v[:blocks]


class LayerKV:
    """The key and value blocks of one layer."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        workspace: _Workspace,
        mirror: Optional[KVMirror] = None,
        index: int = 0,
        decode_kernel: bool = False,
        write_kernel: bool = False,
    ) -> None:
        self.k = k
        self.v = v
        self.workspace = workspace
        self.mirror = mirror
        self.index = index  # this layer's place in the cache (and the mirror)
        self.decode_kernel = decode_kernel and mirror is not None
        # Stores keys and values (and the mirror's new positions) in one numba call (models/kv_write.py),
        # into the blocks viewed for it once, as [slots, kv_heads, head_dim]; None: torch's ops.
        self._paged_bits = (
            (kv_write.bits(k.view(-1, *k.shape[2:])), kv_write.bits(v.view(-1, *v.shape[2:])))
            if write_kernel and kv_write.supports(k) and kv_write.supports(v)
            else None
        )

    @property
    def write_kernel(self) -> bool:
        """Whether `write` stores with the KV write kernel (where its inputs allow)."""
        return self._paged_bits is not None

    def write(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, decode: Optional["DecodeGroup"] = None
    ) -> None:
        """Stores k, v [T, kv_heads, head_dim] at flat slots [T].

        With the step's `decode` group, also brings its rows of the mirror up to date:
        every step that writes a layer's keys keeps its mirror rows current, whether or
        not this rank then attends them (a pipeline boundary layer that a step moves to
        the next stage is written here and attended there), since `PagedKVCache.end_step`
        marks the rows valid for every layer at once.
        """
        plan = decode.mirror if decode is not None else None
        paged = self._paged_bits
        if plan is None or self.mirror is None:
            if paged is None or not kv_write.write_kv(k, v, slots, paged):
                self._store(k, v, slots)
            return
        # Rows refilled from the blocks before this step's tokens reach them: the new
        # positions are written into the mirror next, with the rest of the group's.
        self.mirror.refill_layer(plan, self.index, self.k, self.v)
        if paged is not None:
            mirror_k, mirror_v = plan.entry.layer_bits(self.index)
            if kv_write.write_kv(k, v, slots, paged, (decode.rows, plan.rows, plan.positions, mirror_k, mirror_v)):
                return
        self._store(k, v, slots)
        self.mirror.write_new(plan, self.index, decode.take(k), decode.take(v))

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def refill_mirror(self, decode: Optional["DecodeGroup"]) -> None:
        """Brings the decode group's refilled mirror rows of this layer up to date, for a step
        that does not compute the layer here (its new keys come later, `write_back`)."""
        plan = decode.mirror if decode is not None else None
        if plan is not None and self.mirror is not None:
            self.mirror.refill_layer(plan, self.index, self.k, self.v)

    def write_back(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        decode_rows: Optional[torch.Tensor] = None,
        seq_ids: Sequence[int] = (),
        positions: Sequence[int] = (),
    ) -> None:
        """Stores k, v [T, kv_heads, head_dim] of an earlier step at flat slots [T], computed by another stage.

        `decode_rows` (indices into T) are that step's one-token chunks, of sequences
        `seq_ids` at `positions`: the mirror rows that already claim them get them too
        (`KVMirror.write_late`).
        """
        self._store(k, v, slots)
        if self.mirror is not None and decode_rows is not None and len(seq_ids):
            self.mirror.write_late(self.index, seq_ids, positions, k.index_select(0, decode_rows), v.index_select(0, decode_rows))

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, nb * block_size, kv_heads, head_dim] of block tables [B, nb].

        The result lives in a shared workspace: valid until the next layer gathers.
        """
        b, nb = block_tables.shape
        _, block_size, heads, dim = self.k.shape
        k, v = self.workspace.get(b * nb)
        flat = block_tables.reshape(-1)
        torch.index_select(self.k, 0, flat, out=k)
        torch.index_select(self.v, 0, flat, out=v)
        return k.view(b, nb * block_size, heads, dim), v.view(b, nb * block_size, heads, dim)

    def decode_attention(self, decode: "DecodeGroup", q: torch.Tensor, scale: float) -> Optional[torch.Tensor]:
        """A decode group's attention output [B, kv_heads, groups, head_dim] by the fused kernel.

        Call after `write` with the group. q [B, kv_heads, groups, head_dim]: the group's
        queries in batch order. None when the kernel does not serve this step (no mirror
        plan, kernel off or unavailable): the caller attends `decode_kv`'s tensors with SDPA.
        """
        plan = decode.mirror
        # The kernel has no backward: a query that needs gradients goes through SDPA.
        if plan is None or not self.decode_kernel or q.requires_grad or not decode_attention.supports(self.k):
            return None
        k_buf, v_buf = plan.entry.storage[self.index]  # [rows, kv_heads, len_cap, head_dim] each
        return decode_attention.mirror_decode_attention(q, k_buf, v_buf, plan.rows, plan.counts, scale)

    def decode_kv(
        self, decode: "DecodeGroup"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """What a decode group attends (call after `write` with the group): keys, values [R, L, kv_heads, head_dim], mask, rows.

        `rows` is None when row i holds the group's sequence i (mask [B, 1, 1, L]);
        otherwise the R rows come from the mirror (models/kv_mirror.py) and rows[i] is
        where sequence i sits, the other rows being padding (mask [R, 1, 1, L]).
        """
        plan = decode.mirror
        if plan is None or self.mirror is None:
            ks, vs = self.gather(decode.block_tables)
            return ks, vs, decode.key_mask, None
        ks, vs = KVMirror.layer_view(plan, self.index)
        return (ks, vs, decode.key_mask, None) if plan.identity else (ks, vs, plan.mask, plan.rows)


class PagedKVCache:
    """Key and value blocks for a set of layers, allocated once within a byte budget."""

    def __init__(
        self,
        layers: Sequence[int],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        mirror_bytes: int = 0,
        mirror_entries: int = 1,
        decode_kernel: bool = True,
        write_kernel: bool = False,
    ) -> None:
        self.layer_ids = list(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (len(self.layer_ids), 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        workspace = _Workspace(self.storage[0, 0])
        # Decode steps attend a dense copy kept across steps instead of gathering blocks.
        self.mirror: Optional[KVMirror] = (
            KVMirror(len(self.layer_ids), num_kv_heads, head_dim, block_size, dtype, device, mirror_bytes, mirror_entries)
            if mirror_bytes > 0
            else None
        )
        self._layers = {
            layer: LayerKV(self.storage[i, 0], self.storage[i, 1], workspace, self.mirror, i, decode_kernel, write_kernel)
            for i, layer in enumerate(self.layer_ids)
        }

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across `num_layers` layers (keys and values)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def layer(self, layer_id: int) -> LayerKV:
        return self._layers[layer_id]

    def begin_step(self, step: "StepInputs") -> None:
        """Plans the step's use of the mirror (once per step, before the first layer)."""
        mirror = self.mirror
        if mirror is None:
            return
        if step.prefill_seq_ids:
            mirror.invalidate(step.prefill_seq_ids)
        dec = step.decode
        if dec is not None and dec.seq_ids:
            dec.mirror = mirror.plan(dec)

    def end_step(self, step: "StepInputs") -> None:
        """Records what the step wrote into the mirror (after the last layer ran)."""
        if step.decode is not None and step.decode.mirror is not None:  # a plan implies a mirror
            KVMirror.commit(step.decode.mirror)
