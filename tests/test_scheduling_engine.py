"""The engine loop against a stand-in gang: in-flight depth, oldest-first completion, errors.

The stand-in runs batches in submission order, as a pipeline does, and only when
the engine asks for a result, so the tests see exactly what the engine keeps
outstanding. The real gang is exercised in test_scheduling_llm.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import pytest

from actors import SupervisorClosed
from models.batch import ModelBatch
from scheduling import Engine, Request, SamplingParams, Scheduler
from tests.test_scheduling_scheduler import FakeModel, assert_matches_reference, prompts

pytestmark = pytest.mark.timeout(60)


class Restarted(RuntimeError):
    retryable = True  # as actors.GangRestarted


class PipelineFuture(Future):
    def __init__(self, gang: "FakeGang") -> None:
        super().__init__()
        self.gang = gang

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.done():
            self.gang.run_until(self)
        return super().result(timeout)


class FakeGang:
    """Has `max_inflight` and `submit` like actors.Supervisor; batches run in order when a result is wanted."""

    def __init__(
        self, max_inflight: int, block_size: int, fail_batch: Optional[int] = None, restart_batch: Optional[int] = None
    ) -> None:
        self.max_inflight = max_inflight
        self.restart_batch = restart_batch
        self.model = FakeModel(block_size)
        self.pending: list[tuple[ModelBatch, PipelineFuture]] = []
        self.fail_batch = fail_batch
        self.max_outstanding = 0
        self.waited_on_oldest = True
        self.closed = False

    def submit(self, method: str, args=(), kwargs=None, reply_rank=None, timeout=None, critical=False) -> Future:
        assert method == "execute_model" and critical
        if self.closed:
            raise SupervisorClosed("the supervisor is closed")
        assert len(self.pending) < self.max_inflight, "submitted past max_inflight"
        future = PipelineFuture(self)
        self.pending.append((args[0], future))
        self.max_outstanding = max(self.max_outstanding, len(self.pending))
        return future

    def run_until(self, future: PipelineFuture) -> None:
        self.waited_on_oldest &= self.pending[0][1] is future
        while self.pending:
            batch, f = self.pending.pop(0)
            if batch.batch_id == self.fail_batch:
                f.set_exception(RuntimeError(f"batch {batch.batch_id} failed"))
            elif batch.batch_id == self.restart_batch:
                # Like GangRestarted: this and every other pending call fail, and the new gang's cache is empty.
                self.restart_batch = None
                self.model.slots.clear()
                for _, other in [(batch, f)] + self.pending:
                    other.set_exception(Restarted(f"gang restarted during batch {batch.batch_id}"))
                self.pending.clear()
                return
            else:
                f.set_result(self.model.execute(batch))
            if f is future:
                return


def make_engine(gang: FakeGang, **kw: Any) -> Engine:
    options = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4, max_model_len=48)
    options.update(kw)
    scheduler = Scheduler(
        options["max_num_seqs"],
        options["max_num_batched_tokens"],
        options["num_blocks"],
        options["block_size"],
        options["max_model_len"],
    )
    return Engine(gang, scheduler)  # type: ignore[arg-type]


def run(engine: Engine) -> list[Request]:
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    return finished


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_engine_keeps_max_inflight_batches_and_waits_for_the_oldest(max_inflight):
    gang = FakeGang(max_inflight, block_size=4)
    engine = make_engine(gang)
    assert engine.scheduler.num_groups == max_inflight
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts(7, 5))]
    for r in reqs:
        engine.add_request(r)
    finished = run(engine)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert gang.max_outstanding == max_inflight and gang.waited_on_oldest
    assert_matches_reference(reqs)
    stats = engine.stats()
    assert stats["num_batches"] == len(gang.model.batches) and stats["schedule_seconds"] > 0


def test_fewer_batches_in_flight_can_be_set_between_runs():
    gang = FakeGang(2, block_size=4)
    engine = make_engine(gang)
    for bad in (0, 3, 1.0):
        with pytest.raises(ValueError, match=r"max_inflight must be an integer in \[1, 2\]"):
            engine.set_max_inflight(bad)
    engine.set_max_inflight(1)
    assert engine.max_inflight == engine.scheduler.num_groups == 1
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts(7, 5))]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # one batch in flight now, and one completed
    assert gang.max_outstanding == 1
    engine.set_max_inflight(2)  # nothing in flight between steps at depth 1
    engine.add_request(Request("late", prompts(1, 5)[0], SamplingParams(max_tokens=6)))
    engine.step()
    with pytest.raises(RuntimeError, match="batches in flight"):
        engine.set_max_inflight(1)
    run(engine)
    assert gang.max_outstanding == 2
    assert_matches_reference(reqs)


def test_a_failed_batch_raises_and_gives_its_requests_back():
    gang = FakeGang(2, block_size=4, fail_batch=3)
    engine = make_engine(gang)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts(4, 5))]
    for r in reqs:
        engine.add_request(r)
    with pytest.raises(RuntimeError, match="batch 3 failed"):
        run(engine)
    # The failed batch left the queue and its requests wait to be recomputed; nothing is lost.
    assert engine.scheduler.num_unfinished == 4 and engine.num_in_flight <= 1
    # Only the batch still queued holds sequences in the engine's in-flight record.
    assert set(engine._owner) == {c.seq_id for b, _ in engine._queue for c in b.chunks}
    gang.fail_batch = None
    run(engine)
    assert_matches_reference(reqs)
    assert not engine._owner


def test_a_batch_that_cannot_be_submitted_fails_the_step():
    gang = FakeGang(2, block_size=4)
    engine = make_engine(gang)
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    gang.closed = True
    with pytest.raises(SupervisorClosed):
        engine.step()
    dropped = engine.abort()
    assert [r.request_id for r in dropped] == ["a"] and not engine.has_unfinished()


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_a_retryable_failure_recomputes_every_running_request(max_inflight):
    gang = FakeGang(max_inflight, block_size=4, restart_batch=5)
    engine = make_engine(gang)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts(5, 5))]
    for r in reqs:
        engine.add_request(r)
    run(engine)  # the fake model asserts if any request reads KV the restart wiped
    assert engine.stats()["num_recoveries"] == 1 and gang.restart_batch is None
    assert all(r.num_preemptions >= 1 for r in reqs)
    assert_matches_reference(reqs)
    assert not engine._owner  # the batches dropped by the recovery left the record too


class RepeatingScheduler(Scheduler):
    """A broken scheduler: its second batch carries a sequence of its first (or one sequence twice)."""

    def __init__(self, *args: Any, twice_in_one: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.first: Optional[ModelBatch] = None
        self.twice_in_one = twice_in_one

    def schedule(self) -> Optional[ModelBatch]:
        batch = super().schedule()
        if batch is None:
            return None
        if self.twice_in_one:
            return ModelBatch(batch.batch_id, [*batch.chunks, batch.chunks[0]])
        if self.first is None:
            self.first = batch
            return batch
        return ModelBatch(batch.batch_id, [*batch.chunks, self.first.chunks[0]])


@pytest.mark.parametrize("twice_in_one", [False, True], ids=["two-batches", "one-batch"])
def test_the_engine_refuses_a_request_in_two_in_flight_batches(twice_in_one):
    gang = FakeGang(2, block_size=4)
    scheduler = RepeatingScheduler(8, 64, 64, 4, 48, twice_in_one=twice_in_one)
    engine = Engine(gang, scheduler)  # type: ignore[arg-type]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts(4, 5))]
    for r in reqs:
        engine.add_request(r)
    with pytest.raises(AssertionError, match="would put a request in two in-flight batches") as exc:
        engine.step()
    seq = reqs[0].seq_id
    if twice_in_one:
        assert f"twice in the batch [{seq}]" in str(exc.value)
        assert not gang.pending  # refused before anything was submitted
    else:
        assert f"{{{seq}: 0}}" in str(exc.value)  # sequence -> the in-flight batch that holds it
        assert [b.batch_id for b, _ in gang.pending] == [0]  # the first went out, the second did not
    dropped = engine.abort()
    assert sorted(r.request_id for r in dropped) == sorted(r.request_id for r in reqs)
    assert not engine.has_unfinished() and not engine._owner

