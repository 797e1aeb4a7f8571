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


class DecodeGroup:
    """One-token chunks: rows [B] of the step's tokens, each sequence's position and block table.

    The padded block tables [B, nb] and key mask [B, 1, 1, nb * block_size] are built on
    first use: with the KV mirror and its kernel serving a step, nothing reads them.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        seq_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        block_size: int,
        every_row: bool = False,
    ) -> None:
        self.rows = rows
        self.seq_ids = seq_ids
        self.positions = positions  # the position each sequence writes
        self.tables = tables  # unpadded block tables, each covering positions [0, position]
        self.block_size = block_size
        self.width = max(len(t) for t in tables)  # blocks of the longest table: the padded tables' width
        # The group is every token of the step, in order (rows == arange(T)): a decode-only step.
        self.every_row = every_row
        # Set by PagedKVCache.begin_step when the rank keeps a dense mirror of these rows.
        self.mirror: Optional["MirrorPlan"] = None
        self._block_tables: Optional[torch.Tensor] = None
        self._key_mask: Optional[torch.Tensor] = None

    @property
    def block_tables(self) -> torch.Tensor:
        """[B, width] long, each table padded with block 0 (masked out by `key_mask`)."""
        if self._block_tables is None:
            width = self.width
            tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.long)
            self._block_tables = tables.to(self.rows.device)
        return self._block_tables

    @property
    def key_mask(self) -> torch.Tensor:
        """[B, 1, 1, width * block_size]: True where the key position holds this sequence's context."""
        if self._key_mask is None:
            lens = torch.tensor(self.positions, dtype=torch.long) + 1
            mask = torch.arange(self.width * self.block_size)[None, :] < lens[:, None]
            self._key_mask = mask[:, None, None, :].to(self.rows.device)
        return self._key_mask

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
    """Checks `batch` against the cache and vocabulary and lays out its tensors.

    It runs on every rank for every step, so the common case stays cheap: one pass
    over the chunks with little work per one-token chunk, and the range checks of
    token ids and blocks done once over the whole step; only a batch that fails them
    is looked at again, chunk by chunk, to name the offender.
    """
    bs = block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    blocks: list[int] = []  # every block the step reads or writes, for the range check
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_positions: list[int] = []
    decode_seqs: list[int] = []
    prefills: list[PrefillChunk] = []
    prefill_seq_ids: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[SequenceChunk] = []

    for chunk in batch.chunks:
        ids = chunk.token_ids
        n = len(ids)
        pos = chunk.start_pos
        end = pos + n
        needed = -(-end // bs)
        table = chunk.block_table
        if n == 0 or pos < 0 or len(table) < needed:
            # Named in batch order, as if every chunk before it had been checked in full.
            for earlier in batch.chunks:
                _check_chunk(batch, earlier, bs, num_blocks, vocab_size, where)
        row = len(token_ids)
        token_ids += ids
        if n == 1:
            table = table[:needed]
            positions.append(pos)
            slots.append(table[-1] * bs + pos % bs)  # the last block needed holds position pos
            blocks += table
            decode_rows.append(row)
            decode_tables.append(table)
            decode_positions.append(pos)
            decode_seqs.append(chunk.seq_id)
        else:
            table = table[:needed]
            blocks += table
            span = range(pos, end)
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            prefill_seq_ids.append(chunk.seq_id)
            if pos == 0:
                prefills.append(PrefillChunk(row, row + n, 0))
            else:
                keys = torch.arange(needed * bs)
                queries = torch.arange(pos, end)
                mask = (keys[None, :] <= queries[:, None])[None, None]
                prefills.append(
                    PrefillChunk(
                        row, row + n, pos, torch.tensor([table], dtype=torch.long, device=device), mask.to(device)
                    )
                )
        if chunk.sample:
            sample_rows.append(row + n - 1)
            sample_chunks.append(chunk)

    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size or min(blocks) < 0 or max(blocks) >= num_blocks):
        for chunk in batch.chunks:
            _check_chunk(batch, chunk, bs, num_blocks, vocab_size, where)

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    decode = None
    if decode_rows:
        decode = DecodeGroup(
            rows=long(decode_rows),
            seq_ids=decode_seqs,
            positions=decode_positions,
            tables=decode_tables,
            block_size=bs,
            every_row=len(decode_rows) == len(token_ids),
        )
    return StepInputs(
        batch_id=batch.batch_id,
        token_ids=long(token_ids),
        positions=long(positions),
        slot_mapping=long(slots),
        decode=decode,
        prefills=prefills,
        sample_rows=long(sample_rows),
        sample_chunks=sample_chunks,
        prefill_seq_ids=prefill_seq_ids,
    )


def _check_chunk(
    batch: ModelBatch, chunk: SequenceChunk, block_size: int, num_blocks: int, vocab_size: int, where: str
) -> None:
    """Raises the BatchError that names what is wrong with `chunk`, if anything is."""
    what = f"{where}: " if where else ""
    what += f"batch {batch.batch_id}, seq {chunk.seq_id}"
    n = len(chunk.token_ids)
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
