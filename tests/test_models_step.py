"""prepare_step: the step layout every rank builds from a ModelBatch, and the errors it names."""

from __future__ import annotations

import pytest
import torch

from models.batch import ModelBatch, SequenceChunk
from models.step import BatchError, prepare_step

BLOCK = 4
NUM_BLOCKS = 32
VOCAB = 100


def _step(chunks: list[SequenceChunk], batch_id: int = 9):
    return prepare_step(
        ModelBatch(batch_id, chunks), block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=VOCAB, where="rank (pp=1, tp=0)"
    )


def test_a_mixed_step_lays_out_every_chunk_in_batch_order():
    chunks = [
        SequenceChunk(1, [11], 6, [3, 7, 9]),  # decode at position 6: block 7, offset 2
        SequenceChunk(2, [21, 22, 23, 24, 25], 0, [4, 5]),  # a whole prompt
        SequenceChunk(3, [31], 0, [8, 12]),  # decode at position 0; the table is longer than needed
        SequenceChunk(4, [41, 42, 43], 5, [1, 2, 6], sample=False),  # a prompt's later chunk, positions 5-7
    ]
    step = _step(chunks)
    assert step.token_ids.tolist() == [11, 21, 22, 23, 24, 25, 31, 41, 42, 43]
    assert step.positions.tolist() == [6, 0, 1, 2, 3, 4, 0, 5, 6, 7]
    # Position p of a chunk sits in block table[p // BLOCK] at offset p % BLOCK.
    assert step.slot_mapping.tolist() == [7 * 4 + 2, 16, 17, 18, 19, 20, 32, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3]
    assert step.sample_rows.tolist() == [0, 5, 6]
    assert [c.seq_id for c in step.sample_chunks] == [1, 2, 3]
    assert step.prefill_seq_ids == [2, 4]

    fresh, later = step.prefills
    assert (fresh.start, fresh.stop, fresh.start_pos, fresh.block_table, fresh.mask) == (1, 6, 0, None, None)
    assert (later.start, later.stop, later.start_pos) == (7, 10, 5)
    assert later.block_table.tolist() == [[1, 2]]
    # Query i (position 5 + i) sees key positions <= 5 + i of the chunk's two blocks.
    assert later.mask.shape == (1, 1, 3, 8)
    assert later.mask[0, 0].sum(dim=1).tolist() == [6, 7, 8]

    dec = step.decode
    assert dec is not None and not dec.every_row
    assert dec.rows.tolist() == [0, 6]
    assert (dec.seq_ids, dec.positions, dec.tables) == ([1, 3], [6, 0], [[3, 7], [8]])
    assert dec.block_tables.tolist() == [[3, 7], [8, 0]]  # padded with block 0
    assert dec.key_mask.shape == (2, 1, 1, 8)
    assert dec.key_mask[:, 0, 0].sum(dim=1).tolist() == [7, 1]  # positions [0, 6] and [0, 0]
    assert step.num_decode_rows == 2 and step.num_tokens == 10


def test_a_decode_only_step_is_one_group_of_every_row():
    step = _step([SequenceChunk(s, [s], 4 + s, [s, s + 1, s + 2]) for s in range(3)])
    dec = step.decode
    assert dec.every_row and dec.rows.tolist() == [0, 1, 2]
    assert step.prefills == [] and step.prefill_seq_ids == []
    x = torch.arange(3)
    assert dec.take(x) is x


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([SequenceChunk(5, [], 0, [0])], "seq 5: chunk has no tokens"),
        ([SequenceChunk(5, [1], -1, [0])], "seq 5: start_pos -1 is negative"),
        ([SequenceChunk(5, [1] * 9, 0, [0, 1])], r"seq 5: block_table has 2 blocks, positions \[0, 9\) need 3"),
        ([SequenceChunk(5, [1], 4, [0, NUM_BLOCKS])], rf"seq 5: block_table \[0, {NUM_BLOCKS}\] names a block outside"),
        ([SequenceChunk(5, [1, 2], 0, [-1])], r"seq 5: block_table \[-1\] names a block outside"),
        ([SequenceChunk(5, [VOCAB], 0, [0])], rf"seq 5: token id outside \[0, {VOCAB}\)"),
        ([SequenceChunk(5, [1, -3], 0, [0])], "seq 5: token id outside"),
    ],
)
def test_a_malformed_chunk_is_named_with_the_rank_and_batch(chunks, message):
    good = SequenceChunk(1, [1], 0, [0])
    with pytest.raises(BatchError, match=r"rank \(pp=1, tp=0\): batch 9, " + message):
        _step([good, *chunks, good])


def test_the_first_bad_chunk_in_batch_order_is_the_one_named():
    # A bad token in seq 1 comes before a short block table in seq 2: seq 1 is named,
    # although the table is the fault found first.
    chunks = [SequenceChunk(1, [VOCAB + 5], 0, [0]), SequenceChunk(2, [1] * 9, 0, [0])]
    with pytest.raises(BatchError, match="seq 1: token id outside"):
        _step(chunks)
    # A block out of range in a later chunk is still found.
    with pytest.raises(BatchError, match="seq 3: block_table"):
        _step([SequenceChunk(2, [1], 0, [0]), SequenceChunk(3, [1], 0, [NUM_BLOCKS + 1])])


def test_blocks_past_the_needed_ones_are_not_checked():
    # Only the blocks holding positions [0, end) are read or written.
    step = _step([SequenceChunk(1, [1, 2], 0, [3, -7, NUM_BLOCKS + 9])])
    assert step.slot_mapping.tolist() == [12, 13]


def test_an_empty_batch_is_an_empty_step():
    step = _step([])
    assert step.num_tokens == 0 and step.decode is None and step.prefills == []
