"""`Engine`: the loop schedule -> submit -> wait for the oldest batch -> update.

Up to `supervisor.max_inflight` (pp_size) batches are outstanding: while there
is room and the scheduler has something to run, the engine submits; then it
waits for the oldest future only, because a pipeline returns batches in the
order it took them and the oldest is the one that frees a slot first. Results
are matched to batches by future, never by arrival order.

The engine checks, for every batch before it is submitted, that none of its
sequences is already in an in-flight batch (or twice in the batch): the
scheduler is built never to do that, and the engine does not take it on trust.

Every batch leaves the queue through `_complete`, the one place that applies an
output or handles a failed batch: its requests go back to the scheduler; a
retryable error (`actors.GangRestarted`: the gang was replaced) is recovered
from, anything else re-raised. After a restart no KV block survives, so every
running request is recomputed from its prompt plus the tokens it has produced
(greedy and seeded output are the same as without the fault).
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future
from typing import Any, Optional

from actors import Supervisor
from models.batch import ModelBatch
from scheduling.request import Request
from scheduling.scheduler import Scheduler

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

# Batches kept in the engine's timeline (get_batch_trace).
BATCH_TRACE_LEN = 4096


class Engine:
    """Drives a `Scheduler` against a gang of `LlamaWorker`s.

    Args:
        supervisor: the gang; `execute_model` runs on every rank, the output rank answers.
        scheduler: its `num_groups` is set to the supervisor's max_inflight so
            that the batches in flight take disjoint groups of requests.
        step_timeout: deadline of each execute_model call in seconds (None: the
            supervisor's call_timeout). A queued batch's clock starts when the
            one ahead of it finishes.
    """

    def __init__(self, supervisor: Supervisor, scheduler: Scheduler, *, step_timeout: Optional[float] = None) -> None:
        self.supervisor = supervisor
        self.scheduler = scheduler
        self.max_inflight = supervisor.max_inflight
        if scheduler.num_groups != self.max_inflight:
            logger.debug("scheduler groups %d -> %d (in-flight slots)", scheduler.num_groups, self.max_inflight)
            scheduler.num_groups = self.max_inflight
        self.step_timeout = step_timeout
        self._queue: collections.deque[tuple[ModelBatch, Future]] = collections.deque()
        self._owner: dict[int, int] = {}  # seq id -> id of the in-flight batch that holds it
        self._submitted: dict[int, tuple[float, int]] = {}  # batch id -> (when submitted, tokens)
        self._trace: collections.deque = collections.deque(maxlen=BATCH_TRACE_LEN)
        self.num_batches = 0
        self.peak_in_flight = 0
        self.num_recoveries = 0
        self.num_tokens = 0
        self.schedule_seconds = 0.0
        self.update_seconds = 0.0

    def set_max_inflight(self, n: int) -> None:
        """Keep at most `n` batches in flight from now on (1 <= n <= the supervisor's max_inflight).

        With n = 1 a pipeline runs one batch at a time through its stages, the baseline of
        its overlap; the scheduler's request groups follow. Only between runs: raises
        RuntimeError while batches are in flight.
        """
        if not isinstance(n, int) or not 1 <= n <= self.supervisor.max_inflight:
            raise ValueError(f"max_inflight must be an integer in [1, {self.supervisor.max_inflight}], got {n!r}")
        if self._queue:
            raise RuntimeError(f"cannot change max_inflight with {len(self._queue)} batches in flight")
        self.max_inflight = n
        self.scheduler.num_groups = n

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return bool(self._queue) or self.scheduler.has_unfinished()

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def step(self) -> list[Request]:
        """Fills the in-flight queue, then completes its oldest batch; returns the requests that finished."""
        queue = self._queue
        scheduler = self.scheduler
        while len(queue) < self.max_inflight:
            start = time.perf_counter()
            batch = scheduler.schedule()
            self.schedule_seconds += time.perf_counter() - start
            if batch is None:
                break
            self._claim(batch)
            future = self._submit(batch)
            queue.append((batch, future))
            if len(queue) > self.peak_in_flight:
                self.peak_in_flight = len(queue)
            if future.done() and future.exception() is not None:
                break  # the gang is gone; do not schedule more into it
        if not queue:
            if scheduler.has_unfinished():
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            return []
        return self._complete()

    def _claim(self, batch: ModelBatch) -> None:
        """Records the batch's sequences as in flight; AssertionError if one already is, or is in it twice."""
        owner = self._owner
        seqs = [chunk.seq_id for chunk in batch.chunks]
        clash = {seq: owner[seq] for seq in seqs if seq in owner}
        if clash or len(set(seqs)) != len(seqs):
            # Raised, not `assert`ed, so that `python -O` keeps the check.
            twice = sorted({seq for seq in seqs if seqs.count(seq) > 1})
            raise AssertionError(
                f"batch {batch.batch_id} would put a request in two in-flight batches: "
                f"sequences already in flight (seq id -> batch) {clash}, twice in the batch {twice}"
            )
        for seq in seqs:
            owner[seq] = batch.batch_id

    def _release(self, batch: ModelBatch) -> None:
        for chunk in batch.chunks:
            self._owner.pop(chunk.seq_id, None)

    def _submit(self, batch: ModelBatch) -> Future:
        tokens = sum(len(c.token_ids) for c in batch.chunks)
        self.num_batches += 1
        self.num_tokens += tokens
        self._submitted[batch.batch_id] = (time.perf_counter(), tokens)
        try:
            # critical: a rank failing mid-step leaves its peers inside a collective, so the gang is broken.
            return self.supervisor.submit("execute_model", args=(batch,), timeout=self.step_timeout, critical=True)
        except Exception as exc:
            # A batch that could not be sent fails like one that was: through _complete.
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def _complete(self) -> list[Request]:
        batch, future = self._queue[0]
        # Left in the queue while waiting, so that an interrupt leaves it for abort() to drain.
        try:
            output = future.result()
        except Exception as exc:
            self._submitted.pop(batch.batch_id, None)
            self._queue.popleft()
            self._release(batch)
            self.scheduler.requeue(batch)
            if not getattr(exc, "retryable", False):
                raise
            self._recover(exc)
            return []
        self._queue.popleft()
        self._release(batch)
        start = time.perf_counter()
        submitted, tokens = self._submitted.pop(batch.batch_id)
        self._trace.append((batch.batch_id, submitted, start, len(batch.chunks), tokens))
        finished = self.scheduler.update(batch, output)
        self.update_seconds += time.perf_counter() - start
        return finished

    def _recover(self, exc: Exception) -> None:
        # The other batches in flight ran on the old gang's cache, or on the new gang
        # with a cache that lacks their context: whatever they return is dropped.
        self.num_recoveries += 1
        logger.warning("recomputing every running request after: %s", exc)
        while self._queue:
            batch, future = self._queue.popleft()
            self._submitted.pop(batch.batch_id, None)
            self._release(batch)
            try:
                future.result()  # bounded by the call's deadline
            except Exception as late:  # noqa: BLE001 - dropped either way
                logger.debug("dropped batch %d: %s", batch.batch_id, type(late).__name__)
            self.scheduler.requeue(batch)
        self.scheduler.reset_kv()

    def abort(self, timeout: Optional[float] = 30.0) -> list[Request]:
        """Waits (bounded) for the batches still in flight, ignoring their results, and drops every request."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue:
            batch, future = self._queue.popleft()
            self._submitted.pop(batch.batch_id, None)
            self._release(batch)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(timeout=left)
            except BaseException as exc:  # noqa: BLE001 - results of aborted work do not matter
                logger.debug("aborted batch ended with %s", type(exc).__name__)
        return self.scheduler.abort_all()

    def get_batch_trace(self, clear: bool = False) -> list[tuple[int, float, float, int, int]]:
        """The last completed batches (at most BATCH_TRACE_LEN): (batch_id, submitted, result_seen, chunks, tokens).

        Times are `time.perf_counter()` seconds, the clock of the ranks' `get_step_trace`;
        result_seen is when the engine had the batch's output in hand. A batch with more
        tokens than chunks carries a prompt chunk. clear=True empties the timeline.
        """
        trace = list(self._trace)
        if clear:
            self._trace.clear()
        return trace

    def stats(self) -> dict[str, Any]:
        """Counters of this engine: batches, tokens fed, and the scheduler's own time."""
        return {
            "num_batches": self.num_batches,
            "peak_in_flight": self.peak_in_flight,
            "num_recoveries": self.num_recoveries,
            "num_tokens": self.num_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "schedule_seconds": self.schedule_seconds,
            "update_seconds": self.update_seconds,
        }
