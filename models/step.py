"""The tensors of one step, built from a `ModelBatch` once and shared by every layer.

The T tokens of all chunks are laid end to end in batch order (chunk 0's tokens,
then chunk 1's, ...). Attention is grouped so no Python loop runs per decode
sequence: all one-token chunks form one decode group attended in a single batched
call over their padded block tables, and each longer (prefill) chunk is attended
on its own, which costs little next to its matmuls.

Every rank builds the same `StepInputs` from the same batch, so every rank knows
T without a message, and a malformed batch fails on every rank alike before any
communication starts (no rank is left waiting in a collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from models.batch import ModelBatch, SequenceChunk

if TYPE_CHECKING:
    from models.kv_mirror import MirrorPlan

__all__ = ["BatchError", "DecodeGroup", "PrefillChunk", "StepInputs", "prepare_step"]


class BatchError(ValueError):
    """A ModelBatch that does not fit this model or KV cache (names the rank, batch and sequence)."""


@dataclass
class DecodeGroup:
    """One-token chunks: rows [B] of the step's tokens, their block tables [B, nb] (padded) and key mask."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    # [B, 1, 1, nb * block_size]: True where the key position holds this sequence's context.
    key_mask: torch.Tensor
    seq_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the position each sequence writes
    tables: list[list[int]] = field(default_factory=list)  # unpadded block tables
    # Set by PagedKVCache.begin_step when the rank keeps a dense mirror of these rows.
    mirror: Optional["MirrorPlan"] = None
    # The group is every token of the step, in order (rows == arange(T)): a decode-only step.
    every_row: bool = False

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of a [T, ...] tensor of the step (x itself when the group is every row)."""
        return x if self.every_row else x[self.rows]


@dataclass
class PrefillChunk:
    """A multi-token chunk occupying rows [start, stop) of the step's tokens."""

    start: int
    stop: int
    start_pos: int
    # None when the chunk is the whole context (start_pos == 0): attention then uses
    # the chunk's fresh keys and values with a causal mask, with no cache read.
    block_table: Optional[torch.Tensor] = None
    # [1, 1, Q, nb * block_size]: query i sees key positions <= start_pos + i.
    mask: Optional[torch.Tensor] = None


@dataclass
class StepInputs:
    """What the model needs for one step (all tensors on the model's device)."""

    batch_id: int
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: flat KV slot written by each token
    decode: Optional[DecodeGroup]
    prefills: list[PrefillChunk]
    sample_rows: torch.Tensor  # [N] long: the last row of each chunk with `sample` set
    sample_chunks: list[SequenceChunk] = field(default_factory=list)
    prefill_seq_ids: list[int] = field(default_factory=list)  # sequences with a multi-token chunk

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_decode_rows(self) -> int:
        """Tokens of one-token chunks (the rest are prompt tokens of multi-token chunks)."""
        return int(self.decode.rows.shape[0]) if self.decode is not None else 0


def prepare_step(
    batch: ModelBatch,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    device: torch.device | str = "cpu",
    where: str = "",
) -> StepInputs:
    """Checks `batch` against the cache and vocabulary and lays out its tensors."""
    prefix = f"{where}: " if where else ""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    decode_seqs: list[int] = []
    prefills: list[PrefillChunk] = []
    sample_rows: list[int] = []
    sample_chunks: list[SequenceChunk] = []

    for chunk in batch.chunks:
        n = len(chunk.token_ids)
        what = f"{prefix}batch {batch.batch_id}, seq {chunk.seq_id}"
        if n == 0:
            raise BatchError(f"{what}: chunk has no tokens")
        if chunk.start_pos < 0:
            raise BatchError(f"{what}: start_pos {chunk.start_pos} is negative")
        end = chunk.start_pos + n
        needed = -(-end // block_size)
        table = chunk.block_table[:needed]
        if len(table) < needed:
            raise BatchError(
                f"{what}: block_table has {len(chunk.block_table)} blocks, positions [0, {end}) "
                f"need {needed} of block_size {block_size}"
            )
        if min(table) < 0 or max(table) >= num_blocks:
            raise BatchError(f"{what}: block_table {table} names a block outside [0, {num_blocks})")
        if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= vocab_size:
            raise BatchError(f"{what}: token id outside [0, {vocab_size})")

        row = len(token_ids)
        token_ids.extend(chunk.token_ids)
        pos = range(chunk.start_pos, end)
        positions.extend(pos)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table)
            decode_lens.append(end)
            decode_seqs.append(chunk.seq_id)
        elif chunk.start_pos == 0:
            prefills.append(PrefillChunk(row, row + n, 0))
        else:
            keys = torch.arange(needed * block_size)
            queries = torch.arange(chunk.start_pos, end)
            mask = (keys[None, :] <= queries[:, None])[None, None]
            prefills.append(
                PrefillChunk(
                    row,
                    row + n,
                    chunk.start_pos,
                    torch.tensor([table], dtype=torch.long, device=device),
                    mask.to(device),
                )
            )
        if chunk.sample:
            sample_rows.append(row + n - 1)
            sample_chunks.append(chunk)

    decode = None
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long)
        lens = torch.tensor(decode_lens, dtype=torch.long)
        key_mask = torch.arange(width * block_size)[None, :] < lens[:, None]
        decode = DecodeGroup(
            rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            block_tables=tables.to(device),
            key_mask=key_mask[:, None, None, :].to(device),
            seq_ids=decode_seqs,
            positions=[n - 1 for n in decode_lens],
            tables=decode_tables,
            every_row=len(decode_rows) == len(token_ids),
        )

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepInputs(
        batch_id=batch.batch_id,
        token_ids=long(token_ids),
        positions=long(positions),
        slot_mapping=long(slots),
        decode=decode,
        prefills=prefills,
        sample_rows=long(sample_rows),
        sample_chunks=sample_chunks,
        prefill_seq_ids=[c.seq_id for c in batch.chunks if len(c.token_ids) > 1],
    )
