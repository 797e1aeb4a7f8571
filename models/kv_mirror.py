"""A dense copy of the decoding sequences' keys and values, kept from step to step.

Attention over a paged cache first gathers each decode sequence's blocks into one
padded [B, L, kv_heads, head_dim] tensor. Without a fused paged-attention kernel
that gather is a full copy of the batch's context in every layer of every step
(about a quarter of a float32 decode step here: `tools/bench_step.py --kv-mirror-mb 0
--profile`), although from one step to
the next only one position per sequence is new.

The mirror keeps that padded tensor alive between steps: each sequence of a
decode group owns a row of a [rows, len_cap] buffer per layer, and a step copies
only what is new: the token it writes, or, for a row that is missing or stale, the
row's blocks from the paged cache (a "refill"). The paged cache stays the source
of truth; a row is trusted only while its sequence id, length and block table
prefix all match what the step asks for, and a prefill chunk of a sequence drops
its rows (its keys may have been recomputed).

There is one entry (buffer) per batch group that can be in flight, so two
pipeline batches alternating through a stage each keep their own rows. Rows of
sequences absent from a step stay as masked padding and are reused by newcomers;
an entry whose live rows fall to under half its span is rebuilt compactly. The
whole mirror stays within `budget_bytes`; a step that would not fit uses the
gather instead, which gives the same attention inputs.

Failure safety: a step's rows are marked valid only by `commit`, after every
layer ran; a row being refilled or taken over is marked invalid at planning time,
so a step that fails half way leaves no row that claims data it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from models import kv_write

if TYPE_CHECKING:
    from models.step import DecodeGroup

__all__ = ["KVMirror", "MirrorPlan"]

# A new entry gets this many positions of headroom past the longest row.
_HEADROOM_BLOCKS = 4


class _Entry:
    """One buffer: rows of sequences and what each row holds."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        # Stored [layers, 2 (k, v), rows, kv_heads, len_cap, head_dim], so that each
        # (row, head) is one contiguous run of keys: attention reads it 1.4x faster
        # than the [len, kv_heads] interleaving of the paged blocks. `shape` and `kv`
        # are the logical [layers, 2, rows, len_cap, kv_heads, head_dim] (a permuted view).
        # Zeros: a masked position must hold a finite value (0 * NaN would spread).
        layers, two, rows, len_cap, heads, dim = shape
        self.storage = torch.zeros((layers, two, rows, heads, len_cap, dim), dtype=dtype, device=device)
        self.kv = self.storage.permute(0, 1, 2, 4, 3, 5)
        self.row_seq: list[Optional[int]] = [None] * rows
        self.row_len: list[int] = [-1] * rows  # positions [0, row_len) are valid; -1: nothing
        self.row_blocks: list[tuple[int, ...]] = [()] * rows  # block table prefix behind row_len
        self.seq_row: dict[int, int] = {}
        self.last_used = 0
        self._bits: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def layer_bits(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s key and value buffers [rows, kv_heads, len_cap, head_dim] as the KV
        write kernel takes them (models/kv_write.py), viewed once per entry."""
        views = self._bits.get(layer)
        if views is None:
            views = self._bits[layer] = (kv_write.bits(self.storage[layer, 0]), kv_write.bits(self.storage[layer, 1]))
        return views

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    @property
    def len_cap(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def forget(self, row: int) -> None:
        seq = self.row_seq[row]
        if seq is not None and self.seq_row.get(seq) == row:
            del self.seq_row[seq]
        self.row_seq[row], self.row_len[row], self.row_blocks[row] = None, -1, ()

    def assign(self, row: int, seq: int) -> None:
        self.forget(row)
        self.row_seq[row] = seq
        self.seq_row[seq] = row


@dataclass
class MirrorPlan:
    """How one step's decode group uses the mirror (built once per step, used by every layer)."""

    entry: _Entry
    rows: torch.Tensor  # [B] long: the entry row of each decode sequence, in batch order
    positions: torch.Tensor  # [B] long: the position each sequence writes this step
    counts: torch.Tensor  # [B] long: keys each sequence attends this step (position + 1)
    # Rows to copy from the paged cache before attending: (row, block ids [n]).
    refills: list[tuple[int, torch.Tensor]]
    span: int  # rows [0, span) are attended
    length: int  # key positions attended per row (the batch's padded block-table width)
    identity: bool  # rows == arange(B) and span == B: queries need no scatter
    mask: Optional[torch.Tensor]  # [span, 1, 1, length] bool; None with identity (the group's own mask)
    # What commit records per batch row: (row, length after the step, block prefix).
    updates: list[tuple[int, int, tuple[int, ...]]]


class KVMirror:
    """Dense decode keys/values for `num_layers` layers, within `budget_bytes` (see module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        budget_bytes: int,
        max_entries: int = 1,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.budget_bytes = int(budget_bytes)
        self.max_entries = max(1, int(max_entries))
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self.entries: list[_Entry] = []
        self._clock = 0
        self.refilled_rows = 0  # rows copied from the paged cache, in total
        self.fallbacks = 0  # decode steps that did not fit the budget and gathered instead
        self.compactions = 0  # entries laid out again because most of their span was padding

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _entry_bytes(self, rows: int, len_cap: int) -> int:
        return self.num_layers * 2 * rows * len_cap * self.num_kv_heads * self.head_dim * self._itemsize

    def invalidate(self, seq_ids: Sequence[int]) -> None:
        """Forgets the rows of these sequences (their keys are being recomputed)."""
        for entry in self.entries:
            for seq in seq_ids:
                row = entry.seq_row.get(seq)
                if row is not None:
                    entry.forget(row)

    def plan(self, group: "DecodeGroup") -> Optional[MirrorPlan]:
        """Rows for a decode group (its sequence i writes position positions[i] with block table tables[i]).

        The rows span the group's padded block tables (L = width * block_size). None
        when the group does not fit the budget: the caller gathers from the paged cache.
        """
        seq_ids, positions, tables = group.seq_ids, group.positions, group.tables
        b, length = len(seq_ids), group.width * self.block_size
        self._clock += 1
        entry = self._pick(seq_ids)
        if entry is None or entry.rows < b or entry.len_cap < length:
            entry = self._grow(entry, b, length)
            if entry is None:
                self.fallbacks += 1
                return None
        entry.last_used = self._clock

        bs = self.block_size
        wanted = set(seq_ids)
        rows: list[int] = []
        stale: list[int] = []
        for seq, pos, table in zip(seq_ids, positions, tables):
            row = entry.seq_row.get(seq)
            if row is None:
                rows.append(-1)
                continue
            rows.append(row)
            held = -(-pos // bs)
            if entry.row_len[row] != pos or tuple(table[:held]) != entry.row_blocks[row][:held]:
                stale.append(row)
        # Newcomers take the lowest rows not used by this step.
        free = iter(r for r in range(entry.rows) if entry.row_seq[r] not in wanted)
        refill_rows = set(stale)
        for i, seq in enumerate(seq_ids):
            if rows[i] < 0:
                row = next(free)
                entry.assign(row, seq)
                rows[i] = row
                refill_rows.add(row)
        span = max(rows) + 1
        if span > 2 * b and span - b >= 8:
            # Mostly padding: lay the group out again in batch order.
            for row in range(entry.rows):
                entry.forget(row)
            rows = list(range(b))
            for row, seq in zip(rows, seq_ids):
                entry.assign(row, seq)
            refill_rows = set(rows)
            span = b
            self.compactions += 1

        refills, updates = [], []
        for row, pos, table in zip(rows, positions, tables):
            blocks = tuple(table[: pos // bs + 1])  # the blocks behind positions [0, pos]
            updates.append((row, pos + 1, blocks))
            if row in refill_rows:
                entry.row_len[row] = -1  # until commit: a failed step must leave no valid claim
                refills.append((row, torch.tensor(blocks, dtype=torch.long, device=self.device)))
        self.refilled_rows += len(refills)

        identity = span == b and rows == list(range(b))
        row_ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = None
        if not identity:
            key_mask = group.key_mask
            mask = torch.zeros((span, 1, 1, length), dtype=torch.bool, device=key_mask.device)
            mask[..., 0] = True  # padding rows attend to one finite key; their output is dropped
            mask[row_ids.to(key_mask.device)] = key_mask
        return MirrorPlan(
            entry=entry,
            rows=row_ids,
            positions=torch.tensor(list(positions), dtype=torch.long, device=self.device),
            counts=torch.tensor([p + 1 for p in positions], dtype=torch.long, device=self.device),
            refills=refills,
            span=span,
            length=length,
            identity=identity,
            mask=mask,
            updates=updates,
        )

    @staticmethod
    def commit(plan: MirrorPlan) -> None:
        """Marks the step's rows valid (call after every layer ran)."""
        entry = plan.entry
        for row, new_len, blocks in plan.updates:
            entry.row_len[row] = new_len
            entry.row_blocks[row] = blocks

    def write_new(self, plan: MirrorPlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the decode group's new keys and values k, v [B, kv_heads, head_dim] (batch order) into its rows.

        Call after `refill_layer`, which copies whole blocks and so may leave a stale value
        at a new position. `models.kv_write.write_kv` does the same in one call.
        """
        buf_k, buf_v = plan.entry.kv[layer, 0], plan.entry.kv[layer, 1]
        buf_k.index_put_((plan.rows, plan.positions), k)
        buf_v.index_put_((plan.rows, plan.positions), v)

    def refill_layer(self, plan: MirrorPlan, layer: int, paged_k: torch.Tensor, paged_v: torch.Tensor) -> None:
        """Refills layer `layer`'s rows the plan names from the paged blocks, writing no new token.

        For a layer whose new keys this rank does not compute this step (they arrive later,
        `write_late`): `commit` marks the rows valid for every layer at once.
        """
        if not plan.refills:  # most decode steps: indexing the buffers alone costs a few us a layer
            return
        buf_k, buf_v = plan.entry.kv[layer, 0], plan.entry.kv[layer, 1]
        bs = self.block_size
        for row, blocks in plan.refills:
            n = blocks.shape[0] * bs
            buf_k[row, :n].copy_(paged_k.index_select(0, blocks).view(n, *paged_k.shape[2:]))
            buf_v[row, :n].copy_(paged_v.index_select(0, blocks).view(n, *paged_v.shape[2:]))

    def write_late(
        self, layer: int, seq_ids: Sequence[int], positions: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Writes layer `layer`'s keys and values of an earlier step's decode rows into the rows that claim them.

        A row claims position p of its sequence when a committed step covered it (its
        length is past p) though this rank did not compute that layer then (the last
        stage did and sent them back): sequence i's key k[i] goes to position positions[i]
        of its row in every entry holding it. Rows taken over or refilled since are left
        as they are (a refill reads the paged cache, which the caller writes first).
        """
        for entry in self.entries:
            hits = [
                (i, row)
                for i, s in enumerate(seq_ids)
                if (row := entry.seq_row.get(s)) is not None and entry.row_len[row] > positions[i]
            ]
            if not hits:
                continue
            index = torch.tensor([i for i, _ in hits], dtype=torch.long, device=k.device)
            rows = torch.tensor([row for _, row in hits], dtype=torch.long, device=self.device)
            pos = torch.tensor([positions[i] for i, _ in hits], dtype=torch.long, device=self.device)
            entry.kv[layer, 0].index_put_((rows, pos), k.index_select(0, index))
            entry.kv[layer, 1].index_put_((rows, pos), v.index_select(0, index))

    @staticmethod
    def layer_view(plan: MirrorPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values [span, length, kv_heads, head_dim] (after `refill_layer` and `write_new`).

        A strided view whose transpose(1, 2) has contiguous [length, head_dim] runs per (row, head).
        """
        buf_k, buf_v = plan.entry.kv[layer, 0], plan.entry.kv[layer, 1]
        return buf_k[: plan.span, : plan.length], buf_v[: plan.span, : plan.length]

    # ----- entries -----

    def _pick(self, seq_ids: Sequence[int]) -> Optional[_Entry]:
        best, overlap = None, 0
        for entry in self.entries:
            n = sum(1 for s in seq_ids if s in entry.seq_row)
            if n > overlap:
                best, overlap = entry, n
        if best is not None:
            return best
        if len(self.entries) < self.max_entries:
            return None  # room for a new entry
        return min(self.entries, key=lambda e: e.last_used)

    def _grow(self, entry: Optional[_Entry], rows: int, length: int) -> Optional[_Entry]:
        """`entry` resized (content kept) or a new entry, to hold `rows` rows of `length`; None if over budget."""
        bs = self.block_size
        old_rows, old_len = (entry.rows, entry.len_cap) if entry is not None else (0, 0)
        need_rows, need_len = max(rows, old_rows), max(length, old_len)
        others = self.nbytes - (entry.nbytes if entry is not None else 0)
        candidates = [
            (max(need_rows, 2 * old_rows) if rows > old_rows else need_rows,
             max(need_len + _HEADROOM_BLOCKS * bs, 2 * old_len) if length > old_len else need_len),
            (need_rows, need_len),
        ]
        shape = None
        for r, n in candidates:
            if others + self._entry_bytes(r, n) <= self.budget_bytes:
                shape = (r, n)
                break
        if shape is None:
            # Make room by dropping other entries, least recently used first, but only
            # those no in-flight group used lately: evicting a live group's entry would
            # have two groups take turns refilling everything, which is worse than gathering.
            stale = [e for e in self.entries if e is not entry and e.last_used <= self._clock - self.max_entries]
            for other in sorted(stale, key=lambda e: e.last_used):
                self.entries.remove(other)
                others -= other.nbytes
                if others + self._entry_bytes(need_rows, need_len) <= self.budget_bytes:
                    shape = (need_rows, need_len)
                    break
        if shape is None:
            if entry is not None:
                self.entries.remove(entry)
            return None
        new = _Entry(
            (self.num_layers, 2, shape[0], shape[1], self.num_kv_heads, self.head_dim), self.dtype, self.device
        )
        if entry is not None:
            new.kv[:, :, :old_rows, :old_len].copy_(entry.kv)
            new.row_seq[:old_rows] = entry.row_seq
            new.row_len[:old_rows] = entry.row_len
            new.row_blocks[:old_rows] = entry.row_blocks
            new.seq_row = dict(entry.seq_row)
            new.last_used = entry.last_used
            self.entries[self.entries.index(entry)] = new
        else:
            self.entries.append(new)
        return new
