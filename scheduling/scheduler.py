"""`Scheduler`: turns requests into `ModelBatch`es and applies the tokens that come back.

Each request has a count of computed tokens (positions whose KV is cached or is
being computed by an in-flight batch). Scheduling a chunk advances it at once, as
vLLM's v1 scheduler does, and marks the request in flight; a request in flight is
never scheduled again until its batch's output is applied, so with pp_size
batches outstanding no request is ever in two of them.

One step:

1. Running requests that are not in flight ("ready"), oldest first: a decode
   token each, or the next chunk of a prompt whose prefill was cut by the token
   budget. A request that needs a new KV block and finds none preempts, by
   recompute, the ready request that arrived last (possibly itself): its blocks
   are freed and it goes back to the front of the waiting queue with its computed
   count at 0. If a later arrival holds blocks but is in flight (or already in
   this batch), it waits a step instead, and that one goes once it is ready.
2. Waiting requests, first come first served, while the batch has room and
   their blocks fit: a request is admitted only if the blocks for its whole
   (re)prefill are free, and gets them all at once, so its later prefill chunks
   never need a block. A recomputed request refeeds prompt plus output, and its
   sampler seed stays consistent because the chunk carries num_generated.

Pipeline parallelism: a batch takes at most ceil(live requests / num_groups)
sequences, so with num_groups = pp_size the live requests split into pp_size
groups that alternate through the pipeline (batch i+1 is built from the
requests not in batch i).

Everything per step is O(requests scheduled), built from plain lists.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Iterable, Optional

from models.batch import ModelBatch, ModelOutput, SequenceChunk
from scheduling.block_manager import BlockManager
from scheduling.request import Request, RequestStatus

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, KV admission and preemption by recompute.

    Args:
        max_num_seqs: most sequences in one batch.
        max_num_batched_tokens: most tokens in one batch (prefill chunks plus decode tokens).
        num_blocks, block_size: the KV cache (the smallest num_blocks over the ranks).
        max_model_len: most tokens (prompt plus output) of one request; must fit the cache.
        num_groups: batches meant to be in flight at once (the pipeline depth).
        eos_token_ids: the model's end-of-sequence tokens (a request stops on them unless ignore_eos).
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        num_groups: int = 1,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("num_groups", num_groups),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_manager = BlockManager(num_blocks, block_size)
        if max_model_len > num_blocks * block_size:
            # A lone request must always fit, or preemption could not guarantee progress.
            raise ValueError(
                f"max_model_len={max_model_len} needs more KV positions than the cache holds "
                f"({num_blocks} blocks of {block_size}); lower it or give the cache more memory"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_groups = num_groups
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.num_preemptions = 0
        self._waiting: collections.deque[Request] = collections.deque()
        # Running (holding blocks) and not in flight, in the order they are served.
        self._ready: collections.deque[Request] = collections.deque()
        self._in_flight: dict[int, list[Request]] = {}
        self._live: dict[str, Request] = {}
        self._num_running = 0
        self._seq_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._arrivals = itertools.count()

    # ----- state -----

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (ready or in flight)."""
        return self._num_running

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def num_in_flight_batches(self) -> int:
        return len(self._in_flight)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def in_flight_batch_ids(self) -> list[int]:
        return list(self._in_flight)

    # ----- requests -----

    def add_request(self, request: Request) -> None:
        """Queues a new request (FIFO); assigns its seq_id. Raises ValueError if it can never run."""
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled once")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: its prompt has {request.num_prompt_tokens} tokens, "
                f"max_model_len={self.max_model_len} leaves no room to generate"
            )
        request.seq_id = next(self._seq_ids)
        request.arrival = next(self._arrivals)
        if not request.params.ignore_eos and self.eos_token_ids:
            request.stop_ids = request.stop_ids | self.eos_token_ids
        self._live[request.request_id] = request
        self._waiting.append(request)

    def abort_all(self) -> list[Request]:
        """Drops every unfinished request (in flight too) and frees the whole cache; returns them."""
        dropped = list(self._live.values())
        for req in dropped:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            req.in_flight = False
            req.block_table = []
        self._live.clear()
        self._waiting.clear()
        self._ready.clear()
        self._in_flight.clear()
        self._num_running = 0
        self.block_manager = BlockManager(self.block_manager.num_blocks, self.block_manager.block_size)
        return dropped

    # ----- scheduling -----

    def schedule(self) -> Optional[ModelBatch]:
        """The next batch, from requests not in flight; None when there is nothing to run now."""
        if not self._live:
            return None
        bm = self.block_manager
        bs = bm.block_size
        ready = self._ready
        budget = self.max_num_batched_tokens
        seq_cap = min(self.max_num_seqs, -(-len(self._live) // self.num_groups))
        scheduled: list[Request] = []
        chunks: list[SequenceChunk] = []
        deferred: list[Request] = []
        preempted = False

        while ready and len(chunks) < seq_cap and budget > 0:
            req = ready.popleft()
            start = req.num_computed_tokens
            end = min(req.num_tokens, start + budget)
            if not bm.allocate(req.block_table, end):
                outcome = self._make_room(req, end, scheduled)
                if outcome == "preempted":
                    preempted = True
                    continue
                if outcome == "wait":
                    deferred.append(req)
                    continue
                preempted = True  # room made by preempting others
            chunks.append(self._chunk(req, start, end, bs))
            scheduled.append(req)
            budget -= end - start
        if deferred:
            ready.extendleft(reversed(deferred))

        # After a preemption, admitting new work would only refill the cache it just
        # freed, unless this step would otherwise run nothing at all.
        if not preempted or not (chunks or self._in_flight):
            waiting = self._waiting
            while waiting and len(chunks) < seq_cap and budget > 0:
                req = waiting[0]
                if not bm.allocate(req.block_table, req.num_tokens):
                    break  # first come first served: no overtaking by smaller requests
                waiting.popleft()
                req.status = RequestStatus.RUNNING
                self._num_running += 1
                end = min(req.num_tokens, budget)
                chunks.append(self._chunk(req, 0, end, bs))
                scheduled.append(req)
                budget -= end

        if not chunks:
            return None
        batch_id = next(self._batch_ids)
        self._in_flight[batch_id] = scheduled
        return ModelBatch(batch_id, chunks)

    def _chunk(self, req: Request, start: int, end: int, block_size: int) -> SequenceChunk:
        assert not req.in_flight, f"{req} is already in an in-flight batch"
        req.in_flight = True
        req.num_computed_tokens = end
        tokens = req.token_ids
        return SequenceChunk(
            req.seq_id,
            [tokens[start]] if end - start == 1 else tokens[start:end],
            start,
            req.block_table[: -(-end // block_size)],
            end == len(tokens),
            req.options,
            len(tokens) - req.num_prompt_tokens,
        )

    def _make_room(self, req: Request, end: int, scheduled: list[Request]) -> str:
        """Frees blocks for `req` by preempting the ready requests that arrived last (O(ready); only when short of blocks).

        Returns "allocated"; "preempted" when req itself arrived last and goes; or
        "wait" when a later arrival holds blocks but is in flight or already in
        this batch (it becomes the victim next step, once it is ready again).
        """
        bm = self.block_manager
        ready = self._ready
        while True:
            victim = max(ready, key=_arrival, default=None)
            if victim is None or victim.arrival < req.arrival:
                busy = itertools.chain(scheduled, itertools.chain.from_iterable(self._in_flight.values()))
                if any(r.arrival > req.arrival for r in busy):
                    return "wait"
                self._preempt(req)
                return "preempted"
            ready.remove(victim)
            self._preempt(victim)
            if bm.allocate(req.block_table, end):
                return "allocated"

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.block_table)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._num_running -= 1
        self._waiting.appendleft(req)
        logger.debug("preempted %r (recompute)", req)

    # ----- results -----

    def update(self, batch: ModelBatch, output: ModelOutput) -> list[Request]:
        """Applies an in-flight batch's sampled tokens; returns the requests that finished."""
        reqs = self._pop_in_flight(batch)
        if output.batch_id != batch.batch_id:
            raise ValueError(f"output of batch {output.batch_id} given for batch {batch.batch_id}")
        tokens, seq_ids, logprobs = output.token_ids, output.seq_ids, output.logprobs
        max_len = self.max_model_len
        ready = self._ready
        finished: list[Request] = []
        j = 0
        for chunk, req in zip(batch.chunks, reqs):
            req.in_flight = False
            if chunk.sample:
                if j >= len(tokens) or seq_ids[j] != req.seq_id:
                    raise ValueError(f"batch {batch.batch_id}: output has no token for seq {req.seq_id} at row {j}")
                token = tokens[j]
                req.token_ids.append(token)
                if req.logprobs is not None and logprobs is not None:
                    req.logprobs.append(logprobs[j])
                j += 1
                if token in req.stop_ids:
                    self._finish(req, "stop")
                    finished.append(req)
                    continue
                if len(req.token_ids) - req.num_prompt_tokens >= req.params.max_tokens or len(req.token_ids) >= max_len:
                    self._finish(req, "length")
                    finished.append(req)
                    continue
            ready.append(req)
        if j != len(tokens):
            raise ValueError(f"batch {batch.batch_id}: output has {len(tokens)} tokens, {j} were sampled")
        return finished

    def requeue(self, batch: ModelBatch) -> list[Request]:
        """Puts the requests of a failed in-flight batch back in front of the waiting queue, to be recomputed."""
        reqs = self._pop_in_flight(batch)
        for req in reversed(reqs):
            req.in_flight = False
            self._preempt(req)
        return reqs

    def reset_kv(self) -> None:
        """Every KV block was lost (the gang restarted): all running requests wait to be recomputed, in arrival order."""
        assert not self._in_flight, "requeue the in-flight batches first"
        for req in self._ready:
            self._preempt(req)
        self._ready.clear()
        self._waiting = collections.deque(sorted(self._waiting, key=_arrival))

    def _pop_in_flight(self, batch: ModelBatch) -> list[Request]:
        try:
            return self._in_flight.pop(batch.batch_id)
        except KeyError:
            raise ValueError(f"batch {batch.batch_id} is not in flight") from None

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.block_manager.free(req.block_table)
        self._num_running -= 1
        del self._live[req.request_id]


def _arrival(req: Request) -> int:
    return req.arrival
