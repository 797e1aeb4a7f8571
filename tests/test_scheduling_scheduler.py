"""Scheduler, block manager and sampling params, without processes.

A fake model stands in for the workers: it writes each chunk's tokens into a paged
"KV cache" at the slots the block tables name, and for a sampled chunk reads the
whole context back from those slots and returns a token that depends on it and on
num_generated. A block shared by two live sequences, a freed block read after
reuse, a wrong start_pos or a wrong num_generated all change the tokens, so
comparing against a plain reference loop checks the KV bookkeeping end to end.
"""

from __future__ import annotations

import collections
import math
from typing import Optional, Sequence

import pytest

from models.batch import ModelBatch, ModelOutput
from scheduling import BlockManager, Request, RequestStatus, SamplingParams, Scheduler

pytestmark = pytest.mark.timeout(60)

VOCAB = 100


def next_token(context: Sequence[int], num_generated: int) -> int:
    """A token in [3, 100) that depends on every context token, its position, and num_generated."""
    mixed = sum((i + 1) * t for i, t in enumerate(context)) * 7919 + num_generated * 104729
    return mixed % (VOCAB - 3) + 3


class FakeModel:
    """Executes batches against a simulated paged KV cache (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.batches: list[ModelBatch] = []
        self.max_in_flight = 0

    def execute(self, batch: ModelBatch) -> ModelOutput:
        bs = self.block_size
        self.batches.append(batch)
        seq_ids, tokens = [], []
        for c in batch.chunks:
            for i, t in enumerate(c.token_ids):
                p = c.start_pos + i
                self.slots[c.block_table[p // bs], p % bs] = (c.seq_id, p, t)
            if c.sample:
                context = []
                for p in range(c.start_pos + len(c.token_ids)):
                    seq, pos, t = self.slots[c.block_table[p // bs], p % bs]
                    assert (seq, pos) == (c.seq_id, p), f"seq {c.seq_id} position {p} reads another sequence's KV"
                    context.append(t)
                seq_ids.append(c.seq_id)
                tokens.append(next_token(context, c.num_generated))
        return ModelOutput(batch.batch_id, seq_ids, tokens)


def reference(
    prompt: Sequence[int], params: SamplingParams, eos: Sequence[int] = (), max_model_len: float = math.inf
) -> tuple[list[int], str]:
    context, out = list(prompt), []
    while True:
        t = next_token(context, len(out))
        context.append(t)
        out.append(t)
        if t in params.stop_token_ids or (t in eos and not params.ignore_eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(context) >= max_model_len:
            return out, "length"


def drive(scheduler: Scheduler, requests: Sequence[Request], inflight: int = 1, model: Optional[FakeModel] = None) -> FakeModel:
    """Runs every request to the end with up to `inflight` batches outstanding; checks no request is in two."""
    model = model or FakeModel(scheduler.block_size)
    for r in requests:
        scheduler.add_request(r)
    queue: collections.deque = collections.deque()
    steps = 0
    while scheduler.has_unfinished() or queue:
        while len(queue) < inflight:
            batch = scheduler.schedule()
            if batch is None:
                break
            in_flight = {c.seq_id for b, _ in queue for c in b.chunks}
            mine = [c.seq_id for c in batch.chunks]
            assert len(set(mine)) == len(mine), "a sequence twice in one batch"
            assert not in_flight & set(mine), "a sequence in two in-flight batches"
            queue.append((batch, model.execute(batch)))
            model.max_in_flight = max(model.max_in_flight, len(queue))
        assert queue, "nothing in flight, nothing scheduled, requests unfinished"
        batch, output = queue.popleft()
        scheduler.update(batch, output)
        steps += 1
        assert steps < 10_000
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    return model


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return [[(seed * 31 + i * 7 + j * 3) % VOCAB for j in range(length + i % 3)] for i in range(n)]


def make_requests(prompt_list, params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", p, params) for i, p in enumerate(prompt_list)]


def assert_matches_reference(requests, eos=(), max_model_len=math.inf):
    for r in requests:
        assert r.status is RequestStatus.FINISHED
        assert (r.output_token_ids, r.finish_reason) == reference(r.prompt_token_ids, r.params, eos, max_model_len), r


# ----------------------------------------------------------------------------- sampling params


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(stop_token_ids="ab"), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(logprobs="yes"), "logprobs"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_and_share_worker_options():
    a = SamplingParams(stop_token_ids=[5, 6], temperature=1)
    assert a.stop_token_ids == (5, 6) and isinstance(a.temperature, float)
    assert a.sampling_options() is SamplingParams(temperature=1.0).sampling_options()
    assert SamplingParams().greedy and not a.greedy


# ----------------------------------------------------------------------------- block manager


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    a: list[int] = []
    assert bm.allocate(a, 5) and a == [0, 1] and bm.num_free_blocks == 2
    assert bm.allocate(a, 8) and a == [0, 1]  # still inside block 1
    b: list[int] = []
    assert not bm.allocate(b, 9) and b == [] and bm.num_free_blocks == 2  # all or nothing
    assert bm.allocate(b, 8) and b == [2, 3] and bm.num_free_blocks == 0
    assert bm.blocks_needed(a, 9) == 1 and not bm.can_allocate(1)
    bm.free(a)
    assert a == [] and bm.num_free_blocks == 2 and bm.num_used_blocks == 2
    assert bm.allocate(a, 1) and len(a) == 1


# ----------------------------------------------------------------------------- scheduler


def scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=None, **kw):
    return Scheduler(
        max_num_seqs,
        max_num_batched_tokens,
        num_blocks,
        block_size,
        max_model_len or num_blocks * block_size,
        **kw,
    )


def test_outputs_match_reference_with_more_requests_than_one_batch_holds():
    s = scheduler(max_num_seqs=3)
    reqs = make_requests(prompts(10, 5), SamplingParams(max_tokens=7))
    model = drive(s, reqs)
    assert_matches_reference(reqs)
    assert max(len(b.chunks) for b in model.batches) == 3
    assert s.num_preemptions == 0


def test_admission_waits_for_kv_space():
    # 3 prompts of 8 tokens need 2 blocks each; 5 blocks admit two of them at first.
    s = scheduler(num_blocks=5, block_size=4, max_model_len=12)
    reqs = make_requests([[1] * 8, [2] * 8, [3] * 8], SamplingParams(max_tokens=2))
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    assert [c.seq_id for c in first.chunks] == [reqs[0].seq_id, reqs[1].seq_id]
    assert reqs[2].status is RequestStatus.WAITING and s.block_manager.num_free_blocks == 1
    model = FakeModel(4)
    s.update(first, model.execute(first))
    second = s.schedule()  # decode of 0 and 1 (positions 8: a new block each: only one free)
    assert reqs[2].status is RequestStatus.WAITING
    s.update(second, model.execute(second))
    drive(s, [], model=model)
    assert_matches_reference(reqs)


def test_preemption_by_recompute_when_blocks_run_out():
    # Each request grows to 6 + 10 = 16 positions (4 blocks); 10 blocks hold two and a half.
    s = scheduler(num_blocks=10, block_size=4, max_num_seqs=4, max_model_len=40)
    reqs = make_requests(prompts(4, 6), SamplingParams(max_tokens=10))
    model = drive(s, reqs)
    assert s.num_preemptions > 0 and any(r.num_preemptions for r in reqs)
    assert_matches_reference(reqs)
    # A recomputed request refeeds prompt plus output in one chunk from position 0, sampling with num_generated.
    victim = next(r for r in reqs if r.num_preemptions)
    refeeds = [
        c for b in model.batches for c in b.chunks if c.seq_id == victim.seq_id and c.start_pos == 0 and c.num_generated
    ]
    assert refeeds and all(len(c.token_ids) == victim.num_prompt_tokens + c.num_generated for c in refeeds)


def test_the_latest_request_is_preempted_first():
    s = scheduler(num_blocks=5, block_size=4, max_model_len=20)
    reqs = make_requests([[1] * 8, [2] * 8], SamplingParams(max_tokens=8))
    model = FakeModel(4)
    for r in reqs:
        s.add_request(r)
    for _ in range(2):  # prefill, then the first decodes cross into block 3
        batch = s.schedule()
        s.update(batch, model.execute(batch))
    assert reqs[0].num_preemptions == 0 and reqs[1].num_preemptions == 1
    assert reqs[1].status is RequestStatus.PREEMPTED and reqs[1].block_table == []
    drive(s, [], model=model)
    assert_matches_reference(reqs)


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_never_one_request_in_two_in_flight_batches(num_blocks):
    s = scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_model_len=40, num_groups=2)
    reqs = make_requests(prompts(9, 6), SamplingParams(max_tokens=9))
    model = drive(s, reqs, inflight=2)  # drive asserts disjoint in-flight batches
    assert_matches_reference(reqs)
    assert model.max_in_flight == 2
    if num_blocks == 64:
        # The live requests split into two groups that alternate through the two slots.
        assert [len(b.chunks) for b in model.batches[:4]] == [5, 4, 5, 4]
    else:
        assert s.num_preemptions > 0


def test_scheduling_the_same_request_twice_is_an_assertion():
    s = scheduler()
    s.add_request(r := Request("a", [1, 2, 3], SamplingParams()))
    batch = s.schedule()
    assert s.schedule() is None  # the only request is in flight
    with pytest.raises(AssertionError, match="in-flight"):
        s._chunk(r, 3, 4, 4)
    assert batch is not None


def test_long_prompts_are_chunked_and_sample_only_on_the_last_chunk():
    s = scheduler(max_num_batched_tokens=8, max_model_len=60)
    req = Request("long", list(range(10, 30)), SamplingParams(max_tokens=3))
    model = drive(s, [req])
    chunks = [c for b in model.batches for c in b.chunks]
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in chunks[:3]] == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert_matches_reference([req])


def test_prefill_chunks_and_decodes_mix_in_one_batch():
    s = scheduler(max_num_batched_tokens=10, max_model_len=60)
    reqs = make_requests([[5, 6], list(range(40, 60))], SamplingParams(max_tokens=4))
    model = drive(s, reqs)
    second = model.batches[1].chunks
    assert [(len(c.token_ids), c.sample) for c in second] == [(1, True), (9, False)]
    assert_matches_reference(reqs)


def test_stop_tokens_finish_with_stop_and_keep_the_token():
    prompt = [7, 8, 9]
    full, _ = reference(prompt, SamplingParams(max_tokens=12))
    stop = full[4]
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
    req = Request("s", prompt, params)
    drive(scheduler(), [req])
    assert req.finish_reason == "stop" and req.output_token_ids == full[: full.index(stop) + 1]


def test_max_tokens_finishes_with_length():
    req = Request("m", [1, 2], SamplingParams(max_tokens=5))
    drive(scheduler(), [req])
    assert req.finish_reason == "length" and req.num_output_tokens == 5


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignore_eos(ignore_eos):
    prompt = [3, 1, 4, 1, 5]
    full, _ = reference(prompt, SamplingParams(max_tokens=10))
    eos = full[2]
    req = Request("e", prompt, SamplingParams(max_tokens=10, ignore_eos=ignore_eos))
    drive(scheduler(eos_token_ids=[eos]), [req])
    if ignore_eos:
        assert req.finish_reason == "length" and req.output_token_ids == full
    else:
        assert req.finish_reason == "stop" and req.output_token_ids == full[: full.index(eos) + 1]


def test_max_model_len_caps_prompt_plus_output():
    req = Request("c", list(range(10)), SamplingParams(max_tokens=50))
    drive(scheduler(max_model_len=14), [req])
    assert req.finish_reason == "length" and req.num_tokens == 14


def test_requests_that_can_never_run_are_refused():
    s = scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        s.add_request(Request("too-long", list(range(8)), SamplingParams()))
    s.add_request(Request("dup", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already queued"):
        s.add_request(Request("dup", [1], SamplingParams()))
    with pytest.raises(ValueError, match="no tokens"):
        Request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=100 needs more KV positions"):
        Scheduler(4, 64, 10, 4, 100)


def test_requeue_recomputes_a_failed_batch():
    s = scheduler()
    reqs = make_requests(prompts(3, 4), SamplingParams(max_tokens=4))
    model = FakeModel(4)
    for r in reqs:
        s.add_request(r)
    batch = s.schedule()
    s.update(batch, model.execute(batch))
    lost = s.schedule()  # its output never arrives
    assert s.requeue(lost) == reqs and s.num_in_flight_batches == 0
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in reqs)
    drive(s, [], model=model)
    assert_matches_reference(reqs)
    with pytest.raises(ValueError, match="not in flight"):
        s.update(lost, ModelOutput(lost.batch_id, [], []))


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_reference(seed):
    """Random prompt lengths, budgets, cache sizes, stop tokens and 1 or 2 batches in flight."""
    import random

    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(24, 48)
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 12)
    inflight = rng.choice([1, 2])
    s = scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1, 40),
        max_model_len=max_model_len,
        num_groups=inflight,
        eos_token_ids=[rng.randrange(3, VOCAB)],
    )
    reqs = []
    for i in range(rng.randint(1, 12)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_model_len - 1))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 20),
            stop_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 3))],
            ignore_eos=rng.random() < 0.3,
        )
        reqs.append(Request(f"q{i}", prompt, params))
    drive(s, reqs, inflight=inflight)
    assert_matches_reference(reqs, eos=s.eos_token_ids, max_model_len=max_model_len)
