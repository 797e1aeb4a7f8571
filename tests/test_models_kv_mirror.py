"""The dense decode mirror (models/kv_mirror.py) must hand attention exactly what a gather would."""

from __future__ import annotations

import random

import pytest
import torch

from models import decode_attention
from models.batch import ModelBatch, SequenceChunk
from models.kv_cache import PagedKVCache
from models.llama import attend
from models.step import prepare_step

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 4, 2, 8, 2, 256
pytestmark = pytest.mark.timeout(60)


class _Sim:
    """Sequences growing one token per decode step, with blocks from a shuffled free list."""

    def __init__(self, cache: PagedKVCache, seed: int) -> None:
        self.cache = cache
        self.rng = random.Random(seed)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.next_id = 0

    def add(self, prompt_len: int) -> int:
        seq = self.next_id
        self.next_id += 1
        self.tables[seq], self.lens[seq] = [], 0
        self._write(seq, prompt_len)
        self.cache.mirror.invalidate([seq])  # what a prefill chunk does
        return seq

    def finish(self, seq: int) -> None:
        self.free.extend(self.tables.pop(seq))
        del self.lens[seq]

    def _ensure(self, seq: int, length: int) -> None:
        while len(self.tables[seq]) * BLOCK < length:
            self.tables[seq].append(self.free.pop())

    def _write(self, seq: int, n: int) -> None:
        start = self.lens[seq]
        self._ensure(seq, start + n)
        table = self.tables[seq]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)])
        for layer in range(LAYERS):
            self.cache.layer(layer).write(torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM), slots)
        self.lens[seq] = start + n

    def decode_step(self, seqs: list[int], batch_id: int, commit: bool = True) -> None:
        """One decode step over `seqs`: mirror rows must equal the gathered rows, and attention must agree."""
        chunks = []
        for seq in seqs:
            self._ensure(seq, self.lens[seq] + 1)
            chunks.append(SequenceChunk(seq, [1], self.lens[seq], list(self.tables[seq])))
        step = prepare_step(ModelBatch(batch_id, chunks), block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=8)
        dec = step.decode
        self.cache.begin_step(step)
        assert dec.mirror is not None
        q = torch.randn(len(seqs), HEADS, 2, DIM)
        for layer in range(LAYERS):
            kv = self.cache.layer(layer)
            k_new, v_new = torch.randn(len(seqs), HEADS, DIM), torch.randn(len(seqs), HEADS, DIM)
            kv.write(k_new, v_new, step.slot_mapping, dec)
            ks, vs, mask, rows = kv.decode_kv(dec)
            # Attention reads [length, head_dim] per (row, head) as one contiguous run.
            assert ks.transpose(1, 2).stride()[2:] == (DIM, 1) and vs.transpose(1, 2).stride()[2:] == (DIM, 1)
            ref_k, ref_v = (t.clone() for t in kv.gather(dec.block_tables))
            rows = torch.arange(len(seqs)) if rows is None else rows
            for i, seq in enumerate(seqs):
                n = self.lens[seq] + 1
                row = int(rows[i])
                assert torch.equal(ks[row, :n], ref_k[i, :n]), (layer, seq)
                assert torch.equal(vs[row, :n], ref_v[i, :n]), (layer, seq)
            want = attend(q, ref_k.transpose(1, 2), ref_v.transpose(1, 2), 0.3, mask=dec.key_mask)
            q_rows = q.new_zeros((ks.shape[0], *q.shape[1:]))
            q_rows[rows] = q
            got = attend(q_rows, ks.transpose(1, 2), vs.transpose(1, 2), 0.3, mask=mask)[rows]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if decode_attention.available():
                # The fused kernel reads the same rows, in batch order, without the padding mask.
                fused = kv.decode_attention(dec, q, 0.3)
                assert fused is not None
                torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-6)
        if commit:
            self.cache.end_step(step)
            for seq in seqs:
                self.lens[seq] += 1


def _cache(budget: int = 64 * 2**20, entries: int = 1, write_kernel: bool = False) -> PagedKVCache:
    return PagedKVCache(
        range(LAYERS), NUM_BLOCKS, BLOCK, HEADS, DIM, torch.float32, mirror_bytes=budget, mirror_entries=entries,
        write_kernel=write_kernel,
    )


