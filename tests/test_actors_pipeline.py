"""In-flight batches overlap across stages; deadlines start when the call ahead finishes."""

from __future__ import annotations

import time

import pytest

from actors import ActorTimeout, Supervisor

S = 0.25  # seconds each stage spends per call


@pytest.fixture(scope="module")
def pipeline():
    with Supervisor("tests.workers:PipeStageWorker", {"stage_seconds": S}, pp_size=2, start_timeout=90) as sup:
        sup.collective_rpc("init_distributed", timeout=60)
        sup.submit("step", args=(0,)).result(timeout=30)  # warm the gloo pair up
        yield sup


def test_pipelined_calls_overlap_across_stages(pipeline):
    n = 8
    t0 = time.monotonic()
    futures = [pipeline.submit("step", args=(i,)) for i in range(n)]
    results = [f.result(timeout=60) for f in futures]
    elapsed = time.monotonic() - t0
    assert results == [i + 2 for i in range(n)]
    # Overlapped: about (n + 1) * S = 2.25 s; serialized it would be 2 * n * S = 4 s.
    assert elapsed < (n + 1) * S + 0.8, elapsed
    assert elapsed >= (n + 1) * S - 0.05, elapsed


def test_one_call_in_flight_does_not_overlap():
    with Supervisor("tests.workers:PipeStageWorker", {"stage_seconds": 0.15}, pp_size=2, max_inflight=1) as sup:
        sup.collective_rpc("init_distributed", timeout=60)
        t0 = time.monotonic()
        futures = [sup.submit("step", args=(i,)) for i in range(4)]
        [f.result(timeout=30) for f in futures]
        assert time.monotonic() - t0 >= 2 * 4 * 0.15 - 0.05


def test_queued_call_clock_starts_when_the_call_ahead_finishes():
    with Supervisor("tests.workers:EchoWorker", max_inflight=2) as sup:
        first = sup.submit("sleep", args=(0.6,), timeout=1.0)
        second = sup.submit("sleep", args=(0.6,), timeout=1.0)  # done 1.2 s after submission: still in time
        assert first.result(timeout=5) == (0, 0)
        assert second.result(timeout=5) == (0, 0)


def test_timeout_names_the_ranks_that_did_not_answer_and_their_stacks():
    with Supervisor("tests.workers:EchoWorker", tp_size=2, pp_size=2) as sup:
        t0 = time.monotonic()
        with pytest.raises(ActorTimeout) as info:
            sup.collective_rpc("sleep", kwargs={"seconds": 3.0, "on": (0, 1)}, timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        err = info.value
        assert err.ranks == [(0, 1)]
        assert "rank (pp=0, tp=1)" in str(err)
        assert "in sleep" in err.stacks[(0, 1)]  # faulthandler's dump of the sleeping frame
        assert isinstance(err, TimeoutError)


def test_submit_timeout_names_silent_ranks():
    with Supervisor("tests.workers:EchoWorker", pp_size=2) as sup:
        with pytest.raises(ActorTimeout) as info:
            sup.submit("sleep", kwargs={"seconds": 2.0}, timeout=0.4).result(timeout=5)
        # The non-replying stage 0 is named too: it has not finished the call either.
        assert info.value.ranks == [(0, 0), (1, 0)]