@pytest.mark.parametrize("write_kernel", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_match_the_gather_while_sequences_join_leave_and_alternate(seed: int, write_kernel: bool) -> None:
    cache = _cache(entries=2, write_kernel=write_kernel)
    assert all(cache.layer(i).write_kernel == write_kernel for i in range(LAYERS))
    sim = _Sim(cache, seed)
    rng = random.Random(seed)
    groups: list[list[int]] = [[sim.add(rng.randint(1, 9)) for _ in range(5)] for _ in range(2)]
    for step in range(40):
        group = groups[step % 2]  # two batch groups alternate, as two pipeline batches do
        if rng.random() < 0.3 and group:
            sim.finish(group.pop(rng.randrange(len(group))))  # a sequence ends: its row becomes padding
        if rng.random() < 0.3:
            group.append(sim.add(rng.randint(1, 9)))  # a newcomer takes a free row
        if rng.random() < 0.1 and len(group) > 1:
            rng.shuffle(group)  # the scheduler may reorder
        if group:
            sim.decode_step(group, step)
    mirror = cache.mirror
    assert len(mirror.entries) == 2 and mirror.fallbacks == 0
    # Only newcomers, reorders and compactions copy from the paged cache, not every row of every step.
    assert mirror.refilled_rows < 40 * 5


def test_a_group_that_shrank_to_its_last_rows_is_laid_out_again() -> None:
    cache = _cache()
    sim = _Sim(cache, 0)
    seqs = [sim.add(2 + i % 5) for i in range(12)]
    sim.decode_step(seqs, 0)
    assert cache.mirror.entries[0].seq_row == {s: i for i, s in enumerate(seqs)}
    for seq in seqs[:9]:
        sim.finish(seq)
    sim.decode_step(seqs[9:], 1)  # rows 9..11 of 12: compacted to rows 0..2
    assert cache.mirror.compactions == 1
    assert cache.mirror.entries[0].seq_row == {s: i for i, s in enumerate(seqs[9:])}
    sim.decode_step(seqs[9:], 2)


def test_a_step_that_is_not_committed_leaves_no_valid_row() -> None:
    cache = _cache()
    sim = _Sim(cache, 0)
    seqs = [sim.add(5), sim.add(3)]
    sim.decode_step(seqs, 0)
    before = cache.mirror.refilled_rows
    sim.decode_step(seqs, 1)
    assert cache.mirror.refilled_rows == before  # steady state: nothing copied
    sim.add(2)  # an unrelated sequence
    sim.decode_step(seqs + [2], 2, commit=False)  # as if a later layer raised
    sim.decode_step(seqs + [2], 3)  # the newcomer is copied again; rows agree (checked inside)
    assert cache.mirror.refilled_rows == before + 2


def test_a_prefill_chunk_drops_the_sequence_rows() -> None:
    cache = _cache()
    sim = _Sim(cache, 0)
    seq = sim.add(6)
    sim.decode_step([seq], 0)
    # Recompute (as after preemption): new keys for the same positions, the same blocks.
    sim.lens[seq] = 0
    sim._write(seq, 7)
    cache.begin_step(prepare_step(
        ModelBatch(1, [SequenceChunk(seq, [1] * 7, 0, list(sim.tables[seq]))]),
        block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=8,
    ))
    sim.decode_step([seq], 2)  # would fail on stale rows if the prefill had not dropped them


def test_a_group_over_budget_gathers_instead() -> None:
    per_row_pos = LAYERS * 2 * HEADS * DIM * 4
    cache = _cache(budget=per_row_pos * 4)  # room for one row of 4 positions
    sim = _Sim(cache, 0)
    seqs = [sim.add(3), sim.add(3)]
    chunks = [SequenceChunk(s, [1], sim.lens[s], list(sim.tables[s])) for s in seqs]
    step = prepare_step(ModelBatch(0, chunks), block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=8)
    cache.begin_step(step)
    assert step.decode.mirror is None and cache.mirror.fallbacks == 1
    ks, vs, mask, rows = cache.layer(0).decode_kv(step.decode)
    assert ks.shape[0] == 2 and rows is None  # the gather's rows, in batch order


def test_two_groups_that_do_not_both_fit_do_not_evict_each_other() -> None:
    per_row_pos = LAYERS * 2 * HEADS * DIM * 4
    # Room for a's entry (2 rows of 4 positions + 16 of headroom) and not for b's 2 x 4 next to it.
    cache = _cache(budget=per_row_pos * 44, entries=2)
    sim = _Sim(cache, 0)
    a, b = [sim.add(3), sim.add(3)], [sim.add(3), sim.add(3)]
    sim.decode_step(a, 0)
    chunks = [SequenceChunk(s, [1], sim.lens[s], list(sim.tables[s])) for s in b]
    step = prepare_step(ModelBatch(1, chunks), block_size=BLOCK, num_blocks=NUM_BLOCKS, vocab_size=8)
    cache.begin_step(step)
    assert step.decode.mirror is None  # b gathers ...
    sim.decode_step(a, 2)  # ... and a keeps its rows
    assert cache.mirror.fallbacks == 1 and len(cache.mirror.entries) == 1
